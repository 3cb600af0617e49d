"""A rank that raises, hangs or dies leaves a bundle with every rank's evidence, in bounded
time, and no rank process outlives the run."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome, load_manifest
from hicache_runtime.launch.run import run
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


_MARK = f"HICACHE_TEST_RUN={uuid.uuid4().hex}".encode()


@pytest.fixture(autouse=True)
def _mark_our_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank processes inherit the environment: the mark tells this module's ranks from those
    of other runs on the same machine (another suite, a campaign)."""
    name, _, value = _MARK.decode().partition("=")
    monkeypatch.setenv(name, value)


def _rank_processes() -> list[int]:
    """This module's rank processes still alive (orphans included: they keep the mark)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hicache_runtime.launch.rank_process" not in cmd:
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if _MARK in env:
            pids.append(int(entry))
    return pids


def test_a_raising_rank_leaves_a_bundle_from_every_rank(bundle_root: Path) -> None:
    cfg = mr_config(**{"topology.tp": 2, "topology.pp": 2,
                       "faults": (parse_fault("crash:rank=3,point=model.forward,step=12"),)})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH
    assert s.bundle is not None
    m = load_manifest(Path(s.bundle))
    assert len(m.ranks) == 4
    assert m.missing_ranks == []
    for entry in m.ranks:
        for name in ("stacks", "events", "flight_recorder", "state"):
            assert getattr(entry.files, name), f"rank {entry.rank} lacks {name}"
            assert (Path(s.bundle) / getattr(entry.files, name)).exists()
    culprit = next(e for e in m.ranks if e.rank == 3)
    tb = (Path(s.bundle) / (culprit.files.traceback or "")).read_text()
    assert "InjectedFault: injected crash at model.forward" in tb
    assert any(e.files.pyspy for e in m.ranks), "the launcher took py-spy dumps"
    assert m.faults_fired, "the manifest lists the fault that fired"
    assert m.faults_fired[0].rank == 3
    assert not _rank_processes()


def test_a_hung_rank_is_caught_within_the_protocol_timeout(bundle_root: Path) -> None:
    timeout = 4.0
    cfg = mr_config(**{"topology.tp": 2,
                       "faults": (parse_fault("hang:rank=1,point=scheduler.step,step=8"),),
                       "observability.protocol_timeout_s": timeout,
                       "observability.watchdog_timeout_s": 60.0})
    t0 = time.monotonic()
    s = run(cfg, bundle_root=bundle_root)
    elapsed = time.monotonic() - t0
    assert s.outcome is RunOutcome.HANG, s.error
    assert s.bundle is not None
    assert "Timed out waiting 4000ms" in (s.error or "")
    m = load_manifest(Path(s.bundle))
    assert {e.rank for e in m.ranks if e.files.stacks} == {0, 1}
    # startup of two torch processes + a few steps + the timeout + 5 s for the bundle
    assert elapsed < timeout + 5.0 + 15.0, f"took {elapsed:.1f}s"
    stacks = (Path(s.bundle) / "rank1" / "stacks.txt").read_text()
    assert "_fault_point" in stacks, "rank 1's stacks show where it hangs"
    assert not _rank_processes()


def test_a_killed_rank_leaves_a_bundle_and_no_orphans(bundle_root: Path) -> None:
    cfg = mr_config(**{"topology.pp": 2, "faults": (parse_fault("rank-kill:rank=1,step=10"),)})
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH
    assert s.bundle is not None
    m = load_manifest(Path(s.bundle))
    dead = next(e for e in m.ranks if e.rank == 1)
    assert dead.exit_code == -9
    survivor = next(e for e in m.ranks if e.rank == 0)
    assert survivor.files.stacks, "the surviving rank still dumped its evidence"
    state = json.loads((Path(s.bundle) / (survivor.files.state or "")).read_text())
    assert state["rank"] == 0
    # what the killed rank journaled as it happened is its trace now: the fault that killed it
    assert dead.files.events == "rank1/events.jsonl"
    lines = [json.loads(x) for x in (Path(s.bundle) / dead.files.events).read_text().splitlines()]
    assert [(e["kind"], e["attrs"]["kind"], e["durable"]) for e in lines] == \
        [("fault.fired", "rank-kill", True)]
    assert not list(Path(s.bundle).glob("rank*/journal.jsonl"))  # the survivor dumped its ring
    assert not _rank_processes()
