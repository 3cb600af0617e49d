"""Readers for what users paste: fragments and foreign formats, on verbatim samples.

Most samples are corpus excerpts (``tests/corpus/cases``, real public reports, unedited); a few
edge cases of the format itself are written here in the shape the tools print.
"""

from __future__ import annotations

import io
from pathlib import Path

from doctor.model.builder import Evidence, EvidenceBuilder
from doctor.model.evidence import ExceptionRecord, SourceRef, ThreadStack
from doctor.read.ingest import Ingester
from doctor.read.text.backtraces import chain_stack
from doctor.read.text.pages import HtmlText, clean_line, looks_like_html
from doctor.read.text.prefixes import strip_prefixes
from doctor.read.text.tracebacks import TracebackParser
from signatures.loader import load_catalog
from tests.corpus import CASES


def _read(name: str, data: bytes) -> Evidence:
    sink = EvidenceBuilder()
    Ingester(load_catalog(), sink).add_stream(name, io.BytesIO(data))
    return sink.finish()


def _case(case_id: str) -> bytes:
    return (CASES / f"{case_id}.txt").read_bytes()


def _excs(ev: Evidence) -> list[ExceptionRecord]:
    return [e for r in ev.all_ranks() for e in r.exceptions]


def _threads(ev: Evidence) -> list[ThreadStack]:
    return [t for r in ev.all_ranks() for t in r.threads]


def _tb(text: str) -> list[ExceptionRecord]:
    out: list[ExceptionRecord] = []
    p = TracebackParser(out.append)
    for i, line in enumerate(text.splitlines(), 1):
        if p.open or p.starts(line):
            p.feed(line, SourceRef("t", i))
    p.close()
    return out


# --- tracebacks ------------------------------------------------------------------------------

def test_traceback_without_header_and_cut_off_keeps_its_frames() -> None:
    """A paste that starts mid-stack and ends before the exception line (sglang #24869)."""
    ev = _read("x.log", _case("sglang-24869-writeback-writing-check-dec-lock-ref"))
    (exc,) = _excs(ev)
    assert exc.truncated
    assert exc.type == ""
    funcs = [f.func for f in exc.frames]
    assert funcs[:3] == ["dec_lock_ref", "writing_check", "check_hicache_events"]


def test_exception_line_first_then_its_frames() -> None:
    text = ("RuntimeError: shape '[3013, -1, 128]' is invalid for input of size 8192000\n"
            '  File "/opt/sglang/python/sglang/srt/models/qwen3.py", line 200, in forward\n'
            "    q = q.view(-1, self.num_heads, self.head_dim)\n")
    (exc,) = _tb(text)
    assert exc.type == "RuntimeError"
    assert "8192000" in exc.message
    assert [f.func for f in exc.frames] == ["forward"]


def test_exception_line_first_then_the_whole_traceback_is_one_exception() -> None:
    text = ("ValueError: bad page\n"
            "Traceback (most recent call last):\n"
            '  File "a.py", line 3, in f\n    g()\n'
            "ValueError: bad page\n")
    (exc,) = _tb(text)
    assert exc.frames[0].func == "f"


def test_multi_line_exception_message_is_kept_whole() -> None:
    """NCCL errors run over several lines; the lines after the first say what failed."""
    ev = _read("x.log", _case("other-1-hkproj-ncclsystemerror-no-route-to-host"))
    (exc,) = [e for e in _excs(ev) if "DistBackendError" in e.type]
    assert "No route to host" in exc.message


def test_json_escaped_frames_are_frames() -> None:
    """Logs shipped as JSON print ``File \\"x.py\\"`` (sglang #22592)."""
    ev = _read("x.log", _case("sglang-22592-himamba-parent-no-child-key"))
    (exc,) = _excs(ev)
    assert exc.type == "AssertionError"
    assert "_delete_tombstone_leaf" in [f.func for f in exc.frames]


def test_bare_assert_reads_its_statement() -> None:
    """``AssertionError`` with no message: the asserted statement is what failed."""
    ev = _read("x.log", _case("sglang-23391-swa-cascade-evict-lock-ref"))
    (exc,) = [e for e in _excs(ev) if e.type == "AssertionError"]
    assert exc.message == "assert cd.lock_ref == 0"


