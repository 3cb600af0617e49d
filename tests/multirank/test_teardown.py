"""A healthy rank leaves cleanly: every process group is freed and gloo's worker threads are
joined before the interpreter shuts down, so no rank aborts at exit (``terminate called
without an active exception``, exit -6) after it wrote a healthy result."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch.launcher import LaunchResult, launch
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPEATS = 6
_ABORT_MARKERS = ("terminate called", "Fatal Python error")


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """A busy process beside the ranks: the abort was a race that load made likely."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def _exit_records(res: LaunchResult) -> dict[int, dict[str, object] | None]:
    """Each rank's exit record; None for a rank that never got to its teardown (the run's
    outcome then says why: a test reports it rather than stopping at the missing file)."""
    paths = {r: res.run_dir / f"rank{r}.exit.json" for r in res.exit_codes}
    return {r: json.loads(p.read_text()) if p.exists() else None for r, p in paths.items()}


def _aborts(res: LaunchResult) -> list[str]:
    out = []
    for r in res.exit_codes:
        log = (res.run_dir / f"rank{r}.log").read_text(errors="replace")
        out += [f"rank {r}: {m}" for m in _ABORT_MARKERS if m in log]
    return out


def test_a_healthy_rank_joins_every_thread_before_exit(bundle_root: Path,
                                                       tmp_path: Path) -> None:
    """Every thread that can hold a collective's tensors is gone when the interpreter starts
    shutting down: the consensus thread, the L3 workers, and gloo's own workers."""
    cfg = mr_config(**{"topology.pp": 2, "workload.requests": 12,
                       "observability.consensus_check": True, "storage.backend": "file",
                       "storage.path": tmp_path / "l3"})
    res = launch(cfg, bundle_root=bundle_root)
    try:
        assert res.outcome is RunOutcome.HEALTHY, res.error
        assert res.exit_codes == {0: 0, 1: 0}
        for rank, rec in _exit_records(res).items():
            assert rec is not None, f"rank {rank} wrote no exit record"
            assert rec["gloo_workers"] == 0, f"rank {rank}: {rec}"
            assert rec["python_threads"] == [], f"rank {rank}: {rec}"
            assert "pt_gloo_runloop" not in rec["native_threads"], f"rank {rank}: {rec}"
        assert not _aborts(res)
    finally:
        res.cleanup()


def test_repeated_reference_runs_never_abort_at_exit(bundle_root: Path, cpu_hog: None) -> None:
    """The cache-disabled reference run, as the campaign runs it, over and over on a loaded
    machine: every rank exits 0 and no log shows a native abort."""
    cfg = mr_config(**{"topology.pp": 2, "workload.requests": 8}).reference()
    failures = []
    for i in range(REPEATS):
        res = launch(cfg, bundle_root=bundle_root)
        try:
            if res.outcome is not RunOutcome.HEALTHY or any(res.exit_codes.values()):
                failures.append(f"run {i}: {res.outcome.value} {res.error} {res.exit_codes}")
            failures += [f"run {i}: {a}" for a in _aborts(res)]
            records = _exit_records(res)
            failures += [f"run {i}: rank {r} wrote no exit record"
                         for r, rec in records.items() if rec is None]
            failures += [f"run {i}: rank {r} left {rec['gloo_workers']} gloo workers"
                         for r, rec in records.items() if rec is not None and rec["gloo_workers"]]
        finally:
            res.cleanup()
    assert not failures, failures
    assert not list(bundle_root.iterdir()), "a healthy run writes no bundle"


def _late_stopper(rank: int, store_path: str, delay_s: float, out: str) -> None:
    """One rank of a real 2-rank gloo job: stop the side threads ``delay_s`` late (rank 1),
    as a rank still writing its evidence on a loaded machine does."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from hicache_runtime.contracts.topology import RankInfo
    from hicache_runtime.dist.consensus_check import ConsensusChecker
    from hicache_runtime.dist.flight_recorder import FlightRecorder, Group
    from hicache_runtime.launch.rank_process import _SideThreads
    from hicache_runtime.launch.watchdog import StepWatchdog
    from hicache_runtime.telemetry.tracer import Tracer

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=30), backend="gloo")
    tracer = Tracer(RankInfo.of(rank, 2, 1))
    group = Group("consensus", pg, [0, 1], rank, FlightRecorder(), tracer)
    consensus = ConsensusChecker(group, tracer).start()
    dumper = SimpleNamespace(stop=threading.Event())
    listener = threading.Thread(target=dumper.stop.wait, daemon=True)
    listener.start()
    side = _SideThreads(dumper, listener, StepWatchdog(60.0, lambda _s: None).start(),  # type: ignore[arg-type]
                        consensus, consensus_join_s=30.0 + 5.0)
    time.sleep(delay_s if rank == 1 else 0.0)
    t0 = time.monotonic()
    side.stop(agreed=True)
    Path(out).write_text(json.dumps({"running": consensus.running,
                                     "waited_s": time.monotonic() - t0}))
    if not consensus.running:
        dist.destroy_process_group()


def test_the_consensus_thread_outlasts_a_peer_that_stops_late(tmp_path: Path) -> None:
    """A rank that stops first waits for its consensus thread's last round, however long the
    peer takes to get there (up to the protocol timeout): destroying the group under a thread
    still inside a collective crashed the rank (a segfault at exit on a loaded machine)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_late_stopper,
                         args=(r, str(tmp_path / "store"), 7.0, str(outs[r])))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    early = json.loads(outs[0].read_text())
    assert early["running"] is False, early
    assert early["waited_s"] > 5.0, early  # it did wait for the late peer's round
