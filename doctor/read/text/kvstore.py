"""Lines from the KV cache's storage layers, told apart from their look-alikes.

Real reports about a failing KV cache tier are often a handful of log lines from the storage
layer itself, in words no catalog can list in advance ("Store task 1 to adapter 0 failed",
"CQ error: transport retry counter exceeded", "Request 553: cannot store 1 blocks"). What they
share is the mechanism: *a KV storage component* (LMCache and its backends, Mooncake Store,
InfiniStore, 3FS, NIXL storage plugins, SGLang's HiCache storage, vLLM's offloading connector,
Dynamo's KVBM) reports that storing, retrieving or connecting failed, or that its host memory
pool is full. This module recognises the component of a line, and whether the line says
"failed" or "memory pressure":

* ``store-failure`` — a storage component failed to store, retrieve, connect, read or write;
* ``pool-pressure`` — a KV cache's host (CPU) pool had no room.

The same words from the *transfer* layer of prefill/decode disaggregation (LMCache's PD
backend, NIXL/Mooncake connectors, KVTransferError) are not the cache tier; lines of the
transfer engines that both use (``transfer_task.cpp``, RDMA completion errors) count for the
store only when the input shows a store in use and no disaggregation (:class:`KvContext`).
"""

from __future__ import annotations

import re

from doctor.model.evidence import KvContext, KvLineKind
from signatures.linear import linear

#: Components that are a KV storage tier (on the raw line: prefixes, tags, source sites).
_STORE = re.compile(
    r"LMCache (?:WARNING|WARN|ERROR|CRITICAL)\b|\[infini\] \[(?:warning|error|critical)\]"
    r"|\b(?:store_py|real_client|client_service|master_client|pybind_client|file_storage|"
    r"storage_backend|infinistore|master_service|ha_helper|etcd_helper|rpc_service|"
    r"dummy_client)\.cpp:\d+\]"
    r"|\b(?:offloading_connector|lmcache_connector|remote_backend|local_disk_backend|"
    r"gds_backend|nixl_storage_backend|redis_connector|s3_connector|mooncakestore_connector|"
    r"fs_connector|storage_hf3fs|mooncake_store|mooncake_backend|hicache_storage|hicache_nixl)"
    r"\.py"
    r"|(?i:\bmooncake ?store\b|MooncakeDistributedStore|HiCache(?:File|HF3FS|Nixl|Storage)\b|"
    r"\bhf3fs\b|\binfinistore\b|\bkvbm\b|block_manager|\bGDS_MT\b|\bkv_?offload|"
    r"\bCPUOffloading|\bkv[_ ]?pool\b|\bmooncake_master\b)"
    # a logger tag that names a store ("[UCMNFSSTORE] [E] Failed to commit ...")
    r"|\[[A-Z0-9_]{0,30}STORE\]"
    # what an offloading tier does, whatever its name: LMCache's and vLLM-Ascend's KV pool's
    # "Storing KV cache for 2048 out of 32768 tokens", a store client's batch put
    r"|\bStoring KV cache for \d+ out of \d+|(?i:\bbatch_?put\b)")
#: Components every KV transfer uses, cache tier or disaggregation alike.
_TRANSFER = re.compile(r"\b(?:transfer_task|transfer_engine\w*|rdma_transport|tcp_transport|"
                       r"worker_pool|rdma_endpoint)\.cpp:\d+\]|\bCQ error\b")
#: Disaggregation: the transfer between prefill and decode instances, not a cache tier.
_PD = re.compile(r"(?i)disaggregation|KVTransferError|Nixl_?Connector|P2pNcclConnector|"
                 r"\bMooncakeConnector\b|bootstrap_room|pd_backend|\bPDBackend\b|KVPoll|"
                 r"kv_(?:producer|consumer)\b|\bprefill(?:er)? (?:instance|node|worker)\b|"
                 # LMCache's transfer channels move KV between serving instances (PD, P2P)
                 r"\btransfer_channel\b")
