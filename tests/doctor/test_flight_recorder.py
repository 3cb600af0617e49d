"""PyTorch Flight Recorder dumps: the restricted unpickler (hostile pickles never run) and the
cross-rank alignment, on real gloo dumps that torch's own analyzer cannot read."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from doctor.read.safe_pickle import load_plain
from hicache_runtime.contracts.errors import DumpFormatError
from tests.doctor.conftest import FIXTURES

REAL = FIXTURES / "collective-order-deadlock" / "gloo-tp4-real"


class _Boom:
    """Unpickling this calls os.system: the payload a hostile dump would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _hostile(marker: Path) -> list[bytes]:
    boom = _Boom(marker)
    return [pickle.dumps(boom, protocol=p) for p in range(6)] + [
        pickle.dumps({"entries": [boom]}),
        f"cos\nsystem\n(S'touch {marker}'\ntR.".encode(),      # GLOBAL + REDUCE, protocol 0
        b"\x80\x02c__builtin__\neval\nq\x00X\x06\x00\x00\x001+1+1+q\x01\x85q\x02Rq\x03.",
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x94\x8c\x06system\x94\x93.",
        b"\x80\x02(X\x01\x00\x00\x00aq\x00P.",                   # PERSID-style persistent id
    ]


def test_hostile_pickles_are_refused_and_never_execute(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    for payload in _hostile(marker):
        with pytest.raises(DumpFormatError):
            load_plain(payload)
    assert not marker.exists()


def test_hostile_pickle_in_a_directory_is_reported_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps(_Boom(marker)))
    d = diagnose([str(tmp_path)])
    assert not marker.exists()
    (rec,) = d.inputs
    assert rec.status == "error"
    assert "refused" in rec.message
    assert d.exit_code == 2


def test_plain_data_loads_in_every_protocol() -> None:
    data = {"version": "2.10", "entries": [{"a": (1, 2.5, None, True, "s", -(2**70))}]}
    for proto in range(6):
        assert load_plain(pickle.dumps(data, protocol=proto)) == data
    # bytes need protocol 3+ (older protocols rebuild them by calling _codecs.encode)
    for proto in (3, 4, 5):
        assert load_plain(pickle.dumps({"b": b"x\x00"}, protocol=proto)) == {"b": b"x\x00"}


