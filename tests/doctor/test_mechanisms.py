# ruff: noqa: E501 -- tracebacks are quoted as Python prints them, one frame per line
"""Mechanisms read through the upstream index: a component and a kind of failure, from lines
matched to upstream's own templates, from frames, and from what else the input shows.

The lines below are shaped as the upstream code that prints them builds them (each names the
release and file it comes from); the tests change their wording, paths and context the way
other deployments and releases do, and check what the doctor concludes and how sure it is.
"""

from __future__ import annotations

import io

from doctor.diagnose import diagnose
from doctor.report.model import Diagnosis
from signatures.index import load_index


def _diag(text: str, name: str = "report.log") -> Diagnosis:
    return diagnose(streams=[(name, io.BytesIO(text.encode()))])


def _top(d: Diagnosis) -> tuple[str, float]:
    return (d.verdicts[0].signature, d.verdicts[0].confidence) if d.verdicts else ("none", 0.0)


# Mooncake 3b5a59413 mooncake-store/src/client_service.cpp Client::Get / Client::ConnectToMaster
STORE = """\
I1201 10:00:00.100000 4242 client_service.cpp:120] Mooncake store client started
E1201 10:00:05.000000 4242 client_service.cpp:666] Failed to connect to master
E1201 10:00:05.100000 4242 client_service.cpp:901] transfer_read_failed key=abc123 error=RPC_FAIL
"""


def test_a_storage_tier_failing_in_its_own_words_is_named_with_the_upstream_citation() -> None:
    d = _diag(STORE)
    assert _top(d)[0] == "storage-backend-failure"
    cited = " ".join(e.text for e in d.verdicts[0].evidence)
    assert "printed by mooncake" in cited
    assert "client_service.cpp" in cited


def test_a_changed_word_still_reads_as_the_mechanism() -> None:
    # one word of the upstream message changed (another release, a patched build)
    text = STORE.replace("Failed to connect to master", "Failed to reach to master").replace(
        "transfer_read_failed key=abc123 error=RPC_FAIL", "")
    assert _top(_diag(text))[0] == "storage-backend-failure"


def test_a_single_line_is_never_certain_and_the_report_asks_for_more() -> None:
    d = _diag("E1201 10:00:05.000000 4242 client_service.cpp:666] Failed to connect to master\n")
    sig, conf = _top(d)
    assert sig == "storage-backend-failure"
    assert conf < 0.8
    assert any("one failure line" in m.what for m in d.missing)


# an LMCache traceback cut before its exception line (the host buffer running full, as the
# thread established): frames in storage code say where, not what
CUT = """\
Traceback (most recent call last):
  File "/usr/local/lib/python3.12/dist-packages/lmcache/v1/cache_engine.py", line 512, in store
    self.storage_manager.batched_put(keys, objs)
  File "/usr/local/lib/python3.12/dist-packages/lmcache/v1/storage_backend/storage_manager.py", line 340, in batched_put
    backend.batched_submit_put_task(keys, objs)
  File "/usr/local/lib/python3.12/dist-packages/lmcache/v1/storage_backend/local_cpu_backend.py", line 201, in batched_submit_put_task
"""


def test_a_traceback_cut_before_its_exception_line_is_partial_evidence() -> None:
    d = _diag(CUT)
    if d.verdicts:
        assert d.verdicts[0].confidence < 0.8
    assert any("exception line of the traceback" in m.what for m in d.missing)


# sglang 0.5.5 srt/mem_cache/hiradix_cache.py HiRadixCache.load_back (an assert with a message)
LOAD_BACK = """\
[2026-06-01 10:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2841, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1015, in event_loop_overlap
    self.process_input_requests(recv_reqs)
  File "/sgl-workspace/sglang/python/sglang/srt/mem_cache/{module}", line 431, in load_back
    assert len(nodes_to_load) > 0, "No backup available on evicted nodes, should not happen"
AssertionError: No backup available on evicted nodes, should not happen
"""


def test_bookkeeping_assertions_are_named_wherever_the_module_moved() -> None:
    for module in ("hiradix_cache.py", "unified_cache/unified_tree_core.py",
                   "radix/hierarchical.py"):
        d = _diag(LOAD_BACK.format(module=module))
        assert _top(d)[0] == "tree-invariant-violation", module


def test_an_assertion_while_the_server_starts_is_a_start_up_check_not_a_broken_invariant() -> None:
    text = """\
[2026-06-01 10:00:00 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2656, in run_scheduler_process
    scheduler = Scheduler(
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 430, in __init__
    self.init_cache_with_memory_pool()
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 771, in init_cache_with_memory_pool
    self.tree_cache = MambaRadixCache(params)
  File "/sgl-workspace/sglang/python/sglang/srt/mem_cache/mamba_radix_cache.py", line 324, in __init__
    assert isinstance(params.token_to_kv_pool_allocator, TokenToKVPoolAllocator)
AssertionError
"""
    assert _top(_diag(text))[0] != "tree-invariant-violation"


