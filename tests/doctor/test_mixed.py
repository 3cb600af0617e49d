"""A directory of mixed real artifacts (server log, py-spy JSON, Flight Recorder pickles) from a
4-rank job with rank 2's evidence missing: one diagnosis, the missing rank, how to collect it."""

from __future__ import annotations

import tarfile
from pathlib import Path

from doctor.diagnose import diagnose
from tests.doctor.conftest import FIXTURES

MIXED = FIXTURES / "mixed" / "tp4-rank2-missing"


def test_one_diagnosis_with_the_missing_rank_and_its_collect_commands() -> None:
    d = diagnose([str(MIXED)])
    assert [v.signature for v in d.verdicts] == ["collective-order-deadlock"]
    assert d.missing_ranks == [2]
    assert {r.rank: r.state for r in d.ranks} == {0: "blocked", 1: "blocked", 2: "missing",
                                                 3: "blocked"}
    commands = [m.command for m in d.missing if m.rank == 2]
    assert any(c.startswith("py-spy dump --json --pid") and "rank2.pyspy.json" in c
               for c in commands)
    assert any("nccl_trace_rank_2" in c for c in commands)
    assert any("TP2" in c for c in commands)
    assert any(m.rank is None and m.command.startswith("hicache capture") for m in d.missing)
    kinds = {i.kind for i in d.inputs}
    assert {"text", "pyspy-json", "torch-flight-recorder"} <= kinds


def test_the_odd_rank_out_and_its_call_site_are_named() -> None:
    d = diagnose([str(MIXED)])
    sites = {s.site: s.ranks for s in d.blocked_sites}
    assert sites == {"writing_check (hiradix_cache.py:22)": [0, 3],
                     "_broadcast_reqs_across_ranks (scheduler.py:14)": [1]}
    (f,) = [f for f in d.collectives if f.kind == "op-mismatch"]
    assert f.seq == 8
    assert "rank 1: broadcast" in f.detail


def test_same_diagnosis_from_an_archive(tmp_path: Path) -> None:
    archive = tmp_path / "incident.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(MIXED, arcname="incident")
    d = diagnose([str(archive)])
    assert [v.signature for v in d.verdicts] == ["collective-order-deadlock"]
    assert d.missing_ranks == [2]
