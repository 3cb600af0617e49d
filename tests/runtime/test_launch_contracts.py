"""The pieces a run's processes agree on: the outcome classifier, the rank result file, the dump
request, the py-spy helper and the one manifest builder."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.config import load_config
from hicache_runtime.contracts import pyspy
from hicache_runtime.contracts.bundle import FiredFaultRecord, RankEntry, RunOutcome
from hicache_runtime.contracts.errors import (
    DumpFormatError,
    InjectedFault,
    RankDivergence,
    StepStalled,
    WorkerDied,
)
from hicache_runtime.contracts.outcome import (
    EXIT_CRASH,
    EXIT_HANG,
    EXIT_OK,
    FLIGHT_RECORD_ATTR,
    CommTimeouts,
    classify,
    classify_exit,
    describe_exit,
    exit_code,
)
from hicache_runtime.contracts.rank_result import (
    RankResult,
    RequestResult,
    read_rank_result,
    write_rank_result,
)
from hicache_runtime.contracts.run_files import RunDir, in_bundle
from hicache_runtime.launch.bundles import build_manifest
from hicache_runtime.launch.launcher import read_results
from hicache_runtime.launch.side_channel import read_dump, request_dump

ROOT = Path(__file__).resolve().parents[2]
TIMEOUTS = CommTimeouts(4.0, {"world": 120.0})


def _failed_op(group: str, waited_s: float, message: str = "gloo said so") -> RuntimeError:
    """A communication op's exception as the flight recorder leaves it."""
    exc = RuntimeError(message)
    start = 1_000_000_000
    setattr(exc, FLIGHT_RECORD_ATTR, {"group": group, "t_start_ns": start,
                                      "t_end_ns": start + int(waited_s * 1e9),
                                      "state": "failed"})
    return exc


def test_a_stalled_scheduler_is_a_hang_and_anything_unexplained_a_crash() -> None:
    assert classify(StepStalled("stuck")) is RunOutcome.HANG
    assert classify(InjectedFault("boom")) is RunOutcome.CRASH
    assert classify(KeyboardInterrupt()) is RunOutcome.CRASH


def test_an_op_that_waited_its_group_timeout_is_a_hang() -> None:
    assert classify(_failed_op("pp_act", 4.0), TIMEOUTS) is RunOutcome.HANG
    assert classify(_failed_op("pp_act", 0.2), TIMEOUTS) is RunOutcome.CRASH  # peer gone
    # the world group waits the start-up timeout, not the protocol one
    assert classify(_failed_op("world", 5.0), TIMEOUTS) is RunOutcome.CRASH
    assert classify(_failed_op("world", 120.0), TIMEOUTS) is RunOutcome.HANG
    # without process groups nothing can have timed out
    assert classify(_failed_op("pp_act", 9.0)) is RunOutcome.CRASH


def test_the_message_does_not_decide() -> None:
    """gloo's words are not read: a timeout is told by how long the op waited."""
    assert classify(RuntimeError("Timed out waiting 4000ms for recv"), TIMEOUTS) \
        is RunOutcome.CRASH
    assert classify(_failed_op("tp_cpu", 4.5, "Connection closed by peer"), TIMEOUTS) \
        is RunOutcome.HANG


def _raised_from(exc: BaseException, cause: BaseException) -> BaseException:
    """``exc`` as ``raise exc from cause`` leaves it."""
    exc.__cause__ = cause
    return exc


def test_a_worker_that_timed_out_makes_its_rank_a_hang() -> None:
    died = _raised_from(WorkerDied("prefetch-query died"), _failed_op("prefetch_hits", 4.1))
    assert classify(died, TIMEOUTS) is RunOutcome.HANG
    died = _raised_from(WorkerDied("backup died"), InjectedFault("boom"))
    assert classify(died, TIMEOUTS) is RunOutcome.CRASH


def test_a_divergence_is_a_crash_whatever_it_was_raised_from() -> None:
    diverged = _raised_from(RankDivergence("ranks disagree"), StepStalled("stuck"))
    assert classify(diverged, TIMEOUTS) is RunOutcome.CRASH


def test_exit_codes() -> None:
    assert [exit_code(o) for o in RunOutcome] == [EXIT_OK, EXIT_CRASH, EXIT_HANG, EXIT_CRASH]
    assert classify_exit(-9, RunOutcome.HANG) is RunOutcome.CRASH
    assert classify_exit(0, RunOutcome.HANG) is RunOutcome.HANG
    assert classify_exit(None, RunOutcome.WRONG_OUTPUT) is RunOutcome.WRONG_OUTPUT
    assert describe_exit(-9) == " (SIGKILL)"
    assert describe_exit(3) == describe_exit(None) == describe_exit(-1000) == ""


def _result() -> RankResult:
    return RankResult(
        rank=1, tp_rank=1, pp_rank=0, outcome=RunOutcome.HEALTHY, steps=7, wall_s=0.5,
        requests={"r0": RequestResult(input_ids=[1, 2], output_ids=[3], status="finished",
                                      cached={"device": 2, "host": 0, "storage": 0})},
        stats={"backup_tokens": 4, "l3": {"backend": {"hits": 1}}},
        faults_fired=[FiredFaultRecord(spec="s", kind="crash", point="p", rank=1, step=3,
                                       thread="MainThread")],
        drain={"device_capacity": 8, "device_free": 8, "device_tree": 0})


def test_a_rank_result_round_trips(tmp_path: Path) -> None:
    path = RunDir(tmp_path).result(1)
    assert read_rank_result(path) is None  # not written (yet)
    write_rank_result(path, _result())
    assert path.name == "rank1.result.json"
    assert read_rank_result(path) == _result()
    assert json.loads(path.read_text())["requests"]["r0"]["output_ids"] == [3]