def test_an_assertion_in_a_function_that_works_out_a_spec_is_a_configuration_check() -> None:
    # vLLM v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size, the stack cut above it (the
    # phase cannot be read from it): the layers' page sizes, not state built while serving
    text = """\
  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", line 1740, in get_kv_cache_groups
    filtered_spec = unify_kv_cache_spec_page_size(filtered_spec)
  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", line 1096, in unify_kv_cache_spec_page_size
    assert new_spec.page_size_bytes == max_page_size
AssertionError
Process EngineCore:
Traceback (most recent call last):
"""
    d = _diag(text)
    assert _top(d)[0] == "none"
    assert "start-up" in d.summary
    # the same assertion in a function that keeps the block pool's books still counts
    kept = text.replace("unify_kv_cache_spec_page_size", "free_blocks")
    assert _top(_diag(kept))[0] == "tree-invariant-violation"


def test_the_banner_of_the_next_dying_process_is_not_part_of_a_message() -> None:
    text = """\
Traceback (most recent call last):
  File "/opt/app/worker.py", line 10, in step
    raise RuntimeError("step failed")
RuntimeError: step failed
Process EngineCore_DP0:
Traceback (most recent call last):
"""
    d = _diag(text)
    assert d.fingerprint is not None
    assert d.fingerprint.exception is not None
    assert "step failed" in d.fingerprint.exception
    assert "EngineCore" not in d.fingerprint.exception


def test_a_store_s_own_module_at_work_on_healthy_lines_shows_a_kv_cache_in_use() -> None:
    # Vineyard src/client/io.cc connect_rpc_socket_retry (std::clog): a general-purpose object
    # store's client; AIBrix's vLLM logs its KV cache on Vineyard from vineyard_llm_cache.py
    fail = ("[info] Connection to RPC socket failed for endpoint kvcache-rpc:9600 with ret = "
            "IOError: getaddrinfo() failed for endpoint kvcache-rpc:9600, retrying 9 more "
            "times.\n")
    assert _top(_diag(fail * 3))[0] == "none"  # a store serving anything
    kv = ("INFO 02-17 17:03:44 vineyard_llm_cache.py:306] VineyardLLMCache from_envs None\n"
          + fail * 3)
    sig, conf = _top(_diag(kv))
    assert sig == "storage-backend-failure"
    assert conf < 0.8  # one kind of evidence: lines in its own words


def test_a_transfer_engine_failure_is_whoever_the_input_shows_it_working_for() -> None:
    # mooncake-transfer-engine/src/transport/rdma_transport/rdma_endpoint.cpp
    # RdmaEndPoint::submitPostSend: the engine under a store and under disaggregation alike
    line = ("E1201 10:00:05.000000 4242 rdma_endpoint.cpp:990] Failed to post send on "
            "endpoint 10.0.0.2:15002, error code is -1\n")
    index = load_index()
    assert index.component("rdma_endpoint.cpp").role == "transfer"
    assert _top(_diag(line))[0] == "none"  # nothing says for whom
    store = "[2026-06-01 10:00:00 TP0] Mooncake store setup: segment mounted\n" + line
    assert _top(_diag(store))[0] == "storage-backend-failure"
    pd = ("[2026-06-01 10:00:00 TP0] Prefill bootstrap_room=42 sent to decode\n" + line
          + "[2026-06-01 10:00:06 TP0] KVTransferError(bootstrap_room=42): Failed to send kv "
          "chunk of 42 to 10.0.0.2:8000\n")
    assert _top(_diag(pd))[0] == "none"


def test_a_file_system_failure_counts_only_where_a_kv_cache_uses_it() -> None:
    # 3FS src/storage/worker/CheckWorker.cc CheckWorker::loop: a storage target's disk failed
    line = ("E1201 10:00:05.000000 4242 CheckWorker.cc:173] check disk failed "
            "/storage/data3, readonly\n")
    index = load_index()
    assert index.component("CheckWorker.cc").id == "storage.3fs"
    assert _top(_diag(line))[0] == "none"  # a file system serving anything
    kv = ("[2026-06-01 10:00:00 TP0] HiCache storage backend hf3fs attached for the KV cache\n"
          + line)
    assert _top(_diag(kv))[0] == "storage-backend-failure"


