"""A healthy rank leaves cleanly: every process group is freed and gloo's worker threads are
joined before the interpreter shuts down, so no rank aborts at exit (``terminate called
without an active exception``, exit -6) after it wrote a healthy result."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_runtime.bundle import RunOutcome
from hicache_runtime.launcher import LaunchResult, launch
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


def _exit_records(res: LaunchResult) -> dict[int, dict[str, object]]:
    return {r: json.loads((res.run_dir / f"rank{r}.exit.json").read_text())
            for r in res.exit_codes}


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
            failures += [f"run {i}: rank {r} left {rec['gloo_workers']} gloo workers"
                         for r, rec in records.items() if rec["gloo_workers"]]
        finally:
            res.cleanup()
    assert not failures, failures
    assert not list(bundle_root.iterdir()), "a healthy run writes no bundle"
