"""A throwaway local Mooncake Store for tests, benchmarks and ``hicache run --storage mooncake``
without a URL: ``mooncake_master`` (with its embedded HTTP metadata server) and one
``mooncake_client`` process holding the store's memory, all on free loopback ports.

Why a separate segment holder: Mooncake keeps objects in memory segments that its clients
contribute, and a client's segment (with every object in it) goes away when the client exits.
The ranks contribute none (``segment=0`` in the URL, upstream's advice for SGLang); the holder
outlives them, so a second run on the same master is served from L3.

The master can be killed (SIGKILL: a crash) and started again on the same ports; the holder
and every client reconnect by themselves (a restarted master starts empty). Processes are
stopped by pid, never by name.

Not thread-safe: one owner starts and stops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from hicache_runtime.contracts.errors import StorageUnavailable, ToolUnavailable
from hicache_runtime.l3.backends.mooncake_client import INSTALL_HINT
from hicache_runtime.l3.backends.redis_server import stable_port

DEFAULT_SEGMENT_MIB = 256
_PORT_TRIES = 8
_POLL_S = 0.05
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback requests never go through a proxy from the environment."""


def mooncake_binary(name: str) -> str | None:
    """Path of a Mooncake binary (``mooncake_master``, ``mooncake_client``): on PATH, or next
    to this Python (a virtual environment's ``bin`` that is not on PATH); None if absent."""
    found = shutil.which(name)
    if found:
        return found
    local = Path(sys.executable).with_name(name)
    return str(local) if local.is_file() else None


