"""Wiring of one rank: builds the tracer, injector, model, pools, cache and scheduler.

Everything a rank owns hangs off one :class:`RankRuntime`; there is no module-level state, so
several ranks (or a run and its cache-disabled reference) can live in one process in tests.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from faults.injector import FaultInjector
from faults.kinds import KINDS
from faults.points import FaultPoint
from faults.rendezvous import PrefetchIORendezvous, needs_prefetch_rendezvous
from hicache_runtime.cache.hicache import HiCache
from hicache_runtime.cache.interface import NoPrefixCache, PrefixCache
from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.contracts.profiles import PROFILES
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.dist.protocols import RankSync, SingleRankSync
from hicache_runtime.engine.model import TensorParallelComm, TinyTransformer
from hicache_runtime.engine.scheduler import Scheduler
from hicache_runtime.kv.copy_engine import CopyEngine, CpuCopyEngine, CudaCopyEngine
from hicache_runtime.kv.evict_order import EvictOrder
from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_runtime.kv.radix_tree import RadixTree
from hicache_runtime.l3.formats import StorageFormat, UpstreamPages, mooncake_prefix
from hicache_runtime.l3.keys import model_id
from hicache_runtime.l3.pages import PageCodec, SidecarCodec, max_payload_bytes
from hicache_runtime.l3.registry import make_backend
from hicache_runtime.l3.workers import StorageWorkers
from hicache_runtime.telemetry.tracer import Tracer

_IO_BUDGET_FRACTION = 0.25
"""Share of the protocol timeout one L3 query or backup may take on a rank."""
_RENDEZVOUS_S = 30.0
"""How long a mid-prefetch-abort on rank 0 waits for its peers' IO of the op."""


class AbortInbox:
    """Aborts requested from other threads (a client, or a mid-prefetch-abort fault firing in
    the prefetch IO thread). The scheduler applies them at the top of its next step, in order,
    and sets each waiter's event once applied."""

    def __init__(self) -> None:
        self._q: queue.Queue[tuple[str, threading.Event]] = queue.Queue()

    def request(self, rid: str) -> threading.Event:
        done = threading.Event()
        self._q.put((rid, done))
        return done

    def take(self) -> list[tuple[str, threading.Event]]:
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out


@dataclass
class RankRuntime:
    """Every per-rank object of a run."""

    cfg: RuntimeConfig
    rank: RankInfo
    device: torch.device
    tracer: Tracer
    faults: FaultInjector | None
    sync: RankSync
    model: TinyTransformer
    device_pool: DeviceKVPool
    host_pool: HostKVPool | None
    cache: PrefixCache
    scheduler: Scheduler
    aborts: AbortInbox = field(default_factory=lambda: AbortInbox())

    def close(self) -> None:
        self.cache.shutdown()
        self.sync.close()
        self.tracer.close()


def pick_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def make_tracer(cfg: RuntimeConfig, rank: RankInfo, trace_path: Path | None = None) -> Tracer:
    """This rank's tracer; with several ranks, ``--trace run.jsonl`` becomes
    ``run.rank<N>.jsonl`` per rank."""
    obs = cfg.observability
    path = trace_path or obs.trace_path
    if path is not None and rank.world_size > 1 and trace_path is None:
        path = path.with_name(f"{path.stem}.rank{rank.rank}{path.suffix}")
    return Tracer(rank, ring_size=obs.ring_size, enabled=obs.tracing, jsonl_path=path)


