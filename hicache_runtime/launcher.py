"""The built-in spawner: ``tp * pp`` rank processes on one machine, watched to the end.

It starts every rank with an ``env://`` rendezvous (the same entry point ``torchrun`` uses),
then waits. When a rank fails (an exception, a hang seen by its watchdog or a protocol timeout,
or a process that simply died), the side channel (``<run>/DUMP``) makes every rank dump its
evidence; the launcher takes ``py-spy dump --json`` of every live rank at about the same time,
waits for the rank dumps, stops everyone, and writes the bundle manifest.

No orphans: each rank dies with the launcher (``PR_SET_PDEATHSIG``), and the launcher kills
every rank it started on every exit path.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_runtime.bundle import (
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
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.rank_main import read_dump, request_dump
from hicache_runtime.topology import RankInfo

ProgressFn = Callable[[int, int, int], None]
_POLL_S = 0.05
_PYSPY_TIMEOUT_S = 15.0
_KILL_GRACE_S = 3.0
_SELF_EXIT_S = 3.0
_STARTUP_ALLOWANCE_S = 60.0


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


def launch(cfg: RuntimeConfig, *, bundle_root: Path, caps: dict[str, int] | None = None,
           progress: ProgressFn | None = None) -> LaunchResult:
    """Run ``cfg`` as ``tp * pp`` processes; returns when every rank has exited. The caller
    must ``cleanup()`` the result."""
    run_dir = Path(tempfile.mkdtemp(prefix="hicache-run-"))
    (run_dir / "config.json").write_text(cfg.model_dump_json(), encoding="utf-8")
    if caps is not None:
        (run_dir / "caps.json").write_text(json.dumps(caps), encoding="utf-8")
    start = time.monotonic()
    procs = _start_ranks(cfg, run_dir)
    try:
        failed = _monitor(procs, run_dir, cfg, progress)
        bundle, info = None, {}
        if failed:
            bundle, info = _collect_bundle(procs, run_dir, cfg, bundle_root)
        else:
            _kill_all(procs)
        results = {r: _read(run_dir / f"rank{r}.result.json") or {} for r in procs}
        outcome = RunOutcome(info.get("outcome", "crash")) if failed else RunOutcome.HEALTHY
        return LaunchResult(outcome, info.get("reason"), bundle, results,
                            time.monotonic() - start, run_dir, cfg, _codes(procs))
    finally:
        _kill_all(procs)


# --- processes ---------------------------------------------------------------------------------


def _start_ranks(cfg: RuntimeConfig, run_dir: Path) -> dict[int, subprocess.Popen[bytes]]:
    port = free_port()
    world = cfg.topology.world_size
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HICACHE_LAUNCHER": "1", "TORCH_FR_BUFFER_SIZE": "2000",
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("HICACHE_SELF_PYSPY", None)
        log = (run_dir / f"rank{r}.log").open("wb")
        procs[r] = subprocess.Popen(
            [sys.executable, "-m", "hicache_runtime.rank_main", "--run-dir", str(run_dir)],
            env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
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
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