def test_loki_table_rows_are_log_lines() -> None:
    """A Grafana/Loki export: timestamp column, the log line in the middle, indentation gone
    (sglang #25887)."""
    rows = (
        "  |   | 2026-06-12 12:13:18.902 | [2026-06-12 04:13:18 PP0 ATTN_CP1 TP1] Scheduler hit an "
        "exception: Traceback (most recent call last): |  \n"
        '  |   | 2026-06-12 12:13:18.902 | File "/sgl-workspace/sglang/python/sglang/srt/managers/'
        'scheduler.py", line 4064, in run_scheduler_process |  \n'
        "  |   | 2026-06-12 12:13:18.902 | scheduler.run_event_loop() |  \n"
        '  |   | 2026-06-12 12:13:18.902 | File "/sgl-workspace/sglang/python/sglang/srt/managers/'
        'scheduler.py", line 3925, in dispatch_event_loop |  \n'
        "  |   | 2026-06-12 12:13:18.902 | scheduler.event_loop_pp() |  \n")
    ev = _read("grafana.txt", rows.encode())
    (exc,) = _excs(ev)
    # cut off while entering event_loop_pp: its caller's source line names it
    assert [f.func for f in exc.frames] == ["event_loop_pp", "dispatch_event_loop",
                                            "run_scheduler_process"]
    assert ev.ranks[1].tp == 1
    assert ev.ranks[1].pp == 0


# --- stacks ------------------------------------------------------------------------------------

def test_pyspy_frames_without_thread_headers() -> None:
    """``func (file.py:123)`` lines at any indentation are a stack (sglang #22607)."""
    ev = _read("x.log", _case("sglang-22607-prefetch-allreduce-vs-broadcast"))
    stacks = [[f.func for f in t.frames] for t in _threads(ev)]
    assert ["all_reduce", "_all_reduce_attn_groups", "can_terminate_prefetch",
            "check_prefetch_progress", "_get_new_batch_prefill_raw"] in stacks
    assert any(s[:3] == ["broadcast", "broadcast_pyobj", "_broadcast_reqs_across_ranks"]
               for s in stacks)


def test_pyspy_under_a_compose_prefix() -> None:
    """``sglang-1  | `` in front of every line of a py-spy dump (sglang #12076)."""
    ev = _read("x.log", _case("sglang-12076-eagle-verify-hang-hicache-idle"))
    main = [t for t in _threads(ev) if t.name == "MainThread"]
    assert main
    assert main[0].frames[0].func == "_apply"
    assert main[0].idle is False


def test_gdb_backtrace_is_a_native_stack() -> None:
    ev = _read("core.txt", _case("sglang-7211-mooncake-tcp-transport-segfault-gdb"))
    (t,) = _threads(ev)
    assert t.origin == "native"
    assert "mooncake::TcpTransport::startTransfer" in [f.func for f in t.frames]
    assert any(f.file.endswith("tcp_transport.cpp") and f.line == 474 for f in t.frames)


def test_c10_frame_lists_are_native_stacks() -> None:
    text = ("Exception raised from waitForResult at ../torch/csrc/distributed/c10d/"
            "ProcessGroupNCCL.cpp:634 (most recent call first):\n"
            "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 "
            "(0x7f3a in /opt/venv/lib/python3.10/site-packages/torch/lib/libc10.so)\n"
            "frame #1: c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout() + 0x1e6 "
            "(0x7f3b in /opt/venv/lib/python3.10/site-packages/torch/lib/libtorch_cuda.so)\n")
    (t,) = _threads(_read("x.log", text.encode()))
    assert [f.func for f in t.frames] == ["c10::Error::Error(c10::SourceLocation, std::string)",
                                          "c10d::ProcessGroupNCCL::WorkNCCL::checkTimeout()"]


def test_call_chains_in_both_directions() -> None:
    src = SourceRef("t", 1)
    down = chain_stack("writing_check -> _all_reduce_attn_groups -> all_reduce", src)
    up = chain_stack("all_reduce(prefetch_hits_sync_groups) ← _sync_prefetch_hit_query "
                     "← prefetch_thread_func", src)
    assert down is not None
    assert next(f.func for f in down.frames) == "all_reduce"
    assert up is not None
    assert [f.func for f in up.frames] == [
        "all_reduce", "_sync_prefetch_hit_query", "prefetch_thread_func"]
    assert chain_stack("the cache -> the store -> the disk", src) is None  # prose


