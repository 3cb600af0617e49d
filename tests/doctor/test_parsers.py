"""Parsers of text artifacts: tracebacks (chains, groups, carets), faulthandler (real dumps),
py-spy text/JSON (real dumps, --native, --locals), torchrun failure summaries, prefixes."""

from __future__ import annotations

import faulthandler
import io
import json
import threading
import traceback
from pathlib import Path

from doctor.model.builder import EvidenceBuilder
from doctor.model.evidence import ExceptionRecord, RankHint, SourceRef, ThreadStack
from doctor.read.dumps import read_pyspy_json
from doctor.read.logscan import LogScanner
from doctor.read.rankid import path_hint
from doctor.read.text.lines import LineHandler
from doctor.read.text.prefixes import strip_prefixes
from doctor.read.text.threaddumps import FaulthandlerParser, PySpyTextParser
from doctor.read.text.tracebacks import TracebackParser
from signatures.loader import load_catalog
from tests.doctor.conftest import FIXTURES


def _tb(text: str) -> list[ExceptionRecord]:
    out: list[ExceptionRecord] = []
    p = TracebackParser(out.append)
    for i, line in enumerate(text.splitlines(), 1):
        if p.open or p.starts(line):
            p.feed(line, SourceRef("t", i))
    return out


def _scan(name: str, text: str) -> EvidenceBuilder:
    sink = EvidenceBuilder()
    LogScanner(LineHandler(load_catalog(), sink, name)).scan(io.BytesIO(text.encode()))
    return sink


def _raise_chain() -> str:
    def inner() -> None:
        [].pop()

    try:
        try:
            inner()
        except IndexError as exc:
            raise RuntimeError("drain failed") from exc
    except RuntimeError:
        return traceback.format_exc()
    raise AssertionError("unreachable")


def test_chained_traceback_keeps_both_exceptions_innermost_first() -> None:
    excs = _tb(_raise_chain())
    assert [e.type for e in excs] == ["IndexError", "RuntimeError"]
    assert excs[0].message == "pop from empty list"
    assert excs[0].frames[0].func == "inner"
    assert excs[1].chain == "cause"


def test_context_chain_and_caret_lines() -> None:
    text = ("Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n    x[1]\n"
            "    ~^^^\nKeyError: 1\n\nDuring handling of the above exception, another exception "
            "occurred:\n\nTraceback (most recent call last):\n  File \"a.py\", line 5, in f\n"
            "    raise ValueError('v')\nValueError: v\n")
    excs = _tb(text)
    assert [(e.type, e.chain) for e in excs] == [("KeyError", ""), ("ValueError", "context")]


EXCEPTION_GROUP = """\
  + Exception Group Traceback (most recent call last):
  |   File "/srv/sglang/srt/managers/cache_controller.py", line 19, in <module>
  |     raise ExceptionGroup("storage", [ValueError(1), TypeError("two")])
  | ExceptionGroup: storage (2 sub-exceptions)
  +-+---------------- 1 ----------------
    | ValueError: 1
    +---------------- 2 ----------------
    | Traceback (most recent call last):
    |   File "/srv/sglang/srt/mem_cache/hiradix_cache.py", line 7, in writing_check
    |     raise TypeError("two")
    | TypeError: two
    +------------------------------------
"""


def test_exception_group_members_are_records() -> None:
    types = {e.type: e for e in _tb(EXCEPTION_GROUP)}
    assert {"ExceptionGroup", "ValueError", "TypeError"} <= set(types)
    assert types["TypeError"].chain == "group"
    assert types["TypeError"].frames[0].func == "writing_check"


def test_truncated_traceback_emits_nothing_and_does_not_raise() -> None:
    assert _tb("Traceback (most recent call last):\n  File \"a.py\", line 3, in f\n") == []


def test_sglang_prefix_and_continuation_lines_belong_to_the_rank() -> None:
    text = ("[2026-01-15 05:44:28 TP1 PP1] Scheduler hit an exception: Traceback (most recent "
            "call last):\n  File \"/x/sglang/srt/mem_cache/hiradix_cache.py\", line 9, in "
            "writing_check\n    q.pop(0)\nIndexError: pop from empty list\n"
            "[2026-01-15 05:44:29] SIGQUIT received. signum=None, frame=None. It usually means "
            "one child failed.\n")
    ev = _scan("s.log", text).finish()
    (rank,) = list(ev.ranks.values())
    assert (rank.tp, rank.pp) == (1, 1)
    (exc,) = list(rank.exceptions)
    assert exc.source == SourceRef("s.log", 4)
    assert exc.frames[0].func == "writing_check"
    assert ev.unranked.hits["sigquit"].count == 1