class LocalMooncakeStore:
    """``mooncake_master`` plus one segment holder on 127.0.0.1.

    ``start`` raises :class:`ToolUnavailable` when the binaries are missing and
    :class:`StorageUnavailable` when the store is not ready in time.
    """

    def __init__(self, *, segment_mib: int = DEFAULT_SEGMENT_MIB,
                 workdir: Path | None = None, client_ttl_s: int | None = None) -> None:
        self.segment_mib = segment_mib
        self.client_ttl_s = client_ttl_s
        """How long the master keeps a client (and its segment) without a heartbeat; None:
        the master's default (10 s). Tests shorten it to expire the holder's lease quickly."""
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="hicache-mooncake-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._pick_ports()
        self._ports_fixed = False
        """Set after the first start: a restart keeps the ports clients already know."""
        self._master: subprocess.Popen[bytes] | None = None
        self._holder: subprocess.Popen[bytes] | None = None

    def _pick_ports(self) -> None:
        self.rpc_port, self.http_port, self.admin_port, self.holder_port = (
            stable_port() for _ in range(4))

    @property
    def url(self) -> str:
        """The store as a ``--storage-url`` (ranks contribute no memory: ``segment=0``)."""
        return (f"mooncake://127.0.0.1:{self.rpc_port}"
                f"?metadata=http://127.0.0.1:{self.http_port}/metadata")

    @property
    def master_pid(self) -> int | None:
        return self._master.pid if self._master is not None and self.master_running else None

    @property
    def master_running(self) -> bool:
        return self._master is not None and self._master.poll() is None

    @property
    def master_log(self) -> Path:
        return self.workdir / "master.log"

    @property
    def holder_log(self) -> Path:
        return self.workdir / "holder.log"

    def start(self, timeout_s: float = 30.0) -> LocalMooncakeStore:
        """Start the master (if not running) and the holder (if not running); return once the
        holder's segment is mounted. Ports this object picked that someone took meanwhile are
        replaced (before the first start only). A start that fails stops what it started (no
        master is left running without its holder)."""
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalMooncakeStore:
        for attempt in range(_PORT_TRIES):
            try:
                self.start_master(timeout_s)
                break
            except StorageUnavailable:
                if self._ports_fixed or attempt == _PORT_TRIES - 1:
                    raise
                self._pick_ports()
        self._ports_fixed = True
        if self._holder is None or self._holder.poll() is not None:
            self._holder = self._spawn("mooncake_client", self.holder_log, [
                "-host", "127.0.0.1", "-port", str(self.holder_port),
                "-master_server_address", f"127.0.0.1:{self.rpc_port}",
                "-metadata_server", f"http://127.0.0.1:{self.http_port}/metadata",
                "-global_segment_size", f"{self.segment_mib} MB", "-protocol", "tcp"])
        self.wait_ready(timeout_s)
        return self

    def start_master(self, timeout_s: float = 30.0) -> None:
        """Start ``mooncake_master`` on this object's ports and wait until it answers."""
        if self.master_running:
            return
        self._master = self._spawn("mooncake_master", self.master_log, [
            "-rpc_port", str(self.rpc_port), "-rpc_address", "127.0.0.1",
            "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
            "-http_metadata_server_port", str(self.http_port),
            "-metrics_port", str(self.admin_port), "-metrics_host", "127.0.0.1",
            "-enable_metric_reporting=false",
            *(["-client_ttl", str(self.client_ttl_s)] if self.client_ttl_s else [])])
        deadline = time.monotonic() + timeout_s
        # The admin port answers before the RPC port is bound; a master whose RPC port is
        # taken (by any connection's local port) answers there for a moment, then exits 1.
        while self._admin("/get_all_segments") is None or not _accepts(self.rpc_port):
            if not self.master_running:
                tail = _tail(self.master_log)
                self._master = None
                raise StorageUnavailable(f"mooncake_master exited at start: {tail}")
            if time.monotonic() > deadline:
                self.kill_master()
                raise StorageUnavailable(f"mooncake_master did not answer in {timeout_s:g} s")
            time.sleep(_POLL_S)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the master lists a mounted segment (the holder joined, or rejoined
        after a master restart)."""
        deadline = time.monotonic() + timeout_s
        while not (self._admin("/get_all_segments") or "").strip():
            if self._master is not None and not self.master_running:
                tail = _tail(self.master_log)
                raise StorageUnavailable(f"mooncake_master exited: {tail}")
            if self._holder is not None and self._holder.poll() is not None:
                tail = _tail(self.holder_log)
                raise StorageUnavailable(f"mooncake_client (segment holder) exited: {tail}")
            if time.monotonic() > deadline:
                raise StorageUnavailable(f"the Mooncake store was not ready in {timeout_s:g} s "
                                         f"(logs in {self.workdir})")
            time.sleep(_POLL_S)

    def pause_holder(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the segment holder and return once the kernel reports it stopped (a signal
        is delivered asynchronously): its heartbeats stop, and past the client TTL the master
        expires its lease (its segment and every object in it)."""
        if self._holder is not None and self._holder.poll() is None:
            os.kill(self._holder.pid, signal.SIGSTOP)
            deadline = time.monotonic() + timeout_s
            while not self.holder_stopped():
                if time.monotonic() > deadline:
                    raise StorageUnavailable(f"the segment holder (pid {self._holder.pid}) did "
                                             f"not stop in {timeout_s:g} s")
                time.sleep(0.005)

    def holder_stopped(self) -> bool:
        """Whether the holder is stopped by a signal (state ``T`` in ``/proc/PID/stat``)."""
        if self._holder is None or self._holder.poll() is not None:
            return False
        try:
            stat = Path(f"/proc/{self._holder.pid}/stat").read_text()
        except OSError:
            return False
        # the state follows the command name, which is in parentheses and may hold spaces
        return stat[stat.rfind(")") + 2 :][:1] == "T"

    def resume_holder(self) -> None:
        """SIGCONT the segment holder (it remounts its segment if its lease expired)."""
        if self._holder is not None and self._holder.poll() is None:
            os.kill(self._holder.pid, signal.SIGCONT)

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: no clean shutdown) and wait for it to exit."""
        _kill(self._master)
        self._master = None

    def restart_master(self, timeout_s: float = 30.0) -> None:
        """Kill the master if running, start it on the same ports, wait for the holder."""
        self.kill_master()
        self.start_master(timeout_s)
        self.wait_ready(timeout_s)

    def stop(self) -> None:
        """Kill the holder and the master (by pid); the ports and the directory stay."""
        _kill(self._holder)
        self._holder = None
        self.kill_master()

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalMooncakeStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, log: Path, args: list[str]) -> subprocess.Popen[bytes]:
        binary = mooncake_binary(name)
        if binary is None:
            raise ToolUnavailable(f"{name} is not installed", hint=INSTALL_HINT)
        # Not MC_LOG_DIR: the binaries initialise glog themselves, and the library would do
        # it a second time from that variable (a fatal check); they log to ``log`` instead.
        env = {k: v for k, v in os.environ.items() if k != "MC_LOG_DIR"}
        with log.open("ab") as out:
            return subprocess.Popen([binary, *args], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=self.workdir, env=env,
                                    preexec_fn=_die_with_owner)

    def _admin(self, path: str) -> str | None:
        """GET on the master's admin port; None when it does not answer."""
        try:
            with _DIRECT.open(f"http://127.0.0.1:{self.admin_port}{path}",
                              timeout=1.0) as resp:
                return str(resp.read().decode(errors="replace"))
        except OSError:
            return None


def _tail(log: Path) -> str:
    """The last lines of a binary's log, for the one-line error that names why it stopped."""
    return log.read_text(errors="replace")[-300:].strip()


def _accepts(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _die_with_owner() -> None:
    """In the child: SIGKILL when the process (thread) that started it dies (Linux), so a
    store outlives no owner that was killed before it could stop it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
