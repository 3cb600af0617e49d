"""Rank processes forked from a warm parent instead of started cold.

A rank started cold spends about two seconds of CPU importing torch and the runtime before it
does anything; a campaign starts hundreds of ranks (every cell, its reference run, its
warm-up), so on a small machine start-up was most of its time. The launcher therefore keeps
one *zygote* per launcher process: a child that imports torch and the rank program once, then
forks a rank for each request. A forked rank is a real, separate process (its own pid, session,
log, environment and gloo sockets); only the imported code is shared, copy-on-write.

Protocol (a ``SOCK_SEQPACKET`` Unix socket pair, one JSON message per packet):

* launcher -> zygote: ``{"seq", "argv", "env", "new_session", "fds"}`` with the rank's log file
  and any descriptors it must inherit passed alongside (``SCM_RIGHTS``); ``fds`` names the
  numbers they must have in the rank;
* zygote -> launcher: ``{"seq", "pid"}`` (or ``{"seq", "error"}``) for each request, and
  ``{"exit": pid, "code": c}`` when a rank ends (``c`` as :attr:`subprocess.Popen.returncode`
  has it: negative for a signal).

Lifetimes: the zygote exits when the launcher's end of the socket closes (the launcher exited
or died); every rank asks for ``SIGKILL`` when the zygote dies (``PR_SET_PDEATHSIG``), so no
rank outlives its launcher. The zygote is never started with a death signal of its own: that
signal fires when the *thread* that started it ends, and launches run on many threads.

Where it is not used: machines with a CUDA device (a process that forked after the CUDA driver
was initialised cannot use it, so GPU ranks start cold as before) and platforms without
``fork`` and descriptor passing. One difference from a cold start remains: ranks forked from
one zygote share its string-hash seed, so sets of strings iterate alike on every rank (the
runtime's agreed decisions never depend on set order; the consensus check would name one that
did).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import functools
import gc
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache_runtime.contracts.run_files import HELPER_PROCESS_ENV

_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16
_PR_SET_PDEATHSIG = 1
_PAD_VAR = "HICACHE_ZYGOTE_ROOM"
_MIN_PAD = 4096


class ForkedRank:
    """A rank forked by the zygote, with the part of :class:`subprocess.Popen`'s interface
    the launcher uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``terminate``). Its exit status comes from the zygote, which reaps it."""

    def __init__(self, zygote: Zygote, pid: int, argv: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(argv)
        self.returncode: int | None = None
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # Never after the exit was reported: the pid may belong to someone else by then.
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteError(RuntimeError):
    """The zygote could not fork a rank (or is gone)."""


class Zygote:
    """The launcher's side: starts the zygote, sends fork requests, collects exit codes (a
    reader thread keeps them). Thread-safe."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Room for each rank to show its own command line and environment (see _retitle).
        env_bytes = sum(len(k) + len(v) + 2 for k, v in os.environ.items())
        # spaces, not a visible filler: ``ps`` shows the zygote's whole command line
        env = {**os.environ, "PYTHONUNBUFFERED": "1", HELPER_PROCESS_ENV: "zygote",
               _PAD_VAR: " " * max(_MIN_PAD, 2 * env_bytes)}
        try:
            self.proc = subprocess.Popen(
                # -P: nothing from the working directory shadows what the ranks import
                [sys.executable, "-P", "-m", "hicache_runtime.launch.zygote",
                 str(theirs.fileno()),
                 " " * _MIN_PAD],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                # out of the terminal's process group: a Ctrl-C reaches the launcher, which
                # stops the ranks in order, not the zygote (whose death would kill them)
                start_new_session=True)
        finally:
            theirs.close()
        self._sock = ours
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._seq = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="hicache-zygote-reader",
                                        daemon=True)
        self._reader.start()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, *,
              new_session: bool = True, pass_fds: Sequence[int] = ()) -> ForkedRank:
        """Fork a rank running ``argv`` (``python -m MODULE ARGS...``: the module's ``main``
        with ``ARGS``) with exactly ``env``, stdout and stderr to ``log_path``, and the
        descriptors ``pass_fds`` under the same numbers."""
        with open(log_path, "wb") as log:
            fds = [log.fileno(), *pass_fds]
            with self._cond:
                if self.closed:
                    raise ZygoteError("the zygote has exited")
                self._seq += 1
                seq = self._seq
            msg = json.dumps({"seq": seq, "argv": list(argv), "env": dict(env),
                              "new_session": new_session, "fds": list(pass_fds)}).encode()
            try:
                with self._send_lock:
                    socket.send_fds(self._sock, [msg], fds)
            except OSError as exc:
                raise ZygoteError(f"cannot reach the zygote: {exc}") from exc
        with self._cond:
            if not self._cond.wait_for(lambda: seq in self._replies or self.closed, 60.0):
                raise ZygoteError("the zygote did not answer a fork request within 60s")
            reply = self._replies.pop(seq, None)
            if reply is None:
                raise ZygoteError("the zygote exited before it answered")
            if "error" in reply:
                raise ZygoteError(f"the zygote could not fork: {reply['error']}")
            pid = int(reply["pid"])
        return ForkedRank(self, pid, argv)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Close the socket: the zygote exits (ranks still running die with it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5.0)
        self._sock.close()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._cond:
                if "exit" in msg:
                    pid = int(msg["exit"])
                    self._exits[pid] = int(msg["code"])
                    self._live.discard(pid)
                else:
                    if "pid" in msg:
                        # The kernel reuses pids (pid_max is often 32768, and a test session
                        # forks tens of thousands of ranks): an exit kept for an earlier
                        # process of this pid would make the new one read as exited with
                        # its code, so a live rank was taken for a finished one, never
                        # signalled, and its result missed. Dropped here, in the order the
                        # zygote sent the messages, before the new process's own exit.
                        new = int(msg["pid"])
                        self._exits.pop(new, None)
                        self._live.add(new)
                    self._replies[int(msg["seq"])] = msg
                self._cond.notify_all()
        # The zygote is gone, and with it (death signal) every rank it forked.
        with self._cond:
            self.closed = True
            for pid in self._live:
                self._exits.setdefault(pid, -signal.SIGKILL)
            self._live.clear()
            self._cond.notify_all()


