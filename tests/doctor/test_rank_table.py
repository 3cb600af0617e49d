"""The rank table: the frame shown is the caller, never communication plumbing (in tracebacks,
faulthandler dumps and py-spy dumps alike); a C++ abort inside a collective is a crash at that
collective's call site."""

from __future__ import annotations

import json
from pathlib import Path

from doctor.diagnose import diagnose

RT = "/srv/app/hicache_runtime"
TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
# innermost first: the collective, torch's wrapper, the runtime's plumbing, then the caller
PLUMBED = [
    ("all_reduce", f"{TORCH}/distributed_c10d.py", 3252),
    ("wrapper", f"{TORCH}/c10d_logger.py", 83),
    ("<lambda>", f"{RT}/comm.py", 132),
    ("_run", f"{RT}/comm.py", 117),
    ("all_reduce", f"{RT}/comm.py", 132),
    ("all_reduce", f"{RT}/groups.py", 105),
    ("legacy_tp_min", f"{RT}/sync.py", 228),
    ("_classic_writing_check", f"{RT}/hicache.py", 422),
    ("check_events", f"{RT}/hicache.py", 394),
    ("run", f"{RT}/pipeline.py", 73),
]
CALLER = "_classic_writing_check (hicache.py:422)"


def _traceback(frames: list[tuple[str, str, int]], error: str) -> str:
    lines = ["Traceback (most recent call last):"]
    for func, file, line in reversed(frames):
        lines += [f'  File "{file}", line {line}, in {func}', "    ..."]
    return "\n".join([*lines, error]) + "\n"


def _faulthandler(frames: list[tuple[str, str, int]], header: str) -> str:
    return "\n".join([header] + [f'  File "{file}", line {line} in {func}'
                                 for func, file, line in frames]) + "\n"


def test_traceback_frame_is_the_caller_not_the_lambda(tmp_path: Path) -> None:
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "traceback.txt").write_text(_traceback(
        PLUMBED, "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
                 "operation to complete"))
    (row,) = diagnose([str(tmp_path)]).ranks
    assert row.state == "blocked"
    assert row.frame == CALLER
    assert row.site == CALLER


def test_faulthandler_and_pyspy_frames_are_the_caller(tmp_path: Path) -> None:
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "stacks.txt").write_text(
        _faulthandler(PLUMBED, "Thread 0x00007f0000000001 (most recent call first):"))
    (tmp_path / "rank1").mkdir()
    (tmp_path / "rank1" / "pyspy.json").write_text(json.dumps([{
        "thread_name": "MainThread", "os_thread_id": 7, "active": False, "frames": [
            {"name": "recv", "filename": f"{TORCH}/distributed_c10d.py", "line": 2799},
            {"name": "Group.recv.<locals>.<lambda>", "filename": f"{RT}/comm.py", "line": 165},
            {"name": "Group._run", "filename": f"{RT}/comm.py", "line": 117},
            {"name": "Group.recv", "filename": f"{RT}/comm.py", "line": 165},
            {"name": "Group.recv_object", "filename": f"{RT}/comm.py", "line": 176},
            {"name": "PipelineEngine._result_tokens", "filename": f"{RT}/pipeline.py",
             "line": 173},
            {"name": "PipelineEngine.run", "filename": f"{RT}/pipeline.py", "line": 75}]}]))
    rows = {r.rank: r for r in diagnose([str(tmp_path)]).ranks}
    assert rows[0].frame == CALLER
    assert rows[1].frame == "_result_tokens (pipeline.py:173)"
    assert rows[1].site == "_result_tokens (pipeline.py:173)"


def test_an_error_raised_by_plumbing_alone_still_names_a_frame(tmp_path: Path) -> None:
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "traceback.txt").write_text(_traceback(
        [("_end_round", f"{RT}/sync.py", 253)], "ResourceLeak: too many pending sends"))
    (row,) = diagnose([str(tmp_path)]).ranks
    assert row.frame == "_end_round (sync.py:253)"


ABORT_LOG = """\
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 47744 vs 35456. \
Received data size doesn't match expected size. Is there a distributed collective mismatch?
Fatal Python error: Aborted

Thread 0x00007f808affd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 982 in run

"""


def test_a_cpp_abort_inside_a_collective_is_a_crash_at_its_call_site(tmp_path: Path) -> None:
    main = [("all_reduce", f"{TORCH}/distributed_c10d.py", 3252),
            ("<lambda>", f"{RT}/comm.py", 132), ("_run", f"{RT}/comm.py", 117),
            ("all_reduce", f"{RT}/groups.py", 105), ("_attention", f"{RT}/model.py", 175),
            ("forward", f"{RT}/model.py", 144)]
    (tmp_path / "rank0").mkdir()
    (tmp_path / "rank0" / "log.txt").write_text(
        ABORT_LOG + _faulthandler(main, "Thread 0x00007f80fe68fb80 (most recent call first):"))
    d = diagnose([str(tmp_path)])
    (row,) = d.ranks
    assert row.state == "crashed"
    assert row.site == "_attention (model.py:175)"
    assert row.error is not None
    assert "Fatal: Aborted after gloo::EnforceNotMet" in row.error
    assert any("fact collective-size-mismatch: rank 0 failed inside the collective entered "
               "from _attention (model.py:175): 47744 bytes arrived where it expected 35456"
               in line for line in d.rule_log)