@pytest.mark.parametrize(("content", "words"), [
    (b'{"rank": 0, "outco', "not a rank result"),
    (b"[1, 2]", "not a rank result"),
    (b'{"rank": 0, "tp_rank": 0, "pp_rank": 0, "outcome": "fine"}', "outcome"),
    (b'{"rank": 0, "tp_rank": 0, "pp_rank": 0, "outcome": "healthy", "extra": 1}', "extra"),
])
def test_a_malformed_rank_result_is_a_clear_error(tmp_path: Path, content: bytes,
                                                  words: str) -> None:
    path = RunDir(tmp_path).result(0)
    path.write_bytes(content)
    with pytest.raises(DumpFormatError, match=words) as info:
        read_rank_result(path)
    assert "rank0.result.json" in str(info.value)


def test_an_oversized_rank_result_is_not_read(tmp_path: Path) -> None:
    path = RunDir(tmp_path).result(0)
    write_rank_result(path, _result())
    with pytest.raises(DumpFormatError, match="larger than 64 bytes"):
        read_rank_result(path, limit=64)


def test_the_launcher_reads_every_result_and_says_which_is_not_one(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    write_rank_result(run.result(0), _result())
    run.result(2).write_text('{"rank": 2, "tp_rank": 0}')
    results, unreadable = read_results(tmp_path, range(3))
    assert results == {0: _result()}  # rank 1 wrote nothing
    assert list(unreadable) == [2]
    assert unreadable[2].startswith("rank2.result.json: not a rank result (pp_rank: Field")


def test_the_first_dump_request_wins(tmp_path: Path) -> None:
    assert read_dump(tmp_path) is None
    assert request_dump(tmp_path, 2, RunOutcome.HANG, "rank 2: stuck")
    assert not request_dump(tmp_path, -1, RunOutcome.CRASH, "launcher: rank 1 died")
    request = read_dump(tmp_path)
    assert request is not None
    assert (request.by, request.outcome, request.reason) == (2, RunOutcome.HANG, "rank 2: stuck")
    RunDir(tmp_path).dump.write_text('{"by": 2, "outc')  # its writer is not done yet
    assert read_dump(tmp_path) is None


def test_one_manifest_builder() -> None:
    cfg = load_config({"topology.tp": 2, "legacy": ["skip-empty-sync"],
                       "faults": [parse_fault("crash:rank=1,point=model.forward,step=3")]})
    entry = RankEntry(rank=0, tp_rank=0, pp_rank=0, outcome=RunOutcome.CRASH)
    m = build_manifest(cfg, RunOutcome.CRASH, "rank 1: boom", [entry], [], missing_ranks=[1])
    assert m.topology == {"tp": 2, "pp": 1, "world_size": 2}
    assert m.faults == [f.compact() for f in cfg.faults]
    assert m.legacy == ["skip-empty-sync"]
    assert (m.ranks, m.missing_ranks, m.mismatches) == ([entry], [1], [])
    assert m.config == cfg.model_dump(mode="json")


def test_pyspy_that_cannot_run_leaves_its_reason_and_the_hint(tmp_path: Path) -> None:
    res = pyspy.dump(os.getpid(), command=[str(tmp_path / "no-such-py-spy")], timeout_s=5)
    assert isinstance(res.failure, OSError)
    assert not res.ok
    assert not res.timed_out
    d = tmp_path / "bundle" / "rank3"
    assert pyspy.write_into(d, res) is None
    text = (d / "pyspy.err.txt").read_text()
    assert text.startswith("py-spy failed: ")
    assert pyspy.PTRACE_HINT in text


def test_pyspy_that_fails_keeps_its_own_message(tmp_path: Path) -> None:
    res = pyspy.dump(os.getpid(), command=[sys.executable, "-c",
                                           "import sys; sys.exit('Error: no such process')"])
    assert res.failure is None
    assert res.returncode == 1
    assert not res.ok
    assert pyspy.write_into(tmp_path / "rank0", res) is None
    assert (tmp_path / "rank0" / "pyspy.err.txt").read_text().startswith(
        "Error: no such process\n\n" + pyspy.PTRACE_HINT)


@pytest.mark.skipif(pyspy.find_pyspy() is None, reason="py-spy is not installed")
def test_pyspy_dumps_a_live_python_process(tmp_path: Path) -> None:
    # The child says when its interpreter is up: py-spy attached to a process still loading
    # its interpreter cannot find it (the test raced that on a loaded machine).
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        res = pyspy.dump(child.pid, timeout_s=30)
    finally:
        child.kill()
        child.wait(timeout=10)
    if not res.ok and ("ermission" in res.stderr or "ptrace" in res.stderr.lower()):
        pytest.skip(f"py-spy may not ptrace here: {res.stderr.strip()[:200]}")
    assert res.ok, res.stderr
    assert pyspy.write_into(tmp_path / "rank0", res) == in_bundle(0, "pyspy.json")
    threads = json.loads((tmp_path / "rank0" / "pyspy.json").read_text())
    assert any(f["name"] == "<module>" for t in threads for f in t["frames"])


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_launcher_and_the_rank_process_do_not_import_each_other() -> None:
    launch = ROOT / "hicache_runtime" / "launch"
    assert "hicache_runtime.launch.rank_process" not in _imports(launch / "launcher.py")
    assert "hicache_runtime.launch.launcher" not in _imports(launch / "rank_process.py")
