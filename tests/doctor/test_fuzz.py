"""Hostile, truncated, mutated and random input never produces a traceback: the doctor always
returns a Diagnosis (and the CLI an exit code), whatever the bytes."""

from __future__ import annotations

import io
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from doctor.diagnose import diagnose
from doctor.report.model import Diagnosis
from tests.doctor.conftest import FIXTURES

SAMPLES = sorted(p for p in FIXTURES.glob("*/*/*") if p.is_file() and p.name != "expected.json"
                 and p.stat().st_size < 300_000)
#: Names that steer the sniffer into every reader (JSON kinds, pickles, traces, text).
NAMES = ["server.log", "manifest.json", "capture.json", "state.json", "flight_recorder.json",
         "rank0/events.jsonl", "rank1.pyspy.json", "nccl_trace_rank_2", "stacks.txt",
         "bundle.tar.gz", "x.gz"]
_FAST = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _check(d: Diagnosis) -> None:
    assert isinstance(d, Diagnosis)
    assert d.exit_code in (0, 1, 2)
    Diagnosis.model_validate_json(d.model_dump_json())


@_FAST
@given(st.sampled_from(NAMES), st.binary(max_size=4096))
def test_random_bytes(name: str, data: bytes) -> None:
    _check(diagnose(streams=[(name, io.BytesIO(data))]))


@_FAST
@given(st.sampled_from(SAMPLES), st.data())
def test_truncated_fixture(path: Path, data: st.DataObject) -> None:
    raw = path.read_bytes()
    cut = data.draw(st.integers(0, len(raw)))
    _check(diagnose(streams=[(path.name, io.BytesIO(raw[:cut]))]))


@_FAST
@given(st.sampled_from(SAMPLES), st.lists(st.tuples(st.integers(0, 10**9), st.binary(
    min_size=0, max_size=8)), max_size=8))
def test_mutated_fixture(path: Path, edits: list[tuple[int, bytes]]) -> None:
    raw = bytearray(path.read_bytes())
    for pos, blob in edits:
        at = pos % (len(raw) + 1)
        raw[at:at + len(blob)] = blob
    _check(diagnose(streams=[(path.name, io.BytesIO(bytes(raw)))]))


@_FAST
@given(st.lists(st.sampled_from([
    "Traceback (most recent call last):", '  File "/x/sglang/a.py", line 1, in writing_check',
    "IndexError: pop from empty list", "Fatal Python error: Segmentation fault",
    "Current thread 0x00007f00 (most recent call first):", "Python v3.11.7 (/usr/bin/python)",
    'Thread 12 (idle): "MainThread"', "    all_reduce (torch/distributed/c10d.py:1)",
    "Root Cause (first observed failure):", "[3]:", "  exitcode  : -11 (pid: 9)",
    "[rank1]:", "[2026-01-01 00:00:00 TP1 PP1] ", "  + Exception Group Traceback (most "
    "recent call last):", "  +-+---- 1 ----", "    | ValueError: 1", "", "During handling of "
    "the above exception, another exception occurred:", "tp_size=0 pp_size=99999999999"]),
    max_size=80))
def test_scrambled_structure(lines: list[str]) -> None:
    _check(diagnose(streams=[("server.log", io.BytesIO("\n".join(lines).encode()))]))


def test_every_fixture_file_alone_and_all_together(tmp_path: Path) -> None:
    for path in SAMPLES:
        _check(diagnose([str(path)]))
    _check(diagnose([str(FIXTURES)]))