def test_torchrun_interleaving_keeps_ranks_apart() -> None:
    text = "\n".join([
        "[rank1]:Traceback (most recent call last):",
        "[rank0]:Traceback (most recent call last):",
        '[rank1]:  File "/w/sglang/srt/mem_cache/hiradix_cache.py", line 2, in writing_check',
        '[rank0]:  File "/w/x.py", line 3, in f',
        "[rank1]:    q.pop(0)",
        "[rank0]:RuntimeError: [pair.cc:534] Connection closed by peer [10.0.0.2]:4",
        "[rank1]:IndexError: pop from empty list", ""])
    ev = _scan("torchrun.out", text).finish()
    assert [e.type for e in ev.ranks[1].exceptions] == ["IndexError"]
    assert [e.type for e in ev.ranks[0].exceptions] == ["RuntimeError"]
    assert ev.ranks[0].hits["gloo-connection-closed"].count == 1


def test_torchrun_failure_block_names_root_cause_and_signal() -> None:
    text = (FIXTURES / "prefetch-abort-use-after-free/torchrun-segfault/torchrun.log").read_text()
    ev = _scan("torchrun.log", text).finish()
    (x,) = [x for x in ev.ranks[1].exits if x.root_cause]
    assert (x.exit_code, x.signal, x.pid) == (-11, "SIGSEGV", 6175)


def test_real_faulthandler_dump_all_threads() -> None:
    buf = io.StringIO()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="waiter", daemon=True)
    worker.start()
    path = Path(__import__("tempfile").mkdtemp()) / "stacks.txt"
    with path.open("w") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=True)
    stop.set()
    threads: list[ThreadStack] = []
    p = FaulthandlerParser(threads.append)
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if p.open or p.starts(line):
            p.feed(line, SourceRef("stacks.txt", i))
    p.close()
    assert buf.getvalue() == ""
    current = [t for t in threads if t.current]
    assert len(current) == 1
    assert current[0].frames[0].func == "test_real_faulthandler_dump_all_threads"
    assert any(f.func == "wait" for t in threads if not t.current for f in t.frames)


def test_fatal_faulthandler_marks_the_crashed_thread() -> None:
    text = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007fc593084b80 (most "
            "recent call first):\n  File \"/x/ctypes/__init__.py\", line 519 in string_at\n"
            "  File \"<string>\", line 1 in <module>\n\nExtension modules: numpy (total: 2)\n")
    threads: list[ThreadStack] = []
    p = FaulthandlerParser(threads.append)
    for i, line in enumerate(text.splitlines(), 1):
        if p.open or p.starts(line):
            p.feed(line, SourceRef("f", i))
    p.close()
    assert [(t.current, t.fatal, t.frames[0].func) for t in threads] == [
        (True, "Segmentation fault", "string_at")]


def _pyspy_text(text: str) -> list[ThreadStack]:
    threads: list[ThreadStack] = []
    p = PySpyTextParser(threads.append)
    for i, line in enumerate(text.splitlines(), 1):
        if p.open or p.starts(line):
            p.feed(line, SourceRef("p", i))
    p.close()
    return threads


def test_real_pyspy_text_dump() -> None:
    text = (FIXTURES / "collective-order-deadlock/gloo-tp4-real/rank1.pyspy.txt").read_text()
    (main,) = _pyspy_text(text)
    assert main.name == "MainThread"
    assert main.idle is True
    assert main.frames[0].func == "broadcast"
    assert main.frames[0].line == 3151
    assert main.frames[2].file == "sglang/srt/managers/scheduler.py"


def test_pyspy_native_and_locals_blocks() -> None:
    text = ("Process 8149: python hung.py\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
            'Thread 8149 (active+gil): "MainThread"\n    clock_nanosleep (libc.so.6)\n'
            "    0x7f2fed44524a (libc.so.6)\n    all_reduce_stub (hung.py:5)\n"
            "        Arguments:\n            tensor: [128]\n        Locals:\n"
            "            completed_tokens: 128\n    check_prefetch_progress (hung.py:8)\n")
    (t,) = _pyspy_text(text)
    assert t.idle is False
    assert [(f.func, f.line) for f in t.frames] == [
        ("clock_nanosleep", None), ("0x7f2fed44524a", None), ("all_reduce_stub", 5),
        ("check_prefetch_progress", 8)]


