"""L1 and L2 eviction of the tiered cache: least recently used unlocked leaves first.

Part of :class:`~hicache_runtime.cache.hicache.HiCache` (a mixin). L1 eviction drops a backed-up
leaf's device copy, deletes a leaf that has none, or (``write_back``) backs the leaf and its
un-backed ancestors up first; L2 eviction deletes evicted, unpinned host-only leaves.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from hicache_runtime.config import WritePolicy
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch

if TYPE_CHECKING:
    from hicache_runtime.config import CacheConfig
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.transfer_queues import CacheController, HiCacheAck
    from hicache_runtime.telemetry.tracer import Tracer


class EvictionMixin:
    """L1/L2 eviction; mixed into ``HiCache`` (which provides the attributes)."""

    cfg: CacheConfig
    device: DeviceKVPool
    host: HostKVPool | None
    controller: CacheController | None
    tree: RadixTree
    tracer: Tracer
    pins: HostPins
    stats: dict[str, int]
    legacy: frozenset[LegacySwitch]

    if TYPE_CHECKING:  # provided by TransferMixin and HiCache
        def write_backup(self, node: TreeNode, write_back: bool = False) -> int: ...
        def on_backed_up(self, node: TreeNode) -> None: ...

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
            if x.lock_ref or x in drop or x in copy:  # ``copy``: its L2 copy is not made yet
                continue
            if x.host_value is None:
                if write_back:
                    chain = self._write_back_chain(x)
                    if chain:
                        copy.extend(chain)
                        drop.append(x)
                        evicted += len(x.key)
                        continue
                    # No host pages, even after L2 eviction (pinned by prefetches, backups):
                    # drop the leaf unsaved rather than keep it and stall every allocation
                    # (upstream: "write_back: KV subtree dropped without backup due to host
                    # memory pressure"). The reservation outcome was agreed, so ranks agree.
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

    def touch_on_io_done(self, node: TreeNode, ack: HiCacheAck) -> None:
        """``wallclock-lru``: the node's LRU stamp moves to the wall-clock moment this rank
        found its own copy of it finished. That moment is rank-local (a copy engine that lags
        on one rank finds it later), so one rank's lag reorders its stamps against nodes the
        ranks touched together, and the ranks pick different victims. The fixed tree's
        logical clock only advances with tree operations, which every rank performs alike."""
        if LegacySwitch.WALLCLOCK_LRU in self.legacy and ack.done_at is not None:
            node.last_access = max(node.last_access, ack.done_at)

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
        for n in copy:  # their L2 copies are complete: chain L3 backups, as write-through does
            self.on_backed_up(n)

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

