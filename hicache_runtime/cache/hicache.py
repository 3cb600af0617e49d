"""HiCache: the tiered prefix cache of one rank (SGLang's ``HiRadixCache``).

It ties the radix tree to the device pool (L1), the host pool (L2) and the controller's
transfer queues, and applies the policies:

* **write** (L1 -> L2): ``write_through`` backs up new nodes on insert,
  ``write_through_selective`` once a node's hit count reaches the threshold, ``write_back`` only
  when a node is evicted. A backup reserves host pages locally, then the ranks agree on the
  outcome (two-phase, so one rank's allocation failure cannot make ranks diverge); the
  ``skip-empty-sync`` legacy switch restores the classic local decision.
* **load back** (L2 -> L1) at admission: all or nothing, above a threshold and within the
  scheduler's memory quota; evict and retry once, else the request recomputes.
* **eviction**: LRU over unlocked leaves, L1 and L2 separately.
* **completion**: ``check_events`` consumes exactly the agreed number of acks per step.

The policies are parts HiCache builds and owns, each given what it uses: the host space (L2
allocation and eviction), write-backup and load-back (``transfers``), L1 eviction, and the L3
tier when a storage backend is configured (its threads are handed in, built by the rank).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hicache_runtime.cache.eviction import DeviceEviction, WriteBackPath, touch_on_io_done
from hicache_runtime.cache.host_space import HostSpace
from hicache_runtime.cache.interface import CacheParts, PrefixCache, PrefixPlan
from hicache_runtime.cache.state import CacheCounters, InFlight
from hicache_runtime.cache.transfers import LoadBack, WriteBackup
from hicache_runtime.config import CacheConfig, WritePolicy
from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.contracts.profiles import DEFAULT_PROFILE, PROFILES, HitCounting, HostAlloc
from hicache_runtime.dist.protocols import DrainCounts, RankSync
from hicache_runtime.kv.host_pins import HostPins
from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
from hicache_runtime.kv.transfer_queues import CacheController
from hicache_runtime.l3.tier import L2Side, L3Tier
from hicache_runtime.telemetry.tracer import Tracer

if TYPE_CHECKING:
    from hicache_runtime.kv.copy_engine import CopyEngine
    from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool
    from hicache_runtime.kv.request import Req
    from hicache_runtime.l3.workers import StorageWorkers


#: Poll interval while draining L3 work at the end of a run.
_DRAIN_POLL_S = 0.002


class HiCache(PrefixCache):
    """Three-tier prefix cache for one rank. ``host`` and ``engine`` are ``None`` for an
    L1-only radix cache; ``storage`` (the L3 threads, not started yet) adds the L3 tier."""

    def __init__(self, cfg: CacheConfig, device: DeviceKVPool, host: HostKVPool | None,
                 engine: CopyEngine | None, sync: RankSync, tracer: Tracer,
                 tree: RadixTree, legacy: frozenset[LegacySwitch] = frozenset(),
                 storage: StorageWorkers | None = None) -> None:
        if (host is None) != (engine is None):
            raise ValueError("the host pool (L2) and the copy engine come together")
        if storage is not None and host is None:
            raise ValueError("an L3 tier needs the host pool (L2)")
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.device = device
        self.host = host
        self.sync = sync
        self.tracer = tracer
        self.tree = tree
        self.legacy = legacy
        self.pins = HostPins(cfg.page_size)
        self.stats = CacheCounters()
        self.in_flight = InFlight()
        self.classic_drain = bool(legacy & {LegacySwitch.LOCAL_ACK_DRAIN,
                                            LegacySwitch.SKIP_EMPTY_SYNC})
        self.controller: CacheController | None = None
        self.space: HostSpace | None = None
        self.backups: WriteBackup | None = None
        self.l3: L3Tier | None = None
        """The L3 tier, when a storage backend is configured."""
        write_back: WriteBackPath | None = None
        if host is not None and engine is not None:
            self.controller = CacheController(device, host, engine, tracer)
            self.space = HostSpace(host, tree, self.pins, sync, tracer, self.stats,
                                   agreed=cfg.host_alloc is HostAlloc.AGREED)
            self.backups = WriteBackup(self.space, self.controller, tree, self.in_flight,
                                       tracer, self.stats, legacy)
            if storage is not None:
                self.l3 = L3Tier(storage.cfg, storage, L2Side(host, tree, self.pins, self.space),
                                 sync, tracer, legacy)
            if cfg.write_policy is WritePolicy.WRITE_BACK:
                write_back = WriteBackPath(self.backups, self.space, self.controller,
                                           self.l3.backup if self.l3 is not None else None)
        self.eviction = DeviceEviction(device, tree, tracer, self.stats, write_back)
        self.loads = (LoadBack(self.controller, device, tree, self.pins, self.eviction.evict,
                               self.in_flight, tracer, self.stats, cfg.load_back_threshold)
                      if self.controller is not None else None)

    # --- prefix ---------------------------------------------------------------------------------

    def prepare_prefix(self, req: Req, mem_quota: int) -> PrefixPlan:
        # At least one token must be computed to get logits, hence fill_ids[:-1].
        key = req.fill_ids[: self.tree.align(req.seq_len - 1)]
        m = self.tree.match(key)
        indices, last = m.device_indices, m.last_device_node
        host_hit = 0
        if m.host_hit_length and self.loads is not None:
            loaded = self.loads.load_back(m.last_host_node, mem_quota)
            if loaded is not None:
                indices, last, host_hit = torch.cat([indices, loaded]), m.last_host_node, \
                    int(loaded.numel())
        storage_hit = min(host_hit, req.storage_pending)  # reset by the scheduler on admit
        self.tracer.emit(Ev.MATCH, rid=req.rid, device=int(m.device_indices.numel()),
                         host=m.host_hit_length, loaded=host_hit, storage=storage_hit,
                         node=last.id)
        last_node = None if last is self.tree.root else last
        return PrefixPlan(indices, last_node, int(m.device_indices.numel()), host_hit,
                          storage_hit)

    def lock(self, node: TreeNode | None) -> None:
        if node is not None:
            self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode | None) -> None:
        if node is not None:
            self.tree.dec_lock_ref(node)

    # --- caching requests ----------------------------------------------------------------------

    def cache_finished_req(self, req: Req) -> None:
        """Insert the request's computed pages, free duplicates and spare slots, unlock."""
        n = self.tree.align(req.kv_len)
        self._insert(req, n, chunk=False)
        self.device.free(req.kv_slots[n:])
        self.unlock(req.last_node)
        req.reset_kv()

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: insert what is computed and move the request onto the tree's
        slots (and lock), so later chunks and other requests share them."""
        n = self.tree.align(req.kv_len)
        if n <= req.prefix_len:
            return
        self._insert(req, n, chunk=True)
        m = self.tree.match(req.fill_ids[:n])
        if m.device_indices.numel() != n:
            raise InvariantViolation(
                f"{req.rid}: re-match after insert found {m.device_indices.numel()} of {n}"
            )
        req.kv_slots = torch.cat([m.device_indices, req.kv_slots[n:]])
        self.unlock(req.last_node)
        self.lock(m.last_device_node)
        req.last_node, req.prefix_len = m.last_device_node, n

    def _insert(self, req: Req, n: int, *, chunk: bool) -> None:
        """Insert ``req``'s first ``n`` tokens (``chunk``: after one chunk of a chunked prefill,
        not its last insert), counting hits as the profile's release does."""
        counting = self.cfg.hit_counting or PROFILES[DEFAULT_PROFILE].policies.hit_counting
        if self.cfg.write_policy is WritePolicy.WRITE_BACK:
            # no release counts hits under write_back (0.5.5 hiradix_cache.py _inc_hit_count
            # L266-270; 0.5.23 unified_tree_core.py _inc_hit_count_and_check L1104-1110), which
            # lfu and slru eviction read
            counted_from = None
        elif counting is HitCounting.SKIP_CHUNKED:
            counted_from = None if chunk else 0
        else:
            counted_from = req.inserted_len
        res = self.tree.insert(req.fill_ids[:n], req.kv_slots[:n], counted_from=counted_from)
        req.inserted_len = max(req.inserted_len, n)
        if res.prefix_len > req.prefix_len:
            self.device.free(req.kv_slots[req.prefix_len : res.prefix_len])
        self.tracer.emit(Ev.INSERT, rid=req.rid, tokens=n, existing=res.prefix_len,
                         revived=len(res.revived), new=res.new_node.id if res.new_node else None)
        if self.backups is None:
            return
        policy = self.cfg.write_policy
        if policy is WritePolicy.WRITE_BACK:
            return
        # Root-down order keeps host residency contiguous; matched nodes whose earlier backup
        # failed (L2 was full) get another chance.
        for node in [*res.matched, *([res.new_node] if res.new_node else [])]:
            if node.host_value is not None:
                continue
            if (policy is WritePolicy.WRITE_THROUGH
                    or node.hit_count >= self.cfg.write_through_threshold):
                self.backups.write_backup(node)

    def start_loading(self) -> int | None:
        return self.controller.start_loading() if self.controller is not None else None

    def evict(self, num_tokens: int) -> int:
        return self.eviction.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L2 (LRU); 0 without L2."""
        return self.space.evict_host(num_tokens) if self.space is not None else 0

    @property
    def evictable_tokens(self) -> int:
        return self.tree.evictable_size

    # --- completions ----------------------------------------------------------------------------

    def local_drain_counts(self) -> DrainCounts:
        """This rank's ready counts (launching queued writes first), to be agreed on. Storage
        queues are left out when they are drained stage-locally (legacy paths)."""
        if self.controller is None:
            return DrainCounts()
        self.controller.start_writing()
        l3 = self.l3.local_counts() if self.l3 is not None and not self._stage_local_l3 else {}
        return DrainCounts(
            write_acks=self.controller.ready_count(self.controller.ack_write_queue),
            load_acks=self.controller.ready_count(self.controller.ack_load_queue), **l3)

    @property
    def _stage_local_l3(self) -> bool:
        # pre-#27010, storage queues were drained by a per-stage TP MIN, never chained
        return self.classic_drain or LegacySwitch.LOCAL_PREFETCH_PROGRESS in self.legacy

    def check_events(self, agreed: DrainCounts | None = None) -> None:
        """Consume completed transfers: exactly the agreed count of each (see ``sync``).
        ``agreed`` comes from the step's merged agreement when the caller already has it."""
        if self.controller is None:
            return
        if self.classic_drain:
            self.controller.start_writing()
            self._classic_writing_check()
            self._classic_loading_check()
        else:
            if agreed is None:
                agreed = self.sync.drain_counts(self.local_drain_counts())
            else:
                self.controller.start_writing()
            self._writing_check(agreed.write_acks)
            self._loading_check(agreed.load_acks)
        if self.l3 is not None:
            if self._stage_local_l3:  # classic drain_storage_control_queues
                agreed = DrainCounts(**{k: self.sync.legacy_tp_min(v, f"drain_{k}")
                                        for k, v in self.l3.local_counts().items()})
            assert agreed is not None
            self.l3.drain(agreed)

    def _classic_writing_check(self) -> None:
        """Pre-#26923 ``writing_check``: skipped entirely when this rank has nothing in flight
        (``skip-empty-sync``). The count is a per-stage TP MIN of the local ready count
        (``local-ack-drain``, 0.5.5) or PP0's TP MIN chained down the pipeline (0.5.13)."""
        assert self.controller is not None
        if LegacySwitch.SKIP_EMPTY_SYNC in self.legacy and not self.in_flight.ongoing_write_through:
            # upstream: "all ranks has the same ongoing_write_through, can skip sync if empty"
            return
        ready = self.controller.ready_count(self.controller.ack_write_queue)
        if LegacySwitch.LOCAL_ACK_DRAIN in self.legacy:
            self._writing_check(self.sync.legacy_tp_min(ready, "writing_check"))
        else:
            self._writing_check(self.sync.legacy_chained(ready, "writing_check"))

    def _classic_loading_check(self) -> None:
        """Classic ``loading_check``: the local ready count (``local-ack-drain``, 0.5.5: "no
        need to sync across TP workers"), or PP0's TP MIN chained down the pipeline (0.5.13),
        in an exchange of its own that is never skipped."""
        assert self.controller is not None
        ready = self.controller.ready_count(self.controller.ack_load_queue)
        if LegacySwitch.LOCAL_ACK_DRAIN in self.legacy:
            self._loading_check(ready)
        else:
            self._loading_check(self.sync.legacy_chained(ready, "loading_check"))

    def _writing_check(self, count: int) -> None:
        assert self.controller is not None
        assert self.space is not None
        for _ in range(count):
            ack = self.controller.pop_ack(self.controller.ack_write_queue)
            for node_id in ack.node_ids:
                node = self.in_flight.ongoing_write_through.pop(node_id)
                fragments = self._fragments(node, self.in_flight.write_tokens.pop(node_id))
                self.tree.dec_lock_ref(node)
                touch_on_io_done(node, ack, self.legacy)
                for fragment in fragments:  # every fragment, top-down (as upstream)
                    self.on_backed_up(fragment)
            self.tracer.emit(Ev.WRITE_ACK, nodes=ack.node_ids, tokens=ack.tokens)
        if count:
            self.tracer.emit(Ev.WRITE_DRAIN, count=count,
                             left=len(self.controller.ack_write_queue))

    def _loading_check(self, count: int) -> None:
        assert self.controller is not None
        for _ in range(count):
            ack = self.controller.pop_ack(self.controller.ack_load_queue)
            for node_id in ack.node_ids:
                node = self.in_flight.ongoing_load_back.pop(node_id)
                self.tree.dec_lock_ref(node)
                touch_on_io_done(node, ack, self.legacy)
            self.tracer.emit(Ev.LOAD_ACK, nodes=ack.node_ids, tokens=ack.tokens)
        if count:
            self.tracer.emit(Ev.LOAD_DRAIN, count=count, left=len(self.controller.ack_load_queue))

    def _fragments(self, node: TreeNode, tokens: int) -> list[TreeNode]:
        """The nodes a write of ``tokens`` tokens that ended at ``node`` now covers, top-down.
        A split keeps the original node as the lower part and puts a new node above it, and
        the write's lock keeps every part in the tree, so the parts are ``node`` and the
        ancestors right above it, until their lengths add up to the write."""
        out, covered, x = [node], len(node.key), node
        while covered < tokens and x.parent is not None and x.parent is not self.tree.root:
            x = x.parent
            out.append(x)
            covered += len(x.key)
        if covered != tokens:
            raise InvariantViolation(f"write of {tokens} tokens ending at node {node.id} "
                                     f"does not end on a node boundary ({covered})")
        return out[::-1]

    def on_backed_up(self, node: TreeNode) -> None:
        """A node's L2 copy is complete: chain its L3 backup."""
        if self.l3 is not None:
            self.l3.backup(node)

    # --- L3 hooks -------------------------------------------------------------------------------

    def on_enqueue(self, req: Req) -> None:
        if self.l3 is not None:
            self.l3.prefetch(req)

    def prefetch_ready(self, req: Req) -> bool:
        return self.l3.check_progress(req) if self.l3 is not None else True

    def on_abort(self, req: Req) -> None:
        if self.l3 is not None:
            self.l3.release_aborted(req)

    def on_admit(self, req: Req) -> None:
        if self.l3 is not None:
            self.l3.release_hold(req.rid)

    def idle(self) -> bool:
        if self.controller is None:
            return True
        return not (self.in_flight.ongoing_write_through or self.in_flight.ongoing_load_back
                    or self.controller.write_queue or self.controller.load_queue
                    or (self.l3 is not None and not self.l3.idle()))

    def stop_stepping(self) -> None:
        if self.controller is not None:  # no step comes to pass a dma-lag hold from here on
            self.controller.release_holds()

    def drain(self) -> None:
        """Wait for every transfer and consume it (end of run, single rank)."""
        while not self.idle():
            self.check_events()
            if not self.idle() and self.controller is not None:
                for acks in (self.controller.ack_write_queue, self.controller.ack_load_queue):
                    if acks:
                        acks[0].event.synchronize()
                if self.l3 is not None:
                    time.sleep(_DRAIN_POLL_S)

    # --- integrity and state -------------------------------------------------------------------

    def check_integrity(self, request_owned: int,
                        held: Sequence[TreeNode | None] | None = None) -> None:
        self.tree.check_structure()
        if held is not None:
            self._check_locks(held)
        dev_free, cap = self.device.available_tokens, self.device.capacity_tokens
        ev, prot = self.tree.evictable_size, self.tree.protected_size
        if dev_free + ev + prot + request_owned != cap:
            raise InvariantViolation(
                f"device pool: free {dev_free} + evictable {ev} + protected {prot} + "
                f"requests {request_owned} != capacity {cap}")
        _check_slots(self.tree, "value", self.device.allocator.is_used, self.page_size)
        if self.host is not None:
            host_tree = self.tree.token_counts()["host"]
            free, hcap = self.host.available_tokens, self.host.capacity_tokens
            outside = self.host_held_outside_tree()
            if free + host_tree + outside != hcap:
                raise InvariantViolation(
                    f"host pool: free {free} + tree {host_tree} + in flight {outside} != "
                    f"capacity {hcap}")
            _check_slots(self.tree, "host_value", self.host.allocator.is_used, self.page_size)
            if held is not None:  # between steps: no transient load-back pins
                self.pins.check(self.l3.pin_holders() if self.l3 is not None else [])
        if self.l3 is not None:
            self.l3.check_accounting()

    def _check_locks(self, held: Sequence[TreeNode | None]) -> None:
        """Every lock is accounted for: requests' prefixes and in-flight transfers."""
        expected: dict[int, int] = defaultdict(int)
        for node in [*held, *self.in_flight.holders()]:
            if node is not None:
                for n in self.tree.path_to_root(node):
                    expected[n.id] += 1
        for n in self.tree.nodes():
            if n.lock_ref != expected[n.id]:
                raise InvariantViolation(
                    f"node {n.id} has lock_ref {n.lock_ref} but {expected[n.id]} holder(s)")

    def host_held_outside_tree(self) -> int:
        """Host tokens allocated but not (yet) in the tree (L3 prefetches in flight)."""
        return self.l3.held_tokens() if self.l3 is not None else 0

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {
            "kind": "hicache", "tree": self.tree.summary(),
            "device": {"free": self.device.available_tokens,
                       "capacity": self.device.capacity_tokens,
                       "evictable": self.tree.evictable_size,
                       "protected": self.tree.protected_size},
            "ongoing_write_through": sorted(self.in_flight.ongoing_write_through),
            "ongoing_load_back": sorted(self.in_flight.ongoing_load_back),
            "stats": self.stats.as_dict(),
        }
        if self.host is not None:
            snap["host"] = {"free": self.host.available_tokens,
                            "capacity": self.host.capacity_tokens}
        if self.controller is not None:
            snap["queues"] = self.controller.in_flight()
        snap["host_pinned_pages"] = self.pins.pinned_pages
        if self.l3 is not None:
            snap["l3"] = self.l3.snapshot()
        return snap

    def parts(self) -> CacheParts:
        return CacheParts(self.device, self.tree, self.host, self.pins, self.l3)

    def counters(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def shutdown(self) -> None:
        if self.l3 is not None:
            self.l3.shutdown()
        if self.controller is not None:
            self.controller.shutdown()


def _check_slots(tree: RadixTree, attr: str, is_used: Any, page_size: int) -> None:
    seen: set[int] = set()
    for node in tree.nodes():
        slots = getattr(node, attr)
        if slots is None:
            continue
        for page in (slots[::page_size] // page_size).tolist():
            if page in seen:
                raise InvariantViolation(f"{attr} page {page} held by two nodes (node {node.id})")
            if not is_used(page):
                raise InvariantViolation(f"{attr} page {page} of node {node.id} is free in pool")
            seen.add(page)
