"""The built-in spawner: ``tp * pp`` rank processes on one machine, watched to the end.

This is one DP group's world. A run of several DP groups is started by the DP controller
(:mod:`hicache_runtime.launch.dp_controller`), which starts one such world per group with
:func:`start_ranks` and watches them all.

It starts every rank with an ``env://`` rendezvous (the same entry point ``torchrun`` uses),
then waits. When a rank fails (an exception, a hang seen by its watchdog or a protocol timeout,
or a process that simply died), the side channel (``<run>/DUMP``) makes every rank dump its
evidence; the launcher takes ``py-spy dump --json`` of every live rank at about the same time,
waits for the rank dumps, stops everyone, and writes the bundle manifest
(:mod:`hicache_runtime.launch.bundles`). Each rank's result is read back bounded and validated
(:class:`~hicache_runtime.contracts.rank_result.RankResult`): a run whose ranks all exited
cleanly but whose result cannot be read is a crash that says which file and why.

Ranks are forked from the launcher process's zygote (:mod:`hicache_runtime.launch.zygote`),
which imported torch and the rank program once; on a machine with a CUDA device they start
cold (``python -m hicache_runtime.launch.rank_process``).

No orphans: each rank dies with the launcher (``PR_SET_PDEATHSIG``; a forked rank with the
zygote, which exits when the launcher does), and the launcher kills
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
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts import pyspy
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.errors import ConfigError, DumpFormatError
from hicache_runtime.contracts.outcome import classify_exit, describe_exit
from hicache_runtime.contracts.rank_result import RankResult, read_rank_result
from hicache_runtime.contracts.run_files import RANK_DIRS, RunDir, rank_dir_name
from hicache_runtime.launch import zygote
from hicache_runtime.launch.bundles import RankExit, kept_bundle, write_run_bundle
from hicache_runtime.launch.ending import Interrupted, abandon_run, judge_end
from hicache_runtime.launch.side_channel import (
    DumpRequest,
    ProgressFn,
    blame_dump,
    lost_a_peer,
    read_dump,
    read_progress,
    request_dump,
)
from hicache_runtime.launch.threads import torch_threads

RankProcess = subprocess.Popen[bytes] | zygote.ForkedRank
"""A rank started cold or forked from the zygote (the same interface)."""

_POLL_S = 0.05
_KILL_GRACE_S = 3.0
_BLAME_WAIT_S = 1.0
SELF_EXIT_S = 3.0
STARTUP_ALLOWANCE_S = 60.0
_STORE_TIMEOUT_S = 120.0
_INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class LaunchResult:
    """What a multi-rank run left behind. ``run_dir`` (the ranks' files) lives until
    :meth:`cleanup`, so a healthy-looking run can still be bundled if its outputs are wrong.
    ``results``: each rank's result, validated (a rank that wrote none is absent);
    ``unreadable``: the ranks whose result file exists but is not a result, and why."""

    outcome: RunOutcome
    error: str | None
    bundle: Path | None
    results: dict[int, RankResult]
    wall_s: float
    run_dir: Path
    cfg: RuntimeConfig
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    unreadable: dict[int, str] = field(default_factory=dict)
    bundle_error: str | None = None
    """Why the bundle could not be written (a full disk): the run's failure stands."""

    def bundle_as(self, outcome: RunOutcome, reason: str, bundle_root: Path,
                  mismatches: list[dict[str, Any]]) -> Path:
        """Bundle a finished run's rank dumps under another outcome (wrong output)."""
        return write_run_bundle(self.run_dir, self.cfg, bundle_root, outcome, reason,
                                {r: RankExit(r, c) for r, c in self.exit_codes.items()}, {},
                                mismatches)

    def cleanup(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


def launch(cfg: RuntimeConfig, *, bundle_root: Path, caps: dict[str, int] | None = None,
           progress: ProgressFn | None = None) -> LaunchResult:
    """Run ``cfg`` as ``tp * pp`` processes; returns when every rank has exited. The caller
    must ``cleanup()`` the result. Raising (an interrupt included), it leaves no rank and no
    run directory behind. One DP group: several are the DP controller's
    (:func:`~hicache_runtime.launch.dp_controller.launch_dp`)."""
    if cfg.topology.dp > 1:
        raise ConfigError("topology.dp", f"{cfg.topology.dp} DP groups are started by the DP "
                          "controller (launch_dp), not by the launcher of one group")
    with signals_interrupt() as quiet:
        run_dir = Path(tempfile.mkdtemp(prefix="hicache-run-"))
        run = RunDir(run_dir)
        procs: dict[int, RankProcess] = {}
        bundle: Path | None = None
        try:
            run.config.write_text(cfg.model_dump_json(), encoding="utf-8")
            if caps is not None:
                run.caps.write_text(json.dumps(caps), encoding="utf-8")
            start = time.monotonic()
            store = rendezvous_store(cfg.topology.world_size)
            try:
                start_ranks(cfg, run_dir, store.port, into=procs)
                failed = _monitor(procs, run_dir, cfg, progress)
                request: DumpRequest | None = None
                bundle_error: str | None = None
                if failed:
                    bundle, request, bundle_error = _collect_bundle(procs, run_dir, cfg,
                                                                    bundle_root)
                else:
                    kill_all(procs)
            finally:
                kill_all(procs)
                del store  # the ranks are gone: nobody talks to it any more
            results, unreadable = read_results(run_dir, procs)
            end = judge_end(request, unreadable, bundle, bundle_error,
                            lambda outcome, reason: write_run_bundle(
                                run_dir, cfg, bundle_root, outcome, reason, exits_of(procs),
                                {}, []))
            return LaunchResult(end.outcome, end.error, end.bundle, results,
                                time.monotonic() - start, run_dir, cfg, codes_of(procs),
                                unreadable, end.bundle_error)
        except BaseException as exc:
            quiet()  # a second Ctrl-C must not cut the cleanup short
            kill_all(procs)
            abandon_run(exc, run_dir,
                        bundle or _salvage_bundle(run_dir, cfg, bundle_root, procs, exc))
            raise


def rendezvous_store(world: int) -> dist.TCPStore:
    """The run's rendezvous store, on a port the kernel picked and this process holds."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=_STORE_TIMEOUT_S))


@contextlib.contextmanager
def signals_interrupt() -> Iterator[Callable[[], None]]:
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
        for signum, previous in old.items():
            signal.signal(signum, previous)


def _salvage_bundle(run_dir: Path, cfg: RuntimeConfig, bundle_root: Path,
                    procs: dict[int, RankProcess],
                    exc: BaseException) -> Path | None:
    """A run stopped while ranks were dumping: keep what they wrote as a bundle (with a
    manifest saying it was interrupted) instead of deleting it with the run directory."""
    bundle = RunDir(run_dir).bundle
    if not bundle.is_dir() or not any(bundle.glob(f"{RANK_DIRS}/*")):
        return None
    request = read_dump(run_dir)
    reason = f"{(request.reason if request else '') or 'unknown failure'}; " \
             f"{exc or type(exc).__name__} before the bundle was complete"
    try:
        return write_run_bundle(run_dir, cfg, bundle_root,
                                request.outcome if request else RunOutcome.CRASH, reason,
                                exits_of(procs), {}, [])
    except (OSError, ValueError):
        return None


# --- processes ---------------------------------------------------------------------------------


def start_ranks(cfg: RuntimeConfig, run_dir: Path, port: int, *, first_device: int = 0,
                env: Mapping[str, str] | None = None, entry_env: Mapping[str, str] | None = None,
                entry_fds: tuple[int, ...] = (),
                into: dict[int, RankProcess] | None = None) -> dict[int, RankProcess]:
    """Start one world of ``tp * pp`` ranks on the rendezvous at ``port``. A DP controller
    starts one world per DP group: ``first_device`` is the group's first rank in the grid
    (devices are picked by it), ``env`` goes to every rank, ``entry_env`` and the open file
    descriptors ``entry_fds`` to the group's entry rank (rank 0) only. Each rank is added to
    ``into`` as it starts, so a signal in the middle leaves the started ones known (and
    stopped), not orphaned."""
    world = cfg.topology.world_size
    run = RunDir(run_dir)
    procs: dict[int, RankProcess] = into if into is not None else {}
    # Forked from a warm zygote where that is safe (no CUDA device): a cold start imports
    # torch and the runtime, about two seconds of CPU per rank.
    forking = zygote.usable()
    for r in range(world):
        rank_env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(first_device + r),
                    "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "HICACHE_LAUNCHER": "1",
                    "HICACHE_STORE": "launcher", "TORCH_FR_BUFFER_SIZE": "2000",
                    "OMP_NUM_THREADS": str(torch_threads()), "PYTHONUNBUFFERED": "1",
                    **(env or {}), **((entry_env or {}) if r == 0 else {})}
        rank_env.pop("HICACHE_SELF_PYSPY", None)
        # -P: the working directory is not on the path, so a stray timeit.py or random.py
        # where the user runs hicache is never imported in place of the standard library's
        argv = [sys.executable, "-P", "-m", "hicache_runtime.launch.rank_process",
                "--run-dir", str(run_dir)]
        fds = entry_fds if r == 0 else ()
        if forking:
            procs[r] = zygote.shared().spawn(argv, rank_env, run.log(r), pass_fds=fds)
            continue
        log = run.log(r).open("wb")
        try:
            procs[r] = subprocess.Popen(
                argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=zygote.die_with_parent, start_new_session=True, pass_fds=fds)
        finally:
            log.close()
    return procs


def _monitor(procs: dict[int, RankProcess], run_dir: Path, cfg: RuntimeConfig,
             progress: ProgressFn | None) -> bool:
    """Wait for the run to end; True when it failed (the DUMP side channel is then set)."""
    obs = cfg.observability
    stale_after = obs.watchdog_timeout_s + obs.protocol_timeout_s + 10.0
    last_change, last_progress = time.monotonic() + STARTUP_ALLOWANCE_S, None
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            return False
        dead = {r: c for r, c in codes.items() if c not in (None, 0)}
        request = read_dump(run_dir)
        if request is not None:
            if request.by >= 0 and lost_a_peer(request.reason):
                _blame_a_dead_rank(procs, run_dir, request.by)
            return True
        if dead:
            r, c = min(dead.items())
            request_dump(run_dir, -1, classify_exit(c, RunOutcome.CRASH),
                         f"rank {r} exited with code {c}{describe_exit(c)} before reporting")
            return True
        state = read_progress(run_dir)
        if state != last_progress:
            last_progress, last_change = state, max(last_change, time.monotonic())
            if progress is not None and state:
                progress(*state)
        elif time.monotonic() - last_change > stale_after:
            request_dump(run_dir, -1, RunOutcome.HANG,
                         f"launcher: no progress from rank 0 for {stale_after:.0f}s")
            return True
        time.sleep(_POLL_S)


def _blame_a_dead_rank(procs: dict[int, RankProcess], run_dir: Path, reporter: int) -> None:
    """A rank reported only a lost peer: if another rank died by a signal (killed, or aborted
    inside a library) without reporting, that death is the failure, not the lost connection.
    The reporter and the launcher race to see it, so the launcher looks for such a death for a
    moment before it takes the report as it is."""
    deadline = time.monotonic() + _BLAME_WAIT_S
    while True:
        dead = {r: c for r, p in procs.items() if r != reporter
                and (c := p.poll()) is not None and c < 0}
        if dead:
            r, c = min(dead.items())
            blame_dump(run_dir, classify_exit(c, RunOutcome.CRASH),
                       f"rank {r} exited with code {c}{describe_exit(c)} before reporting")
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def kill_all(procs: dict[int, RankProcess]) -> None:
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


def _signal_group(p: RankProcess, sig: signal.Signals) -> None:
    """Signal a live rank's process group. Never after the rank was reaped: its pid (and so
    its group id) may then belong to someone else."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)  # the rank's pid is its group id (start_new_session)
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(sig)


def wait_exit(procs: dict[int, RankProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs.values():
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def codes_of(procs: dict[int, RankProcess]) -> dict[int, int | None]:
    return {r: p.poll() for r, p in procs.items()}


def exits_of(procs: dict[int, RankProcess]) -> dict[int, RankExit]:
    """How each rank ended, for its bundle entry (``returncode`` is None while it runs)."""
    return {r: RankExit(r, p.returncode, p.pid) for r, p in procs.items()}


def read_results(run_dir: Path, ranks: Iterable[int]
                 ) -> tuple[dict[int, RankResult], dict[int, str]]:
    """The ranks' results (validated; a rank that wrote none is left out), and why each
    unreadable one is not a result."""
    run = RunDir(run_dir)
    results: dict[int, RankResult] = {}
    unreadable: dict[int, str] = {}
    for r in ranks:
        try:
            result = read_rank_result(run.result(r))
        except DumpFormatError as exc:
            unreadable[r] = str(exc)
            continue
        if result is not None:
            results[r] = result
    return results, unreadable


# --- evidence ----------------------------------------------------------------------------------


def _collect_bundle(procs: dict[int, RankProcess], run_dir: Path, cfg: RuntimeConfig,
                    bundle_root: Path) -> tuple[Path | None, DumpRequest, str | None]:
    """py-spy every live rank, wait for the rank dumps, stop everyone, write the manifest.
    The bundle is None (and why) when it could not be written."""
    run = RunDir(run_dir)
    live = {r: p.pid for r, p in procs.items() if p.poll() is None}
    dumps = pyspy_all(live, run.bundle)
    run.pyspy_done.touch()
    deadline = time.monotonic() + cfg.observability.protocol_timeout_s + 5.0
    while time.monotonic() < deadline:
        if all(run.entry(r).exists() or procs[r].poll() is not None for r in procs):
            break
        time.sleep(_POLL_S)
    # Ranks unwind once their dump is done (the listener interrupts them); give them a moment
    # to exit on their own, so exit codes say how each ended. Ranks stuck inside a collective
    # do not return until its timeout; those are stopped (-15 after a complete dump).
    wait_exit(procs, SELF_EXIT_S)
    kill_all(procs)
    request = read_dump(run_dir) or DumpRequest(by=-1, outcome=RunOutcome.CRASH,
                                                reason="unknown failure", t=time.time())
    dest, problem = kept_bundle(lambda: write_run_bundle(
        run_dir, cfg, bundle_root, request.outcome, request.reason, exits_of(procs), dumps, []))
    return dest, request, problem


def pyspy_all(pids: dict[int, int], bundle: Path) -> dict[int, str | None]:
    """``py-spy dump --json`` of every pid, in parallel, each with a timeout. Failures leave a
    ``pyspy.err.txt`` explaining how to fix them (permissions, missing binary)."""
    out: dict[int, str | None] = {}

    def one(rank: int, pid: int) -> None:
        out[rank] = pyspy.write_into(bundle / rank_dir_name(rank), pyspy.dump(pid))

    threads = [threading.Thread(target=one, args=(r, pid)) for r, pid in pids.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
