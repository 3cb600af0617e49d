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
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hicache_runtime.cache import PrefixCache, PrefixPlan
from hicache_runtime.config import CacheConfig, WritePolicy
from hicache_runtime.controller import CacheController
from hicache_runtime.errors import InvariantViolation
from hicache_runtime.host_pins import HostPins
from hicache_runtime.legacy import LegacySwitch
from hicache_runtime.radix_tree import RadixTree, TreeNode
from hicache_runtime.sync import DrainCounts, RankSync
from hicache_runtime.tracing import Ev, Tracer

if TYPE_CHECKING:
    from hicache_runtime.copy_engine import CopyEngine
    from hicache_runtime.l3 import L3Tier
    from hicache_runtime.pools import DeviceKVPool, HostKVPool
    from hicache_runtime.request import Req


#: Poll interval while draining L3 work at the end of a run.
_DRAIN_POLL_S = 0.002


class HiCache(PrefixCache):
    """Three-tier prefix cache for one rank. ``host`` is ``None`` for an L1-only radix cache."""

    def __init__(self, cfg: CacheConfig, device: DeviceKVPool, host: HostKVPool | None,
                 engine: CopyEngine | None, sync: RankSync, tracer: Tracer,
                 tree: RadixTree, legacy: frozenset[LegacySwitch] = frozenset()) -> None:
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.device = device
        self.host = host
        self.sync = sync
        self.tracer = tracer
        self.tree = tree
        self.legacy = legacy
        self.controller = (CacheController(device, host, engine, tracer)
                           if host is not None and engine is not None else None)
        self.pins = HostPins(cfg.page_size)
        self.ongoing_write_through: dict[int, TreeNode] = {}
        self.ongoing_load_back: dict[int, TreeNode] = {}
        self.l3: L3Tier | None = None
        """The L3 tier, attached after construction when a storage backend is configured."""
        self.classic_drain = bool(legacy & {LegacySwitch.LOCAL_ACK_DRAIN,
                                            LegacySwitch.SKIP_EMPTY_SYNC})
        self.stats = {"backup_tokens": 0, "backup_skipped": 0, "load_tokens": 0,
                      "load_skipped": 0, "evicted_device": 0, "evicted_host": 0}

    # --- prefix ---------------------------------------------------------------------------------

    def prepare_prefix(self, req: Req, mem_quota: int) -> PrefixPlan:
        # At least one token must be computed to get logits, hence fill_ids[:-1].
        key = req.fill_ids[: self.tree.align(req.seq_len - 1)]
        m = self.tree.match(key)
        indices, last = m.device_indices, m.last_device_node
        host_hit = 0
        if m.host_hit_length and self.host is not None:
            loaded = self.load_back(m.last_host_node, mem_quota)
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
        self._insert(req, n)
        self.device.free(req.kv_slots[n:])
        self.unlock(req.last_node)
        req.reset_kv()

    def cache_unfinished_req(self, req: Req) -> None:
        """After a prefill chunk: insert what is computed and move the request onto the tree's
        slots (and lock), so later chunks and other requests share them."""
        n = self.tree.align(req.kv_len)
        if n <= req.prefix_len:
            return
        self._insert(req, n)
        m = self.tree.match(req.fill_ids[:n])
        if m.device_indices.numel() != n:
            raise InvariantViolation(
                f"{req.rid}: re-match after insert found {m.device_indices.numel()} of {n}"
            )
        req.kv_slots = torch.cat([m.device_indices, req.kv_slots[n:]])
        self.unlock(req.last_node)
        self.lock(m.last_device_node)
        req.last_node, req.prefix_len = m.last_device_node, n

    def _insert(self, req: Req, n: int) -> None:
        res = self.tree.insert(req.fill_ids[:n], req.kv_slots[:n])
        if res.prefix_len > req.prefix_len:
            self.device.free(req.kv_slots[req.prefix_len : res.prefix_len])
        self.tracer.emit(Ev.INSERT, rid=req.rid, tokens=n, existing=res.prefix_len,
                         revived=len(res.revived), new=res.new_node.id if res.new_node else None)
        if self.host is None:
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
                self.write_backup(node)

    # --- L1 -> L2 ---------------------------------------------------------------------------------

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back ``node`` up to L2. Returns the tokens queued (0: not backed up).

        Host residency stays contiguous from the root: a node whose parent has no host copy is
        not backed up. The allocation outcome is agreed across ranks before anything is
        committed, unless the classic local decision is restored."""
        assert self.host is not None
        assert self.controller is not None
        if node.host_value is not None or node.value is None:
            return 0
        parent = node.parent
        parent_ok = parent is self.tree.root or (parent is not None and parent.backuped)
        if LegacySwitch.SKIP_EMPTY_SYNC in self.legacy:  # classic: a rank-local decision
            slots = self.alloc_host(len(node.key)) if parent_ok else None
        else:
            slots = self.alloc_host_agreed(len(node.key) if parent_ok else 0, "write_backup")
        if slots is None:
            self.stats["backup_skipped"] += len(node.key)
            self.tracer.emit(Ev.WRITE_SKIP, node=node.id, tokens=len(node.key),
                             parent_backed_up=parent_ok)
            return 0
        node.host_value = slots
        if write_back:
            return len(node.key)
        self.tree.inc_lock_ref(node)
        self.ongoing_write_through[node.id] = node
        self.controller.write(node.value, slots, node.id)
        self.stats["backup_tokens"] += len(node.key)
        return len(node.key)

    def alloc_host_agreed(self, num_tokens: int, site: str) -> torch.Tensor | None:
        """Host slots for ``num_tokens`` if *every* rank got them, else None everywhere (the
        two-phase reserve -> vote -> commit/abort proposed in #31425, over TP and PP: a
        leader-decided vote would miss a downstream stage's failure). The evict-and-retry step is
        taken only on an agreed failure and evicts by pool state, which ranks share, never by
        the local outcome, so one rank's failed allocation cannot make the trees diverge.
        ``num_tokens == 0`` votes "no" (a rank that cannot even try still votes)."""
        assert self.host is not None
        for attempt in range(2):
            slots = self.host.alloc(num_tokens) if num_tokens else None
            if self.sync.agree_all(slots is not None, site):
                return slots
            if slots is not None:
                self.host.free(slots)
            if not num_tokens:
                return None
            if attempt == 0:
                self.evict_host(num_tokens - self.host.available_tokens)
        return None

    def alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        """Host slots for ``num_tokens``, evicting L2 leaves once if needed; None if full.
        Rank-local: only legacy paths use it directly."""
        assert self.host is not None
        slots = self.host.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host.available_tokens)
            slots = self.host.alloc(num_tokens)
        return slots

    def host_free(self, slots: torch.Tensor) -> None:
        assert self.host is not None
        self.host.free(slots)

    def hang_host_pages(self, anchor: TreeNode, tokens: list[int], host_slots: torch.Tensor,
                        hashes: list[str]) -> torch.Tensor:
        """Hang fetched L3 pages below ``anchor`` as host-only nodes; returns the host slots
        added to the tree. Pages the tree already holds, or that cannot hang contiguously,
        are freed."""
        present, added = self.tree.insert_host(anchor, tokens, host_slots, hashes)
        if present:
            self.host_free(host_slots[:present])
        if present + added < len(tokens):
            self.host_free(host_slots[present + added :])
        return host_slots[present : present + added]

    # --- L2 -> L1 ---------------------------------------------------------------------------------

    def load_back(self, node: TreeNode, mem_quota: int) -> torch.Tensor | None:
        """Load the evicted path ending at ``node`` back to L1 (all or nothing)."""
        assert self.controller is not None
        path: list[TreeNode] = []
        x = node
        while x.value is None:
            if x.host_value is None:
                raise InvariantViolation(
                    "No backup available on evicted nodes, should not happen "
                    f"(node {x.id})")
            path.append(x)
            assert x.parent is not None
            x = x.parent
        path.reverse()
        ancestor = x
        total = sum(len(n.key) for n in path)
        if total < self.cfg.load_back_threshold or total > mem_quota:
            self.stats["load_skipped"] += total
            self.tracer.emit(Ev.LOAD_SKIP, node=node.id, tokens=total, quota=mem_quota)
            return None
        host_slots = torch.cat([n.host_value for n in path])  # type: ignore[misc]
        self.pins.pin(host_slots)  # keep L2 eviction (reachable via write_back) off the path
        self.lock(None if ancestor is self.tree.root else ancestor)
        try:
            device_slots = self.controller.load(host_slots, node.id)
            if device_slots is None:
                self.evict(total - self.device.available_tokens)
                device_slots = self.controller.load(host_slots, node.id)
        finally:
            self.unlock(None if ancestor is self.tree.root else ancestor)
            self.pins.unpin(host_slots)
        if device_slots is None:
            self.stats["load_skipped"] += total
            self.tracer.emit(Ev.LOAD_SKIP, node=node.id, tokens=total, reason="device_full")
            return None
        offset = 0
        for n in path:
            self.tree.attach_device(n, device_slots[offset : offset + len(n.key)])
            offset += len(n.key)
        self.tree.inc_lock_ref(node)
        self.ongoing_load_back[node.id] = node
        self.stats["load_tokens"] += total
        return device_slots

    def start_loading(self) -> int | None:
        return self.controller.start_loading() if self.controller is not None else None

    # --- eviction -------------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L1 from unlocked leaves, least recently used first."""
        if num_tokens <= 0:
            return 0
        heap = self.tree.device_leaves()
        heapq.heapify(heap)
        evicted = 0
        victims: list[int] = []
        copy: list[TreeNode] = []
        drop: list[TreeNode] = []
        write_back = self.cfg.write_policy is WritePolicy.WRITE_BACK and self.host is not None
        while evicted < num_tokens and heap:
            x = heapq.heappop(heap)
            if x.lock_ref or x in drop:
                continue
            if x.host_value is None:
                if write_back:
                    chain = self._write_back_chain(x)
                    if chain:
                        copy.extend(chain)
                        drop.append(x)
                        evicted += len(x.key)
                    continue
                slots = x.value
                self.tree.delete_leaf(x)
                self.device.free(slots)  # type: ignore[arg-type]
            else:
                self.device.free(self.tree.drop_device(x))
            evicted += len(x.key)
            victims.append(x.id)
            self._push_parent_if_leaf(heap, x)
        if copy:
            self._flush_write_back(copy, drop)
            for x in drop:
                self._push_parent_if_leaf(heap, x)
        self.stats["evicted_device"] += evicted
        victims.extend(x.id for x in drop)
        self.tracer.emit(Ev.EVICT, want=num_tokens, evicted=evicted, written_back=len(drop),
                         victims=victims)
        return evicted

    def _push_parent_if_leaf(self, heap: list[TreeNode], x: TreeNode) -> None:
        p = x.parent
        if (p is not None and p is not self.tree.root and p.value is not None
                and not p.lock_ref and all(c.value is None for c in p.children.values())):
            heapq.heappush(heap, p)

    def _write_back_chain(self, x: TreeNode) -> list[TreeNode]:
        """Reserve host copies for ``x`` and every ancestor lacking one (top-down, so host
        residency stays contiguous). Returns the nodes to copy, or [] if a reservation failed."""
        chain = [n for n in reversed(self.tree.path_to_root(x)) if n.host_value is None]
        done: list[TreeNode] = []
        for n in chain:
            if not self.write_backup(n, write_back=True):
                for d in done:  # undo: nothing was copied yet
                    assert self.host is not None
                    assert d.host_value is not None
                    self.host.free(d.host_value)
                    d.host_value = None
                return []
            done.append(n)
        return chain

    def _flush_write_back(self, copy: list[TreeNode], drop: list[TreeNode]) -> None:
        """Copy write-back victims (and their newly backed-up ancestors) to L2 synchronously,
        then drop the victims' L1 copies."""
        assert self.controller is not None
        assert self.host is not None
        device_slots = torch.cat([n.value for n in copy])  # type: ignore[misc]
        host_slots = torch.cat([n.host_value for n in copy])  # type: ignore[misc]
        self.controller.engine.write(self.device, self.host, device_slots, host_slots) \
            .synchronize()
        for n in drop:
            self.device.free(self.tree.drop_device(n))
        self.stats["backup_tokens"] += int(host_slots.numel())

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L2 from evicted, unreferenced leaves (LRU)."""
        if num_tokens <= 0 or self.host is None:
            return 0
        heap = self.tree.host_leaves()
        heapq.heapify(heap)
        evicted = 0
        victims: list[int] = []
        while evicted < num_tokens and heap:
            x = heapq.heappop(heap)
            if self.pins.pinned(x.host_value):
                continue
            self.host.free(x.host_value)  # type: ignore[arg-type]
            self.tree.delete_leaf(x)
            evicted += len(x.key)
            victims.append(x.id)
            p = x.parent
            if (p is not None and p is not self.tree.root and p.value is None
                    and not p.children and p.host_value is not None):
                heapq.heappush(heap, p)
        self.stats["evicted_host"] += evicted
        self.tracer.emit(Ev.EVICT_HOST, want=num_tokens, evicted=evicted, victims=victims)
        return evicted

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
            self._loading_check(self.controller.ready_count(self.controller.ack_load_queue))
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
        """Pre-#27285/#26923 form: a per-stage TP MIN of the local ready count, skipped
        entirely when this rank has nothing in flight under ``skip-empty-sync``."""
        assert self.controller is not None
        if LegacySwitch.SKIP_EMPTY_SYNC in self.legacy and not self.ongoing_write_through:
            # upstream: "all ranks has the same ongoing_write_through, can skip sync if empty"
            return
        ready = self.controller.ready_count(self.controller.ack_write_queue)
        self._writing_check(self.sync.legacy_tp_min(ready, "writing_check"))

    def _writing_check(self, count: int) -> None:
        assert self.controller is not None
        for _ in range(count):
            ack = self.controller.pop_ack(self.controller.ack_write_queue)
            for node_id in ack.node_ids:
                node = self.ongoing_write_through.pop(node_id)
                self.tree.dec_lock_ref(node)
                self.on_backed_up(node)
            self.tracer.emit(Ev.WRITE_ACK, nodes=ack.node_ids, tokens=ack.tokens)
        if count:
            self.tracer.emit(Ev.WRITE_DRAIN, count=count,
                             left=len(self.controller.ack_write_queue))

    def _loading_check(self, count: int) -> None:
        assert self.controller is not None
        for _ in range(count):
            ack = self.controller.pop_ack(self.controller.ack_load_queue)
            for node_id in ack.node_ids:
                self.tree.dec_lock_ref(self.ongoing_load_back.pop(node_id))
            self.tracer.emit(Ev.LOAD_ACK, nodes=ack.node_ids, tokens=ack.tokens)
        if count:
            self.tracer.emit(Ev.LOAD_DRAIN, count=count, left=len(self.controller.ack_load_queue))

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
        return not (self.ongoing_write_through or self.ongoing_load_back
                    or self.controller.write_queue or self.controller.load_queue
                    or (self.l3 is not None and not self.l3.idle()))

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
            held = self.host_held_outside_tree()
            if free + host_tree + held != hcap:
                raise InvariantViolation(
                    f"host pool: free {free} + tree {host_tree} + in flight {held} != "
                    f"capacity {hcap}")
            _check_slots(self.tree, "host_value", self.host.allocator.is_used, self.page_size)
            if held is not None:  # between steps: no transient load-back pins
                self.pins.check(self.l3.pin_holders() if self.l3 is not None else [])
        if self.l3 is not None:
            self.l3.check_accounting()

    def _check_locks(self, held: Sequence[TreeNode | None]) -> None:
        """Every lock is accounted for: requests' prefixes and in-flight transfers."""
        expected: dict[int, int] = defaultdict(int)
        holders = [*held, *self.ongoing_write_through.values(), *self.ongoing_load_back.values()]
        for node in holders:
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
            "ongoing_write_through": sorted(self.ongoing_write_through),
            "ongoing_load_back": sorted(self.ongoing_load_back),
            "stats": dict(self.stats),
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

    def shutdown(self) -> None:
        if self.l3 is not None:
            self.l3.workers.stop()
            self.l3.workers.backend.close()
        if self.controller is not None:
            self.controller.engine.shutdown()


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
