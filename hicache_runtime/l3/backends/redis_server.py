"""A throwaway local ``redis-server`` for tests, benchmarks and demos.

Runs the real server binary on 127.0.0.1, without persistence, in a directory of its own. It
can be killed (SIGKILL, to simulate a crash) and started again on the same port, which is how
tests exercise the Redis backend's outage handling.

Not thread-safe: one owner starts and stops it.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hicache_runtime.contracts.errors import StorageUnavailable, ToolUnavailable


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` on PATH, or None."""
    return shutil.which("redis-server")


_PORT_TRIES = 8


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (someone else may take it before
    it is bound again: :class:`LocalRedisServer` retries with another one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_STABLE_LOW = 10000
"""The lowest port :func:`stable_port` picks."""


def stable_port() -> int:
    """A free TCP port on 127.0.0.1 for a server that is started again on the same port (an
    outage and its end): one below the kernel's ephemeral range (``ip_local_port_range``),
    from which the kernel hands out every port-0 bind and the local port of every outgoing
    connection. A port from that range, free when picked, can be taken by any connection on
    the machine while its server is down (it was, under four test processes: the restarted
    Mooncake master exited and its holder never rejoined). Below the range only another
    explicit bind can take it. :func:`free_port` when the range leaves no room below it."""
    low = _ephemeral_low()
    if low <= _STABLE_LOW + 1:
        return free_port()
    pick = random.SystemRandom()  # not the seeded module generator: processes must differ
    for _ in range(64):
        port = pick.randrange(_STABLE_LOW, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere IANA's 49152)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text(encoding="ascii")
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


class _PortInUse(Exception):
    """redis-server could not bind its port (``Address already in use``)."""


class LocalRedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port``.

    ``start`` raises :class:`ToolUnavailable` when the binary is missing and
    :class:`StorageUnavailable` when the server does not answer in time.
    """

    def __init__(self, port: int | None = None, workdir: Path | None = None,
                 maxmemory: str | None = None) -> None:
        self.port = port or stable_port()
        self._port_chosen = port is None
        """The port was picked here: a first start that finds it taken may pick another."""
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
        """Start the server. A port this object picked that another process bound in the
        meantime is replaced with a fresh one (only before the first successful start: a
        restart keeps its port, which clients already know)."""
        for attempt in range(_PORT_TRIES):
            try:
                self._start_once(timeout_s)
            except _PortInUse:
                if not self._port_chosen or attempt == _PORT_TRIES - 1:
                    raise StorageUnavailable(f"redis-server: port {self.port} is in use") \
                        from None
                self.port = stable_port()
                continue
            self._port_chosen = False
            return self
        return self  # not reached

    def _start_once(self, timeout_s: float) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise ToolUnavailable("redis-server is not on PATH",
                                  hint="install it (apt-get install redis-server)")
        if self.running:
            return
        log = self.workdir / "redis.log"
        log.unlink(missing_ok=True)  # what it says now is about this start
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
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                self.kill()
                if "in use" in f"{err}\n{tail}":
                    raise _PortInUse(self.port)
                raise StorageUnavailable(
                    f"redis-server on port {self.port} exited at start: {(err or tail).strip()}"
                )
            if self.ping() and self._serving_pid() == self._proc.pid:
                return  # the pid check: another server on a port we lost would answer too
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

    def _serving_pid(self) -> int | None:
        """``process_id`` of the server answering on our port (``INFO server``)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
                data = b""
                while b"process_id:" not in data or not data.endswith(b"\r\n"):
                    chunk = s.recv(4096)
                    if not chunk or len(data) > 65536:
                        break
                    data += chunk
        except OSError:
            return None
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("process_id:") and line[11:].strip().isdigit():
                return int(line[11:].strip())
        return None

    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown) and wait for it to exit."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None

    def close(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalRedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
