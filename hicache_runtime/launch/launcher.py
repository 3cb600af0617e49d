"""The built-in spawner: ``tp * pp`` rank processes on one machine, watched to the end.

It starts every rank with an ``env://`` rendezvous (the same entry point ``torchrun`` uses),
then waits. When a rank fails (an exception, a hang seen by its watchdog or a protocol timeout,
or a process that simply died), the side channel (``<run>/DUMP``) makes every rank dump its
evidence; the launcher takes ``py-spy dump --json`` of every live rank at about the same time,
waits for the rank dumps, stops everyone, and writes the bundle manifest.

No orphans: each rank dies with the launcher (``PR_SET_PDEATHSIG``), and the launcher kills
every rank it started (its whole process group) on every exit path. Ranks run in sessions of
their own, so a Ctrl-C at the terminal reaches only the launcher, which stops them in order.
SIGINT, SIGTERM and SIGHUP during a launch raise :class:`Interrupted` in the launcher: the ranks
are stopped, a bundle already (partly) written is kept under the bundle root and reported on
stderr, and the run directory is removed.

The rendezvous store (a ``TCPStore``) lives in the launcher, on a port the kernel gave it and
that it holds until the ranks are gone: a port found free and handed on could be taken by
another job (gloo's own listeners included) before rank 0 bound it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.bundle import (
    FiredFaultRecord,
    Manifest,
    RankEntry,
    RankFiles,
    RunOutcome,
    new_bundle_dir,
    now_iso,
    versions,
    write_manifest,
)
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.launch.rank_process import read_dump, request_dump
from hicache_runtime.launch.threads import torch_threads

ProgressFn = Callable[[int, int, int], None]
_POLL_S = 0.05
_PYSPY_TIMEOUT_S = 15.0
_KILL_GRACE_S = 3.0
_SELF_EXIT_S = 3.0
_STARTUP_ALLOWANCE_S = 60.0
_STORE_TIMEOUT_S = 120.0
_INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class LaunchResult:
    """What a multi-rank run left behind. ``run_dir`` (the ranks' files) lives until
    :meth:`cleanup`, so a healthy-looking run can still be bundled if its outputs are wrong."""

    outcome: RunOutcome
    error: str | None
    bundle: Path | None
    results: dict[int, dict[str, Any]]
    wall_s: float
    run_dir: Path
    cfg: RuntimeConfig
    exit_codes: dict[int, int | None] = field(default_factory=dict)

    def bundle_as(self, outcome: RunOutcome, reason: str, bundle_root: Path,
                  mismatches: list[dict[str, Any]]) -> Path:
        """Bundle a finished run's rank dumps under another outcome (wrong output)."""
        return _write_bundle(self.run_dir, self.cfg, bundle_root, outcome, reason,
                             {r: _Exited(r, c) for r, c in self.exit_codes.items()}, {},
                             mismatches)

    def cleanup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass
class _Exited:
    """Stands in for a process that is gone (rank, exit code)."""

    rank: int
    returncode: int | None
    pid: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Interrupted(KeyboardInterrupt):
    """A signal asked the launcher to stop (Ctrl-C, SIGTERM, SIGHUP). A KeyboardInterrupt, so
    callers treat every one like Ctrl-C; ``bundle`` is the evidence kept, if any."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.bundle: Path | None = None


def launch(cfg: RuntimeConfig, *, bundle_root: Path, caps: dict[str, int] | None = None,
           progress: ProgressFn | None = None) -> LaunchResult:
    """Run ``cfg`` as ``tp * pp`` processes; returns when every rank has exited. The caller
    must ``cleanup()`` the result. Raising (an interrupt included), it leaves no rank and no
    run directory behind."""
    with _signals_interrupt() as quiet:
        run_dir = Path(tempfile.mkdtemp(prefix="hicache-run-"))
        procs: dict[int, subprocess.Popen[bytes]] = {}
        bundle: Path | None = None
        try:
            (run_dir / "config.json").write_text(cfg.model_dump_json(), encoding="utf-8")
            if caps is not None:
                (run_dir / "caps.json").write_text(json.dumps(caps), encoding="utf-8")
            start = time.monotonic()
            store = _rendezvous_store(cfg.topology.world_size)
            try:
                procs = _start_ranks(cfg, run_dir, store.port)
                failed = _monitor(procs, run_dir, cfg, progress)
                info: dict[str, Any] = {}
                if failed:
                    bundle, info = _collect_bundle(procs, run_dir, cfg, bundle_root)
                else:
                    _kill_all(procs)
            finally:
                _kill_all(procs)
                del store  # the ranks are gone: nobody talks to it any more
            results = {r: _read(run_dir / f"rank{r}.result.json") or {} for r in procs}
            outcome = RunOutcome(info.get("outcome", "crash")) if failed else RunOutcome.HEALTHY
            return LaunchResult(outcome, info.get("reason"), bundle, results,
                                time.monotonic() - start, run_dir, cfg, _codes(procs))
        except BaseException as exc:
            quiet()  # a second Ctrl-C must not cut the cleanup short
            _kill_all(procs)
            kept = bundle or _salvage_bundle(run_dir, cfg, bundle_root, procs, exc)
            shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(exc, Interrupted):
                exc.bundle = kept
            if kept is not None:
                sys.stderr.write(f"hicache: {exc or type(exc).__name__}; the run's bundle is "
                                 f"kept at {kept}\n")
            raise


def _rendezvous_store(world: int) -> dist.TCPStore:
    """The run's rendezvous store, on a port the kernel picked and this process holds."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=_STORE_TIMEOUT_S))


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[Callable[[], None]]:
    """While ranks run, turn SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` in this thread
    (only where the handler is still the default: an application's own handler is kept), so
    the cleanup runs. Yields ``quiet``: once called (cleanup began), or after the first
    signal, further signals are ignored until the block ends."""
    fired: list[int] = []

    def quiet() -> None:
        fired.append(0)

    if threading.current_thread() is not threading.main_thread():
        yield quiet
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    old: dict[int, Any] = {}
    for sig in _INTERRUPT_SIGNALS:
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            old[sig] = signal.signal(sig, handler)
    try:
        yield quiet
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def _salvage_bundle(run_dir: Path, cfg: RuntimeConfig, bundle_root: Path,
                    procs: dict[int, subprocess.Popen[bytes]],
                    exc: BaseException) -> Path | None:
    """A run stopped while ranks were dumping: keep what they wrote as a bundle (with a
    manifest saying it was interrupted) instead of deleting it with the run directory."""
    bundle = run_dir / "bundle"
    if not bundle.is_dir() or not any(bundle.glob("rank*/*")):
        return None
    info = read_dump(run_dir) or {}
    reason = f"{info.get('reason') or 'unknown failure'}; {exc or type(exc).__name__} " \
             "before the bundle was complete"
    try:
        return _write_bundle(run_dir, cfg, bundle_root, RunOutcome(info.get("outcome", "crash")),
                             reason, procs or {}, {}, [])
    except (OSError, ValueError):
        return None


# --- processes ---------------------------------------------------------------------------------


def _start_ranks(cfg: RuntimeConfig, run_dir: Path,
                 port: int) -> dict[int, subprocess.Popen[bytes]]:
    world = cfg.topology.world_size
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HICACHE_LAUNCHER": "1", "HICACHE_STORE": "launcher",
               "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": str(torch_threads()),
               "PYTHONUNBUFFERED": "1"}
        env.pop("HICACHE_SELF_PYSPY", None)
        log = (run_dir / f"rank{r}.log").open("wb")
        try:
            procs[r] = subprocess.Popen(
                [sys.executable, "-m", "hicache_runtime.launch.rank_process",
                 "--run-dir", str(run_dir)],
                env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                start_new_session=True)
        finally:
            log.close()
    return procs


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the launcher dies (Linux), so no rank outlives it."""
    with contextlib.suppress(OSError):  # not Linux: the launcher's kill-all still applies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _monitor(procs: dict[int, subprocess.Popen[bytes]], run_dir: Path, cfg: RuntimeConfig,
             progress: ProgressFn | None) -> bool:
    """Wait for the run to end; True when it failed (the DUMP side channel is then set)."""
    obs = cfg.observability
    stale_after = obs.watchdog_timeout_s + obs.protocol_timeout_s + 10.0
    last_change, last_progress = time.monotonic() + _STARTUP_ALLOWANCE_S, None
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            return False
        dead = {r: c for r, c in codes.items() if c not in (None, 0)}
        if read_dump(run_dir) is not None:
            return True
        if dead:
            r, c = min(dead.items())
            request_dump(run_dir, -1, RunOutcome.CRASH, f"rank {r} exited with code {c}"
                         f"{_signal_name(c)} before reporting")
            return True
        state = _read(run_dir / "progress.json")
        if state != last_progress:
            last_progress, last_change = state, max(last_change, time.monotonic())
            if progress is not None and state:
                progress(state["step"], state["finished"], state["total"])
        elif time.monotonic() - last_change > stale_after:
            request_dump(run_dir, -1, RunOutcome.HANG,
                         f"launcher: no progress from rank 0 for {stale_after:.0f}s")
            return True
        time.sleep(_POLL_S)


def _kill_all(procs: dict[int, subprocess.Popen[bytes]]) -> None:
    """Stop every rank and whatever it started (each rank leads its own process group)."""
    for p in procs.values():
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal a live rank's process group. Never after the rank was reaped: its pid (and so
    its group id) may then belong to someone else."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)  # the rank's pid is its group id (start_new_session)
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(sig)


def _wait_exit(procs: dict[int, subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _codes(procs: dict[int, subprocess.Popen[bytes]]) -> dict[int, int | None]:
    return {r: p.poll() for r, p in procs.items()}


# --- evidence ----------------------------------------------------------------------------------


def _collect_bundle(procs: dict[int, subprocess.Popen[bytes]], run_dir: Path,
                    cfg: RuntimeConfig, bundle_root: Path) -> tuple[Path, dict[str, Any]]:
    """py-spy every live rank, wait for the rank dumps, stop everyone, write the manifest."""
    bundle = run_dir / "bundle"
    live = {r: p.pid for r, p in procs.items() if p.poll() is None}
    pyspy = pyspy_all(live, bundle)
    (run_dir / "PYSPY_DONE").touch()
    deadline = time.monotonic() + cfg.observability.protocol_timeout_s + 5.0
    while time.monotonic() < deadline:
        if all((bundle / f"rank{r}" / "entry.json").exists() or procs[r].poll() is not None
               for r in procs):
            break
        time.sleep(_POLL_S)
    # Ranks unwind once their dump is done (the listener interrupts them); give them a moment
    # to exit on their own, so exit codes say how each ended. Ranks stuck inside a collective
    # do not return until its timeout; those are stopped (-15 after a complete dump).
    _wait_exit(procs, _SELF_EXIT_S)
    _kill_all(procs)
    info = read_dump(run_dir) or {"outcome": "crash", "reason": "unknown failure"}
    dest = _write_bundle(run_dir, cfg, bundle_root, RunOutcome(info.get("outcome", "crash")),
                         str(info.get("reason", "")), procs, pyspy, [])
    return dest, info


def write_manifest_in_place(run_dir: Path, cfg: RuntimeConfig, outcome: RunOutcome,
                            reason: str) -> Path:
    """Without a launcher (``torchrun``): turn ``<run>/bundle`` into a bundle where it lies,
    from whatever rank dumps are there (exit codes unknown)."""
    procs = {r: _Exited(r, None) for r in range(cfg.topology.world_size)}
    return _write_bundle(run_dir, cfg, None, outcome, reason, procs, {}, [])


def _write_bundle(run_dir: Path, cfg: RuntimeConfig, bundle_root: Path | None,
                  outcome: RunOutcome, reason: str, procs: dict[int, Any],
                  pyspy: dict[int, str | None], mismatches: list[dict[str, Any]]) -> Path:
    bundle = run_dir / "bundle"
    entries, missing = [], []
    for r, p in sorted(procs.items()):
        entry = _rank_entry(r, p, bundle, cfg, outcome, pyspy.get(r), run_dir)
        if entry.files.stacks is None and entry.files.pyspy is None:
            missing.append(r)
        entries.append(entry)
    dest = bundle
    if bundle_root is not None:
        dest = new_bundle_dir(bundle_root, outcome)
        if bundle.exists():
            shutil.copytree(bundle, dest, dirs_exist_ok=True)
    for stale in dest.glob("rank*/entry.json"):  # folded into the manifest
        stale.unlink()
    fired = [FiredFaultRecord(**f) for r in procs for f in _fired(run_dir, bundle, r)]
    write_manifest(dest, Manifest(
        created_at=now_iso(), outcome=outcome, reason=reason,
        topology={"tp": cfg.topology.tp, "pp": cfg.topology.pp,
                  "world_size": cfg.topology.world_size},
        seed=cfg.seed, config=cfg.model_dump(mode="json"),
        faults=[f.compact() for f in cfg.faults], faults_fired=fired,
        legacy=sorted(s.value for s in cfg.legacy), versions=versions(), ranks=entries,
        missing_ranks=missing, mismatches=mismatches))
    return dest


def _rank_entry(r: int, p: Any, bundle: Path, cfg: RuntimeConfig,
                outcome: RunOutcome, pyspy: str | None, run_dir: Path) -> RankEntry:
    d = bundle / f"rank{r}"
    d.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"rank{r}.log"
    if log.exists():
        shutil.copy(log, d / "log.txt")
    try:
        entry = RankEntry.model_validate_json((d / "entry.json").read_text())
        if entry.outcome is RunOutcome.HEALTHY:
            entry.outcome = outcome  # a clean rank of a run judged wrong afterwards
    except (OSError, ValueError):
        info = RankInfo.of(r, cfg.topology.tp, cfg.topology.pp)
        entry = RankEntry(rank=r, tp_rank=info.tp_rank, pp_rank=info.pp_rank,
                          pid=getattr(p, "pid", None),
                          outcome=RunOutcome.CRASH if p.returncode not in (None, 0)
                          else outcome,
                          error=f"no dump: exited with code {p.returncode}"
                          f"{_signal_name(p.returncode)}", files=RankFiles())
    entry.exit_code = p.returncode
    entry.files.pyspy = pyspy or entry.files.pyspy
    entry.files.log = f"rank{r}/log.txt" if (d / "log.txt").exists() else None
    return entry


def _fired(run_dir: Path, bundle: Path, rank: int) -> list[dict[str, Any]]:
    """Faults fired on a rank: from its result, else from its state dump."""
    result = _read(run_dir / f"rank{rank}.result.json") or {}
    if "faults_fired" in result:
        return list(result["faults_fired"])
    return list((_read(bundle / f"rank{rank}" / "state.json") or {}).get("faults_fired", []))


def pyspy_all(pids: dict[int, int], bundle: Path) -> dict[int, str | None]:
    """``py-spy dump --json`` of every pid, in parallel, each with a timeout. Failures leave a
    ``pyspy.err.txt`` explaining how to fix them (permissions, missing binary)."""
    out: dict[int, str | None] = {}
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))

    def one(rank: int, pid: int) -> None:
        d = bundle / f"rank{rank}"
        d.mkdir(parents=True, exist_ok=True)
        try:
            res = subprocess.run([exe, "dump", "--json", "--pid", str(pid)],
                                 capture_output=True, text=True, timeout=_PYSPY_TIMEOUT_S,
                                 check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            (d / "pyspy.err.txt").write_text(f"py-spy failed: {exc}\n{PYSPY_HINT}\n")
            out[rank] = None
            return
        if res.returncode != 0 or not res.stdout.strip():
            (d / "pyspy.err.txt").write_text(res.stderr + "\n" + PYSPY_HINT + "\n")
            out[rank] = None
            return
        (d / "pyspy.json").write_text(res.stdout)
        out[rank] = f"rank{rank}/pyspy.json"

    threads = [threading.Thread(target=one, args=(r, pid)) for r, pid in pids.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


PYSPY_HINT = ("py-spy needs ptrace: run as root, or give the container SYS_PTRACE "
              "(docker --cap-add SYS_PTRACE), or relax kernel.yama.ptrace_scope "
              "(sysctl -w kernel.yama.ptrace_scope=0); install it with `pip install py-spy`.")


def _signal_name(code: int | None) -> str:
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