_PRESSURE = re.compile(
    r"(?i)memory (?:is )?under pressure|cannot store \d+ blocks?|no (?:free )?memory (?:is )?"
    r"available|allocat(?:ion|ing) fail(?:ed|ure)|MemoryAllocator\W{1,3}allocat|"
    r"no (?:free )?memory (?:is )?"
    r"available|not enough (?:cpu |host )?memory|failed to allocate (?:memory|buffer|block)|"
    r"allocation failed|insufficient (?:memory|space)|(?:cpu|host|buffer|pool) (?:is )?full|"
    r"NO_AVAILABLE_HANDLE|no space left|out of (?:host|cpu) memory|"
    r"(?:reservation|buffer|pool|memory) (?:is )?exhausted")
_FAILURE = re.compile(
    r"(?i)\bfail(?:ed|s|ure)?\b|\berror\b|\bunable to\b|\bcannot\b|can't|could not|\btimed? ?out"
    r"|\brefused\b|\breset by peer\b|broken pipe|\b0 out of \d+|\b0/\d+ (?:chunks|tokens|keys)"
    r"|less than the expected|\brefusing\b|\bno (?:available|valid)\b"
    r"|\bexceeds?\b.{0,60}\b(?:capacity|limit|buffer)")
_NOT_FAILURE = re.compile(r"(?i)\bsuccess(?:ful(?:ly)?)?\b|\bno error\b")
#: "(0 failed)", "failures: 0": a count of nothing, taken out before looking for failure words
_ZERO_FAILED = re.compile(r"(?i)\(\s*(?:0|zero) failed\s*\)|[,;]\s*(?:0|zero) failed\b|"
                          r"\b(?:0|zero) failures?\b|\bfail(?:ed|ures?)[:=] ?0\b")


#: Substrings (any case) at least one of which every line the regexes above can match holds:
#: a cheap gate so that ordinary log lines never reach the case-insensitive regexes.
GATE = ("lmcache", "infini", ".cpp:", "mooncake", "hicache", "hf3fs", "kvbm", "block_manager",
         "gds_mt", "offload", "kv_pool", "kvpool", "kv pool", "connector", "_backend", "_storage",
         "disaggregation", "kvtransfer", "nixl", "bootstrap", "kvpoll", "cq error", "kv_producer",
         "kv_consumer", "prefill", "pd_backend", "pdbackend", "p2pnccl", "mooncake_master",
         "store]", "transfer_channel", "storing kv cache", "batchput", "batch_put")


#: :data:`GATE` as one pattern (also an entry of the line reader's one-pass gate set).
GATE_PATTERN = "(?i)" + "|".join(re.escape(k) for k in GATE)
_GATE_RE = linear(GATE_PATTERN)


def _gated(raw: str) -> bool:
    # one automaton pass, not a lower-cased copy and a scan per key
    return _GATE_RE.search(raw) is not None


def _note(ctx: KvContext, raw: str) -> None:
    """Remember in ``ctx`` the store components and the disaggregation ``raw`` names."""
    m = _STORE.search(raw)
    if m and len(ctx.store) < 16:
        ctx.store.add(m[0][:40])
    if not ctx.pd and _PD.search(raw):
        ctx.pd = True


def classify(raw: str, ctx: KvContext, gated: bool = False) -> KvLineKind | None:
    """What one raw line (prefixes included) reports, or None. The components it names are
    noted in ``ctx``: the whole input's context decides whose a ``TRANSFER_FAILURE`` is.
    ``gated``: the caller has seen a :data:`GATE` substring in ``raw``."""
    if not gated and not _gated(raw):
        return None
    _note(ctx, raw)
    pd = _PD.search(raw) is not None
    store = not pd and _STORE.search(raw) is not None
    transfer = not store and _TRANSFER.search(raw) is not None
    if not (store or transfer or pd):
        return None
    if store and _PRESSURE.search(raw):
        return KvLineKind.POOL_PRESSURE
    if not _FAILURE.search(_ZERO_FAILED.sub("", raw)) or _NOT_FAILURE.search(raw):
        return None
    if pd:
        return KvLineKind.PD_FAILURE
    return KvLineKind.STORE_FAILURE if store else KvLineKind.TRANSFER_FAILURE