def test_a_template_absent_from_the_stated_release_weighs_less() -> None:
    index = load_index()
    text = "No backup available on evicted nodes, should not happen"
    (m,) = index.match(text, limit=1)
    assert "0.5.5" in m.template.versions
    assert "0.5.23" not in m.template.versions
    body = LOAD_BACK.format(module="hiradix_cache.py")
    own = _diag("sglang==0.5.5\n" + body)
    other = _diag("sglang==0.5.23\n" + body)
    cited = " ".join(e.text for e in other.verdicts[0].evidence)
    assert "not in sglang 0.5.23" in cited
    assert "not in sglang" not in " ".join(e.text for e in own.verdicts[0].evidence)
    assert own.verdicts[0].confidence >= other.verdicts[0].confidence


def test_a_logged_message_that_goes_on_over_bare_lines_is_read_whole() -> None:
    # LMCache 0.3.x lmcache/v1/memory_management.py MemoryObjMetadata.unpin: one warning of
    # three sentences, each on its own line; only the first carries the logger's prefix
    text = """\
[2026-01-05 10:00:00,001] LMCache WARNING: Pin count of MemoryObj 301989888 is negative: -1.
Double unpin occurred somewhere.
Setting pin count back to 0 as a hack but please find the bug.
"""
    d = _diag(text)
    assert _top(d)[0] == "tree-invariant-violation"
    cited = " ".join(e.text for e in d.verdicts[0].evidence)
    assert "memory_management.py" in cited
    # a flush-left line that states a failure of its own is a message of its own: the
    # warning's first line alone is too little of the template to read as it
    split = _diag(text.replace("Double unpin occurred somewhere.", "ERROR: disk is gone"))
    assert _top(split)[0] == "none"
    assert any(o.startswith("Error lines in the inputs: ERROR: disk is gone")
               for o in split.observations)


def test_a_logger_s_site_outweighs_a_template_of_another_file_that_fits_mid_line() -> None:
    # vLLM's Mooncake store connector (mooncake_backend.py) logs a failed batch get; vLLM's
    # "Error checking key existence: {}" (distributed/utils.py) fits words inside the line and
    # must not take it for a collective's helper
    text = ("(EngineCore pid=27737) ERROR 07-23 11:54:45 [mooncake_backend.py:240] Failed to get "
            "6722 keys out of 6722. error_codes=[-707]. Check key existence and memory state.\n")
    d = _diag(text)
    assert _top(d)[0] == "storage-backend-failure"


# TensorFlow r2.x tensorflow/core/distributed_runtime/collective_rma_distributed.cc
# CollectiveRemoteAccessDistributed::RecvFromPeer: a peer of a ring gather sent another byte
# count than this member's tensor holds; the C++ logger puts its level letter after the time
RING_GATHER = """\
2026-05-17 14:23:01.822779: E tensorflow/core/common_runtime/ring_alg.cc:279] Aborting RingGather with Internal: RecvBufResponse returned 48 bytes where to_tensor expected 56
2026-05-17 14:23:01.822834: W tensorflow/core/common_runtime/base_collective_executor.cc:216] BaseCollectiveExecutor::StartAbort Internal: RecvBufResponse returned 48 bytes where to_tensor expected 56
"""


def test_a_collective_that_received_another_size_than_it_expected_is_a_shape_mismatch() -> None:
    d = _diag(RING_GATHER)
    sig, conf = _top(d)
    assert sig == "collective-shape-mismatch"
    assert conf < 0.8  # one member's word for it, not every rank's sizes
    # the same line at INFO level is no failure
    assert _top(_diag(RING_GATHER.replace(": E ", ": I ").replace(": W ", ": I ")))[0] == "none"


def test_an_assertion_that_states_an_unsupported_configuration_is_not_a_broken_invariant() -> None:
    # vLLM 0.33 vllm/v1/core/kv_cache_coordinator.py find_longest_cache_hit
    text = """\
File "vllm/v1/core/kv_cache_manager.py", line 261, in get_computed_blocks
  self.coordinator.find_longest_cache_hit(
File "vllm/v1/core/kv_cache_coordinator.py", line 771, in find_longest_cache_hit
  assert alignment_tokens % kv_cache_spec.block_size == 0, (
AssertionError: SlidingWindowManager does not support fine-grained (partial) cache hits
"""
    assert _top(_diag(text))[0] == "none"
    # the same check stated as a broken invariant is named
    assert _top(_diag(text.replace("does not support", "lost")))[0] == "tree-invariant-violation"


def test_an_exception_is_read_through_the_template_that_raises_its_type() -> None:
    # vLLM 0.33 vllm/v1/core/kv_cache_utils.py FreeKVCacheBlockQueue: the same message is an
    # assert in one method and a RuntimeError in another; an AssertionError is the assert's
    text = "AssertionError: prev_free_block of fake_free_list_tail should always exist\n"
    assert _top(_diag(text))[0] == "tree-invariant-violation"