def die_with_parent() -> None:
    """In a child: get SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``), so no rank
    outlives whoever started it (elsewhere the launcher's kill-all still applies)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


@functools.cache
def usable() -> bool:
    """Whether ranks may be forked here: Linux with descriptor passing, no CUDA device."""
    if sys.platform != "linux" or not hasattr(socket, "send_fds"):
        return False
    import torch

    return not torch.cuda.is_available()


def shared() -> Zygote:
    """This process's zygote, started on first use and again if it has exited."""
    global _zygote
    with _zygote_lock:
        if _zygote is None or _zygote.closed or _zygote.proc.poll() is not None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


def close_shared() -> None:
    """Close this process's zygote, if it runs, and wait for it: every rank it forked dies
    with it, those whose pid the launcher had not yet received included (a signal in the
    middle of starting ranks). The next launch starts a new one."""
    global _zygote
    with _zygote_lock:
        z, _zygote = _zygote, None
    if z is not None and not z.closed:
        z.close()


# --- the zygote process --------------------------------------------------------------------


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    me = os.getpid()

    def send(msg: dict[str, Any]) -> None:
        try:
            sock.send(json.dumps(msg).encode())
        except OSError:  # the launcher went away (a signal early in a run): so do we, quietly
            os._exit(0)

    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
                except OSError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)  # the launcher is gone; ranks die with us
                req = json.loads(data)
                try:
                    pid = os.fork()
                except OSError as exc:
                    send({"seq": req["seq"], "error": str(exc)})
                else:
                    if pid == 0:
                        sel.close()
                        sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        _become_rank(req, fds, me)  # never returns
                    send({"seq": req["seq"], "pid": pid})
                for fd in fds:
                    os.close(fd)
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_rank(req: dict[str, Any], fds: list[int], zygote_pid: int) -> None:
    """In the forked child: take the rank's environment, session, log and descriptors, run
    the module's ``main`` and exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent()
        if os.getppid() != zygote_pid:  # the zygote died before the death signal was set
            os._exit(1)
        if req["new_session"]:
            os.setsid()
        # Move the received descriptors out of the way, then onto the numbers they must have.
        high = max([2, *req["fds"]]) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]
        for fd in fds:
            os.close(fd)
        os.dup2(moved[0], 1)
        os.dup2(moved[0], 2)
        for src, dst in zip(moved[1:], req["fds"]):
            os.dup2(src, int(dst), inheritable=True)
        for fd in moved:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"]
        _retitle(argv, req["env"])
        run = argv[2:] if argv[1:2] == ["-P"] else argv[1:]  # the zygote itself runs with -P
        if argv[:1] != [sys.executable] or run[:1] != ["-m"] or len(run) < 2:
            raise ValueError(f"a rank is 'python [-P] -m MODULE ...', not {argv!r}")
        sys.argv = [run[1], *run[2:]]
        module = __import__(run[1], fromlist=["main"])
        code = module.main(run[2:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


def _retitle(argv: Sequence[str], env: Mapping[str, str] | None) -> None:
    """Make ``/proc/self/cmdline`` and ``/proc/self/environ`` show the rank's own command line
    and environment, as a cold-started rank's do (``ps``, ``pgrep -f``, a supervisor that
    reads a process's environment, and py-spy users find ranks by them). They are read from
    the memory the kernel laid out at the zygote's exec (the zygote starts with room to spare
    in both); the rank's values are written there in place, cut short if they do not fit.
    Safe once ``os.environ`` has been rebuilt: the C environment then points at copies, not
    into that memory. ``env`` None leaves the environment alone (the zygote's own, which
    the C environment still points into)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        # fields 48-51 of stat (counted from 1, the first two are before the ")")
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[45:49])
    except (OSError, ValueError, IndexError):
        return
    areas = [(arg_start, arg_end, list(argv))]
    if env is not None:
        areas.append((env_start, env_end, [f"{k}={v}" for k, v in env.items()]))
    for start, end, items in areas:
        size = end - start
        if size <= 0:
            continue
        data = b"".join(x.encode(errors="replace") + b"\0" for x in items)[: size - 1]
        ctypes.memmove(start, data.ljust(size, b"\0"), size)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if argv is None:  # its own command line without the room it keeps for the ranks' (ps)
        _retitle([sys.executable, "-P", "-m", __spec__.name if __spec__ else __name__,
                  args[0]], None)
    sock = socket.socket(fileno=int(args[0]))
    # Everything a rank imports, imported once here; nothing that starts a thread or touches
    # a device (a fork copies only the calling thread).
    import hicache_runtime.launch.rank_process  # noqa: F401

    # What they built moves to the collector's permanent generation: a rank's collections
    # (its full one before it frees its process groups included) never walk those objects,
    # so never write to the pages it shares with this process copy-on-write. Without it, the
    # pp2 cells of the default campaign took about a fifth more CPU and minor page faults
    # (bench/process_cpu.py, measured before and after in one session).
    gc.freeze()
    _serve(sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