def build_rank(cfg: RuntimeConfig, rank: RankInfo | None = None, *,
               sync: RankSync | None = None, tp: TensorParallelComm | None = None,
               trace_path: Path | None = None, tracer: Tracer | None = None) -> RankRuntime:
    """Build one rank. ``sync``/``tp`` default to the single-rank implementations."""
    rank = rank or RankInfo()
    device = pick_device()
    obs = cfg.observability
    tracer = tracer or make_tracer(cfg, rank, trace_path)
    faults = FaultInjector(cfg.faults, cfg.seed, rank, tracer) if cfg.faults else None
    sync = sync or SingleRankSync(rank, tracer)
    aborts = AbortInbox()
    model = TinyTransformer(cfg.model, rank, device, tp, page_size=cfg.cache.page_size)
    shape = model.kv_shape()
    device_pool = DeviceKVPool(shape, cfg.cache.device_tokens, cfg.cache.page_size, device)
    if obs.tracing:
        def on_layer_wait(layer: int, t0: int, t1: int) -> None:
            tracer.emit(Ev.LAYER_WAIT, layer=layer, t0_ns=t0, dur_ns=t1 - t0)
        device_pool.on_layer_wait = on_layer_wait
    host_pool: HostKVPool | None = None
    storage: StorageWorkers | None = None
    cache: PrefixCache
    if not cfg.cache.enable_prefix_cache:
        cache = NoPrefixCache(device_pool)
    else:
        engine: CopyEngine | None = None
        if cfg.cache.enable_hicache:
            host_pool = _host_pool(cfg, shape, sync, faults, tracer)
            engine = _copy_engine(cfg, device, tracer, faults)
            if cfg.storage.backend != "none":
                storage = _storage_workers(cfg, rank, model, host_pool, sync, tracer, faults,
                                           aborts)
        order = EvictOrder.of(cfg.cache.eviction_policy, cfg.cache.eviction_policy_config)
        tree = RadixTree(cfg.cache.page_size, _lru_clock(cfg), tracer, order)
        # the cache sees its own section only: the profile's host allocation and hit
        # counting go in with it
        cache_cfg = cfg.cache.model_copy(update={
            "host_alloc": cfg.host_alloc, "hit_counting": cfg.policies.hit_counting})
        cache = HiCache(cache_cfg, device_pool, host_pool, engine, sync, tracer, tree,
                        cfg.legacy, storage)
    scheduler = Scheduler(cfg.scheduler, cache, tracer, num_slots=cfg.topology.pp)
    rt = RankRuntime(cfg, rank, device, tracer, faults, sync, model, device_pool, host_pool,
                     cache, scheduler, aborts)
    if storage is not None:  # last: a rank whose build failed leaves no L3 thread behind
        storage.start()
    return rt


def _storage_workers(cfg: RuntimeConfig, rank: RankInfo, model: TinyTransformer,
                     host_pool: HostKVPool, sync: RankSync, tracer: Tracer,
                     faults: FaultInjector | None, aborts: AbortInbox) -> StorageWorkers:
    """The L3 backend and its threads (not started): the cache builds its L3 tier on them."""
    offsets = {"layer_start": model.layers_range.start, "head_start": model.kv_heads.start}
    codec = PageCodec.for_pool(host_pool, **offsets)
    sidecars: dict[str, SidecarCodec] = {name: SidecarCodec.for_pool(host_pool, name, **offsets)
                for name in cfg.model.sidecars}
    name = cfg.storage.model_name or model_id(cfg.model)
    upstream = None if cfg.storage.format is StorageFormat.ENVELOPE else UpstreamPages(
        codec.layout.header(codec.token_major), codec.payload_bytes,
        key_prefix=mooncake_prefix(name, PROFILES[cfg.profile].release),
        rank_part=f"{rank.tp_rank}_{rank.pp_rank}" if rank.pp_size > 1 else f"{rank.tp_rank}")
    # store contents are untrusted: the backend never reads more than this rank's largest page
    backend = make_backend(cfg.storage, rank, model=name,
                           required=cfg.storage.required, faults=faults, tracer=tracer,
                           step=lambda: tracer.step,
                           max_payload_bytes=max_payload_bytes(codec, *sidecars.values()),
                           upstream=upstream)
    assert backend is not None
    # A peer waits in an L3 vote for at most this plus one storage call (see ``l3_ops``).
    budget = cfg.observability.protocol_timeout_s * _IO_BUDGET_FRACTION
    # the L3 tier sees the storage section only: the profile's timeout policy goes in with it
    policies = cfg.policies
    storage_cfg = cfg.storage.model_copy(update={
        "prefetch_timeout_clock": policies.timeout_clock,
        "prefetch_timeout_budget": policies.timeout_budget})
    return StorageWorkers(storage_cfg, backend, codec, host_pool, sync, tracer, rank,
                          cfg.legacy, faults, aborts.request, sidecars, io_budget_s=budget,
                          rendezvous=_prefetch_rendezvous(cfg, rank))