def test_lmcache_s_module_path_says_whose_line_it_is() -> None:
    # LMCache ends a record with (file.py:line:module); lmcache/v1/transfer_channel moves KV
    # between serving instances, so its errors are disaggregation's, not the cache tier's
    line = ("[2026-03-10 14:11:32,896] LMCache ERROR: Failed to process initialization loop: "
            "Context was terminated (base_channel.py:165:lmcache.v1.transfer_channel.base_channel)"
            "\n")
    d = _diag(line * 4)
    assert _top(d)[0] == "none"
    assert any(lk.id == "pd-transfer" for lk in d.lookalikes)


def test_a_store_that_names_itself_in_its_logger_tag_is_a_storage_tier() -> None:
    # Unified Cache Management (ModelEngine-Group/unified-cache-management) ucm/store/nfsstore:
    # its spdlog lines carry the store's name as the logger tag
    failed = ("[2026-09-02 15:32:52.705301 +08:00] [UCMNFSSTORE] [E] Failed to commit kv cache "
              "block space, block id: 1659016503, error code: -50005. [36116,36116] "
              "[ucmnfsstore.cc:95,Commit]\n")
    assert _top(_diag(failed * 3))[0] == "storage-backend-failure"
    full = ("[2026-09-02 16:47:06.238364 +08:00] [UCMNFSSTORE] [W] Reservation exhausted, try to "
            "alloc OS memory(262144). [380106,381690] [ibuffered_device.cc:47,GetBuffer]\n")
    assert _top(_diag(full * 3))[0] == "host-pool-exhausted"


def _coll(host_pid: str, dev: int, op: str, seq: int, count: int, dtype: int,
          comm: str = "0x7f0000001000") -> str:
    # NCCL src/enqueue.cc, INFO(NCCL_COLL, ...) of each call (NCCL_DEBUG_SUBSYS=COLL)
    return (f"{host_pid}:{host_pid.rsplit(':', 1)[-1]} [{dev}] NCCL INFO {op}: opCount {seq:x} "
            f"sendbuff 0x7f88e4000000 recvbuff 0x7f88e4000000 count {count} datatype {dtype} "
            f"op 0 root 0 comm {comm} [nranks=2] stream 0x55f20d2f5db0\n")


def test_nccl_s_own_collective_records_line_up_across_ranks() -> None:
    calls = [("AllReduce", 0, 1024), ("AllReduce", 1, 4096)]
    same = "".join(_coll(f"node1:{100 + r}", r, op, seq, n, 7) for op, seq, n in calls
                   for r in (0, 1))
    assert _top(_diag(same))[0] == "none"  # every rank made the same calls
    # rank 1's second all_reduce carries another element count: a shape disagreement
    sized = same.replace("opCount 1 sendbuff 0x7f88e4000000 recvbuff 0x7f88e4000000 count 4096"
                         " datatype 7 op 0 root 0 comm 0x7f0000001000 [nranks=2] stream "
                         "0x55f20d2f5db0\n", "opCount 1 sendbuff 0x7f88e4000000 recvbuff "
                         "0x7f88e4000000 count 2048 datatype 7 op 0 root 0 comm 0x7f0000001000 "
                         "[nranks=2] stream 0x55f20d2f5db0\n", 1)
    assert sized != same
    d = _diag(sized)
    assert _top(d)[0] == "collective-shape-mismatch"
    assert any("size-mismatch" in o and "#1" in o for o in d.observations)
    # at one opCount rank 0 broadcasts int64 and rank 1 floats: different calls
    crossed = _coll("node1:100", 0, "Broadcast", 0, 25503912, 6) + \
        _coll("node1:101", 1, "Broadcast", 0, 53, 4)
    d = _diag(crossed)
    assert any("op-mismatch" in o for o in d.observations)
    # the ranks' own records put them in different calls: the mechanism, named on one kind of
    # evidence (no hang is shown), so never in the certain bands
    sig, conf = _top(d)
    assert sig == "collective-order-deadlock"
    assert 0.5 <= conf <= 0.7
    # a process's second communicator of the same size is a group of its own: its opCount 0
    # is not the first communicator's
    two = "".join(_coll(f"node1:{100 + r}", r, "AllReduce", 0, 8, 7) for r in (0, 1)) + \
        "".join(_coll(f"node1:{100 + r}", r, "Broadcast", 0, 8, 7, comm="0x7f0000009000")
                for r in (0, 1))
    assert not any("mismatch" in o for o in _diag(two).observations)