# --- prefixes of foreign logs ------------------------------------------------------------------

def test_foreign_prefixes_give_ranks_streams_and_sites() -> None:
    vllm = strip_prefixes("(VllmWorker TP3 pid=15157) [2025-09-05 14:46:37,864] LMCache INFO: "
                          "Stored 100 out of total 100 tokens. (cache_engine.py:296:lmcache.v1."
                          "cache_engine)")
    assert vllm.hint.tp == 3
    assert vllm.stream == "pid 15157"
    # LMCache names the module after the file: its folders say which component spoke
    assert vllm.site == "lmcache/v1/cache_engine.py"
    odd = strip_prefixes("[2025-09-05 14:46:37,864] LMCache INFO: x (engine.py:1:other.name)")
    assert odd.site == "engine.py"  # a module that is not the file's keeps the file
    assert vllm.rest.startswith("Stored 100")
    glog = strip_prefixes("E0905 14:46:37.882738 15817 master_client.cpp:297] Failed to end "
                          "put operation: invalid rpc arg")
    assert glog.site == "master_client.cpp"
    assert glog.error
    torch = strip_prefixes("[rank1]:[E ProcessGroupNCCL.cpp:563] [Rank 1] Watchdog caught")
    assert torch.hint.rank == 1
    sgl = strip_prefixes("[2026-05-26 15:19:18 PP1 ATTN_CP5 TP5] Scheduler hit an exception: x")
    assert (sgl.hint.tp, sgl.hint.pp, sgl.style) == (5, 1, "sglang")


def test_interleaved_vllm_workers_never_mix_their_tracebacks() -> None:
    lines = [
        "(VllmWorkerProcess pid=11) ERROR 04-16 20:47:15 [w.py:238] Traceback (most recent call "
        "last):",
        "(VllmWorkerProcess pid=22) ERROR 04-16 20:47:15 [w.py:238] Traceback (most recent call "
        "last):",
        '(VllmWorkerProcess pid=11) ERROR 04-16 20:47:15 [w.py:238]   File "a.py", line 1, in f',
        '(VllmWorkerProcess pid=22) ERROR 04-16 20:47:15 [w.py:238]   File "b.py", line 2, in g',
        "(VllmWorkerProcess pid=11) ERROR 04-16 20:47:15 [w.py:238] KeyError: 1",
        "(VllmWorkerProcess pid=22) ERROR 04-16 20:47:15 [w.py:238] ValueError: 2",
    ]
    ev = _read("x.log", "\n".join(lines).encode())
    got = {(e.type, e.frames[0].func) for e in _excs(ev)}
    assert got == {("KeyError", "f"), ("ValueError", "g")}


def test_nccl_desync_report_and_watchdog_lines_are_read() -> None:
    ev = _read("x.log", _case("pytorch-152623-desync-report-split-collectives"))
    hits = {pid for r in ev.all_ranks() for pid in r.hits}
    assert {"nccl-watchdog-timeout", "nccl-desync-lagging", "nccl-desync-state"} <= hits


# --- pages ---------------------------------------------------------------------------------

def test_markdown_and_crlf_wrapping_is_undone() -> None:
    assert clean_line("```text\r") == ""
    assert clean_line("> [rank0]: KeyError: 3\r") == "[rank0]: KeyError: 3"
    assert clean_line("<details><summary>log</summary>") == ""
    assert clean_line("  |   | 2026-06-12 12:13:18.902 | scheduler.run() |  ") == "scheduler.run()"
    assert clean_line("-- | -- | --") == ""
    assert clean_line('    File "a.py", line 1, in <module>') == \
        '    File "a.py", line 1, in <module>'