def _prefetch_rendezvous(cfg: RuntimeConfig, rank: RankInfo) -> PrefetchIORendezvous | None:
    """The store-backed rendezvous a mid-prefetch-abort times itself with (every rank of a
    run that arms one builds it: the peers record, rank 0 waits)."""
    if not needs_prefetch_rendezvous(cfg.faults, rank.world_size) or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()  # the store the ranks joined with
    # a peer's IO thread works through its own backlog first (slow storage under load): give
    # it long; it depends on nothing rank 0 does, so the wait ends unless a peer is stuck
    return PrefetchIORendezvous(store, rank, timeout_s=_RENDEZVOUS_S)


def host_tokens_for(cfg: RuntimeConfig, shape: KVShape) -> int:
    """This stage's own host capacity in tokens (before any cross-stage agreement)."""
    c = cfg.cache
    if c.host_tokens is not None:
        tokens = c.host_tokens
    elif c.host_bytes is not None:
        tokens = c.host_bytes // shape.bytes_per_token
    else:
        tokens = int(c.device_tokens * c.host_ratio)
    return max(c.page_size, tokens - tokens % c.page_size)


def _host_pool(cfg: RuntimeConfig, shape: KVShape, sync: RankSync,
               faults: FaultInjector | None, tracer: Tracer) -> HostKVPool:
    tokens = host_tokens_for(cfg, shape)
    if cfg.cache.host_bytes is not None:
        # Stages own different layers, so bytes per token differ: agree on the MIN (#29258).
        legacy = LegacySwitch.LOCAL_HOST_CAPACITY in cfg.legacy
        agreed = tokens if legacy else sync.host_capacity(tokens)
        tracer.emit(Ev.HOST_CAPACITY, local=tokens, agreed=agreed, synced=not legacy,
                    bytes_per_token=shape.bytes_per_token)
        tokens = agreed
    alloc_fault = None
    if faults is not None and faults.armed(FaultPoint.HOST_ALLOC):
        def alloc_fault(n: int) -> bool:
            fired = faults.fire(FaultPoint.HOST_ALLOC, step=tracer.step)
            return any(KINDS[s.kind].fails_alloc(s) for s in fired)
    return HostKVPool(shape, tokens, cfg.cache.page_size, pin=torch.cuda.is_available(),
                      alloc_fault=alloc_fault, layout=cfg.cache.mem_layout)


def _copy_engine(cfg: RuntimeConfig, device: torch.device, tracer: Tracer,
                 faults: FaultInjector | None) -> CopyEngine:
    lag = hold = None
    if faults is not None and faults.armed(FaultPoint.COPY_COMPLETE):
        def lag() -> float:
            fired = faults.fire(FaultPoint.COPY_COMPLETE, step=tracer.step,
                                only=lambda s: s.hold is None)
            return max((KINDS[s.kind].copy_delay_s(s) for s in fired), default=0.0)

        def hold() -> int:  # at submission, on the scheduler thread
            fired = faults.fire(FaultPoint.COPY_COMPLETE, step=tracer.step,
                                only=lambda s: s.hold is not None)
            return max((KINDS[s.kind].copy_hold_steps(s) for s in fired), default=0)
    engine: CopyEngine
    if device.type == "cuda":
        engine = CudaCopyEngine(cfg.cache.page_size, device, tracer, lag)
    else:
        engine = CpuCopyEngine(cfg.cache.page_size, tracer, lag)
    engine.hold = hold
    return engine


def _lru_clock(cfg: RuntimeConfig) -> Callable[[], float] | None:
    """The tree's LRU clock: logical (fixed; ``None``) or the wall clock (``wallclock-lru``)."""
    return time.monotonic if LegacySwitch.WALLCLOCK_LRU in cfg.legacy else None