def test_real_pyspy_json_dump() -> None:
    data = json.loads((FIXTURES / "collective-order-deadlock/gloo-tp4-real/rank0.pyspy.json")
                      .read_text())
    sink = EvidenceBuilder()
    assert read_pyspy_json(data, "rank0.pyspy.json", RankHint(rank=0), sink) == 1
    (t,) = list(sink.finish().ranks[0].threads)
    assert t.frames[0].func == "all_reduce"
    assert t.pid is not None


def test_prefixes_and_path_hints() -> None:
    assert strip_prefixes("[default0]:[2026-01-01 00:00:00 DP1 TP3] x").hint == RankHint(
        rank=0, tp=3, dp=1)
    assert strip_prefixes("[PG 0 Rank 2] Timeout at NCCL work: 1").hint.rank == 2
    assert strip_prefixes("ERROR 02-12 03:41:17 engine.py:135] y").rest == "y"
    # horovodrun's [3]<stderr>: and Open MPI's --tag-output [job,rank]<stderr>:
    for line, rank in (("[3]<stderr>:  File \"a.py\", line 1, in f", 3),
                       ("[1,2]<stderr>:  File \"a.py\", line 1, in f", 2)):
        p = strip_prefixes(line)
        assert (p.hint.rank, p.rest) == (rank, '  File "a.py", line 1, in f'), line
    assert path_hint("bundle/rank3/stacks.txt").rank == 3
    assert path_hint("run-tp8/server.log") == RankHint()
    assert path_hint("logs/tp1_pp0.log") == RankHint(tp=1, pp=0)


def test_a_block_starts_only_on_a_line_holding_one_of_its_parsers_start_literals() -> None:
    """The line reader skips a parser's ``starts`` on lines that hold none of its
    ``START_LITERALS`` (one automaton pass finds them): over every line of the corpus and
    the fixtures, ``starts`` is never true on such a line."""
    from doctor.read.text.lines import BLOCK_PARSERS
    from doctor.read.text.pages import clean_line
    from tests.corpus import load_cases

    parsers = BLOCK_PARSERS
    texts = [c.text.decode("utf-8", errors="replace") for c in load_cases()]
    texts += [p.read_text(errors="replace") for p in sorted(FIXTURES.rglob("*"))
              if p.is_file() and p.suffix in (".log", ".txt", ".md") and p.stat().st_size < 1 << 22]
    started = dict.fromkeys(parsers, 0)
    for text in texts:
        for line in text.splitlines():
            rest = strip_prefixes(clean_line(line[:8192])).rest
            for p in parsers:
                if p.starts(rest):
                    started[p] += 1
                    assert any(lit in rest for lit in p.START_LITERALS), (p.__name__, rest)
    assert all(started.values()), started  # every parser starts somewhere in that text


def test_a_container_runtime_s_stamp_is_no_record_of_its_own() -> None:
    # CRI (kubelet) and `docker logs -t` stamp every physical line: a message that goes on over
    # lines goes on under their stamps, and a logger's own prefix after one keeps its level
    # and names its site
    cont = strip_prefixes("2026-06-24T17:38:03.000000002+02:00 stderr F but Rank 0 is running")
    assert (cont.rest, cont.style) == ("but Rank 0 is running", "")
    vllm = strip_prefixes("2026-06-24T17:38:03.1+02:00 stderr F INFO 02-17 17:03:44 "
                          "vineyard_llm_cache.py:306] VineyardLLMCache from_envs None")
    assert (vllm.site, vllm.style, vllm.rest) == ("vineyard_llm_cache.py", "generic",
                                                  "VineyardLLMCache from_envs None")
    sev = strip_prefixes("ERROR 2026-06-15T14:10:59.392125190Z the store is gone")
    assert (sev.rest, sev.error, sev.style) == ("the store is gone", True, "generic")
    torch_rank = strip_prefixes("2026-06-12T04:13:18.902123456Z [rank3]: RuntimeError: x")
    assert (torch_rank.hint.rank, torch_rank.rest) == (3, "RuntimeError: x")