def test_html_page_text_streams_across_chunk_boundaries(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import doctor.read.text.pages as pages

    monkeypatch.setattr(pages, "CHUNK", 7)  # every tag and entity split somewhere
    page = ("<html><script>var x = '<b>';</script><pre>Traceback (most recent call last):\n"
            "  File &quot;a.py&quot;, line 3, in &lt;module&gt;<br>KeyError: &#39;k&#39;"
            "</pre></html>")
    assert looks_like_html(page.encode())
    text = HtmlText(io.BytesIO(page.encode())).read().decode()  # type: ignore[union-attr]
    assert 'File "a.py", line 3, in <module>' in text
    assert "KeyError: 'k'" in text
    assert "var x" not in text


def test_a_log_that_mentions_a_tag_is_not_html() -> None:
    assert not looks_like_html(b"[2026-01-01 00:00:00 TP0] got <Req rid=1> from tokenizer\n")


# --- KV storage layers ---------------------------------------------------------------------

def test_kv_layers_tell_store_pool_and_disaggregation_apart() -> None:
    from doctor.read.text.kvstore import KvContext, classify

    ctx = KvContext()
    assert classify("[2026-09-15 06:24:51,595] LMCache WARNING: Store task 1 to adapter 0 "
                    "failed for keys: ....", ctx) == "store-failure"
    assert classify("[2025-11-18 09:45:28,885] LMCache WARNING: Local cpu memory under pressure "
                    "so choosing to not store the KV cache. (cache_engine.py:265:lmcache.v1."
                    "cache_engine)", ctx) == "pool-pressure"
    assert classify("E0328 09:06:16.412825 114360 client_service.cpp:1126] Transfer failed for "
                    "key k: TRANSFER_FAIL (Transfer 0 failed)", ctx) == "store-failure"
    assert classify("[2025-09-17 16:23:13 TP1] Decode transfer failed for request rank=1 with "
                    "exception KVTransferError(bootstrap_room=1): Failed due to an unknown "
                    "reason from another rank", ctx) == "pd-failure"
    # a transfer engine both use: attributed later, from the whole input's context
    assert classify("E1120 11:10:27.133715 203020 transfer_task.cpp:305] Failed to complete "
                    "transfers after 60 seconds for batch 2586731328", ctx) == "transfer-failure"
    assert classify("[2026-01-01 00:00:00 TP0] Decode batch. #running-req: 3", ctx) is None
    assert classify("[2025-09-05 14:46:37,864] LMCache INFO: Stored 100 out of total 100 tokens "
                    "(0 failed)", ctx) is None
    assert ctx.store
    assert ctx.pd


def test_an_offloading_tier_at_work_is_a_store_whatever_its_name() -> None:
    from doctor.read.text.kvstore import KvContext, classify

    ctx = KvContext()
    # what an offloading tier does shows a store in use, though it names no system
    assert classify("(Worker_TP3 pid=1083631) INFO 05-30 21:34:20 [kv_transfer.py:297] Storing "
                    "KV cache for 1 out of 1 blocks (missing_count=1) for request cmpl-1 in "
                    "group 0", ctx) is None
    assert ctx.store
    assert not ctx.pd
    assert classify("batchput failed,err code -800", KvContext()) == "store-failure"


_TCP = ("E20260530 21:34:20.632956 1121220 tcp_transport.cpp:175] Session::writeBody failed. "
        "Attempt to write data 0x401e37218000 using buffer 0x401e37218000. Error: Bad address "
        "(value: 14), total_transferred_bytes_: 0, current transferred_bytes: 0\n")


def test_a_transfer_engine_under_an_unnamed_store_is_the_store_s(tmp_path: Path) -> None:
    """Mooncake's transfer engine serves Mooncake Store and disaggregation alike: beside a KV
    store at work that names no system it is read as that store's I/O, weaker than where the
    store is named; beside disaggregation, or alone, it is not a storage failure."""
    from doctor.diagnose import diagnose

    def top(text: str) -> tuple[str | None, float]:
        f = tmp_path / "x.log"
        f.write_text(text)
        d = diagnose([str(f)])
        return (d.verdicts[0].signature, d.verdicts[0].confidence) if d.verdicts \
            else (None, 0.0)

    storing = ("(Worker_TP3 pid=1083631) INFO 05-30 21:34:20 [kv_transfer.py:297] Storing KV "
               "cache for 1 out of 1 blocks (missing_count=1) for request cmpl-1 in group 0\n")
    assert top(storing + _TCP * 3)[0] == "storage-backend-failure"
    assert top(_TCP * 3)[0] is None  # whose transfer, nothing says
    assert top("[2026-01-01 00:00:00 TP0] Prefill bootstrap_room=5 disaggregation transfer\n"
               + storing + _TCP * 3)[0] is None