def test_truncated_and_garbage_pickles_are_clear_errors() -> None:
    good = (REAL / "nccl_trace_rank_0").read_bytes()
    for payload in (good[: len(good) // 2], b"\x80\x05", b"\x80\x04garbage" * 10):
        with pytest.raises(DumpFormatError, match="pickle"):
            load_plain(payload)


def test_absurd_nesting_is_refused() -> None:
    nested: list[object] = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(DumpFormatError, match="nests deeper"):
        load_plain(pickle.dumps(nested))


def test_real_gloo_dump_loads() -> None:
    data = load_plain((REAL / "nccl_trace_rank_1").read_bytes())
    assert data["version"] == "2.10"
    assert {e["profiling_name"] for e in data["entries"]} == {"gloo:all_reduce",
                                                               "gloo:broadcast"}


def test_alignment_finds_the_op_mismatch_on_real_dumps() -> None:
    d = diagnose(sorted(str(p) for p in REAL.glob("nccl_trace_rank_*")))
    (f,) = [f for f in d.collectives if f.kind == "op-mismatch"]
    assert f.seq == 8
    assert f.ranks == [0, 1, 2, 3]
    assert "broadcast from _broadcast_reqs_across_ranks" in f.detail
    assert {r.last_seq.get("pg1") for r in d.ranks} == {"enqueued 8 / completed 8"}


def test_alignment_on_a_partial_rank_set() -> None:
    d = diagnose([str(REAL / "nccl_trace_rank_0"), str(REAL / "nccl_trace_rank_1")])
    assert [f.ranks for f in d.collectives if f.kind == "op-mismatch"] == [[0, 1]]


def test_size_mismatch_found_on_gloo_dumps() -> None:
    case = FIXTURES / "collective-shape-mismatch" / "gloo-prefetch-real"
    d = diagnose(sorted(str(p) for p in case.glob("nccl_trace_rank_*")))
    (f,) = d.collectives
    assert f.kind == "size-mismatch"
    assert "1092" in f.detail
    assert "1086" in f.detail


@pytest.mark.slow
def test_torch_analyzer_fails_on_the_same_gloo_dumps(tmp_path: Path) -> None:
    """The contrast the doctor exists for: torch's fr_trace raises KeyError on gloo dumps."""
    for p in REAL.glob("nccl_trace_rank_*"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                           str(tmp_path), "-p", "nccl_trace_rank_"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode != 0
    assert "KeyError" in proc.stderr


CROSSED = FIXTURES / "collective-order-deadlock" / "gloo-crossed-groups"


def _crossed_verdict(paths: list[str]) -> None:
    d = diagnose(paths)
    assert d.verdicts[0].signature == "collective-order-deadlock"
    assert d.verdicts[0].confidence >= 0.8
    (crossed,) = [f for f in d.collectives if f.kind == "crossed"]
    assert crossed.ranks == [0, 1]
    evidence = " ".join(e.text for e in d.verdicts[0].evidence)
    # the missing rank and the sequence number it never reached are in the evidence
    assert "rank 0 waits in all_reduce #4 of group 1" in evidence
    assert "which rank 1 never entered" in evidence
    assert "rank 1 waits in broadcast #4 of group 2" in evidence


def test_gloo_dumps_of_ranks_stopped_in_different_groups_name_the_deadlock() -> None:
    """pg_config empty, every entry 'scheduled' forever, the ranks' last entries in different
    process groups: still a collective-order deadlock, with who is missing where."""
    data = load_plain((CROSSED / "nccl_trace_rank_0").read_bytes())
    assert data["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[]"}}
    assert {e["state"] for e in data["entries"]} == {"scheduled"}
    _crossed_verdict(sorted(str(p) for p in CROSSED.glob("nccl_trace_rank_*")))


@pytest.mark.slow
@pytest.mark.multiproc
def test_fresh_gloo_dumps_of_a_crossed_hang(tmp_path: Path) -> None:
    """The same from dumps this machine's torch writes now (two real gloo ranks)."""
    tool = FIXTURES / "tools" / "gloo_crossed.py"
    subprocess.run([sys.executable, str(tool), str(tmp_path), str(29600 + os.getpid() % 300)],
                   check=True, timeout=180, capture_output=True)
    _crossed_verdict(sorted(str(p) for p in tmp_path.glob("nccl_trace_rank_*")))


FIRST_OP = FIXTURES / "collective-order-deadlock" / "gloo-crossed-first-op"


def test_gloo_dumps_whose_only_entries_are_in_different_groups_name_the_deadlock() -> None:
    """torch 2.13 gloo dumps with an empty pg_config where each rank's only entry is its own
    group's collective (rank 0 all_reduce in group 1, rank 1 broadcast in group 2): nothing
    records who belongs to which group, yet each rank waits for a rank that never came."""
    data = load_plain((FIRST_OP / "nccl_trace_rank_0").read_bytes())
    assert data["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[]"}}
    assert [e["profiling_name"] for e in data["entries"]] == ["gloo:all_reduce"]
    d = diagnose(sorted(str(p) for p in FIRST_OP.glob("nccl_trace_rank_*")))
    assert d.verdicts[0].signature == "collective-order-deadlock"
    (crossed,) = [f for f in d.collectives if f.kind == "crossed"]
    assert crossed.ranks == [0, 1]
    assert crossed.group == "1,2"
    assert "rank 0 waits in all_reduce #1 of group 1" in crossed.detail
    assert "rank 1 waits in broadcast #1 of group 2" in crossed.detail
    assert "no group membership" in crossed.detail
