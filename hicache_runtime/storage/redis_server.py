"""A throwaway local ``redis-server`` for tests, benchmarks and demos.

Runs the real server binary on 127.0.0.1, without persistence, in a directory of its own. It
can be killed (SIGKILL, to simulate a crash) and started again on the same port, which is how
tests exercise the Redis backend's outage handling.

Not thread-safe: one owner starts and stops it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hicache_runtime.errors import StorageUnavailable, ToolUnavailable


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` on PATH, or None."""
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port``.

    ``start`` raises :class:`ToolUnavailable` when the binary is missing and
    :class:`StorageUnavailable` when the server does not answer in time.
    """

    def __init__(self, port: int | None = None, workdir: Path | None = None,
                 maxmemory: str | None = None) -> None:
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hicache-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        binary = redis_server_binary()
        if binary is None:
            raise ToolUnavailable("redis-server is not on PATH",
                                  hint="install it (apt-get install redis-server)")
        if self.running:
            return self
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no",
                "--daemonize", "no", "--loglevel", "warning",
                "--logfile", str(self.workdir / "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr \
                    else ""
                log = self.workdir / "redis.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise StorageUnavailable(
                    f"redis-server on port {self.port} exited at start: {(err or tail).strip()}"
                )
            if self.ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise StorageUnavailable(f"redis-server on port {self.port} did not answer in "
                                 f"{timeout_s:g} s")

    def ping(self) -> bool:
        """Whether the server answers PING (raw RESP over a socket, no client state)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"*1\r\n$4\r\nPING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown) and wait for it to exit."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None

    def restart(self, timeout_s: float = 10.0) -> LocalRedisServer:
        """Kill (if running) and start again on the same port."""
        self.kill()
        return self.start(timeout_s)

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
