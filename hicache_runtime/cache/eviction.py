"""L1 eviction of the tiered cache: unlocked leaves in the tree's eviction order
(:mod:`~hicache_runtime.kv.evict_order`; least recently used first by default).

L1 eviction drops a backed-up leaf's device copy, deletes a leaf that has none, or
(``write_back``) backs the leaf and its un-backed ancestors up first. L2 eviction lives with
the allocation it serves (:mod:`~hicache_runtime.cache.host_space`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch

if TYPE_CHECKING:
    from hicache_runtime.cache.host_space import HostSpace
    from hicache_runtime.cache.state import CacheCounters
    from hicache_runtime.cache.transfers import WriteBackup
    from hicache_runtime.kv.evict_order import Entry
    from hicache_runtime.kv.pools import DeviceKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.transfer_queues import CacheController, HiCacheAck
    from hicache_runtime.telemetry.tracer import Tracer


@dataclass(frozen=True)
class WriteBackPath:
    """What ``write_back`` eviction uses to save a victim to L2 before dropping it: host
    reservations (``backups``, undone through ``space``), a synchronous copy (``controller``),
    and the L3 chain for each finished L2 copy (``on_backed_up``; None without L3)."""

    backups: WriteBackup
    space: HostSpace
    controller: CacheController
    on_backed_up: Callable[[TreeNode], None] | None = None


class DeviceEviction:
    """Frees L1 from the tree's unlocked leaves. Scheduler thread only. ``write_back``: set
    under the ``write_back`` policy with L2 present; otherwise victims without a host copy are
    dropped."""

    def __init__(self, device: DeviceKVPool, tree: RadixTree, tracer: Tracer,
                 counters: CacheCounters, write_back: WriteBackPath | None = None) -> None:
        self.device = device
        self.tree = tree
        self.tracer = tracer
        self.counters = counters
        self.write_back = write_back

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L1 from unlocked leaves, in the tree's eviction order
        (least recently used first by default)."""
        if num_tokens <= 0:
            return 0
        order = self.tree.order
        heap = order.heap(self.tree.device_leaves())
        evicted = 0
        victims: list[int] = []
        copy: list[TreeNode] = []
        drop: list[TreeNode] = []
        wb = self.write_back
        while evicted < num_tokens and heap:
            x = order.pop(heap)
            if x.lock_ref or x in drop or x in copy:  # ``copy``: its L2 copy is not made yet
                continue
            if x.host_value is None:
                if wb is not None:
                    chain = self._write_back_chain(wb, x)
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
        if wb is not None and copy:
            self._flush_write_back(wb, copy, drop)
            for x in drop:
                self._push_parent_if_leaf(heap, x)
        self.counters.evicted_device += evicted
        victims.extend(x.id for x in drop)
        self.tracer.emit(Ev.EVICT, want=num_tokens, evicted=evicted, written_back=len(drop),
                         victims=victims)
        return evicted

    def _push_parent_if_leaf(self, heap: list[Entry], x: TreeNode) -> None:
        p = x.parent
        if (p is not None and p is not self.tree.root and p.value is not None
                and not p.lock_ref and all(c.value is None for c in p.children.values())):
            self.tree.order.push(heap, p)

    def _write_back_chain(self, wb: WriteBackPath, x: TreeNode) -> list[TreeNode]:
        """Reserve host copies for ``x`` and every ancestor lacking one (top-down, so host
        residency stays contiguous). Returns the nodes to copy, or [] if a reservation failed."""
        chain = [n for n in reversed(self.tree.path_to_root(x)) if n.host_value is None]
        done: list[TreeNode] = []
        for n in chain:
            if not wb.backups.write_backup(n, write_back=True):
                for d in done:  # undo: nothing was copied yet
                    assert d.host_value is not None
                    wb.space.free(d.host_value)
                    d.host_value = None
                return []
            done.append(n)
        return chain

    def _flush_write_back(self, wb: WriteBackPath, copy: list[TreeNode],
                          drop: list[TreeNode]) -> None:
        """Copy write-back victims (and their newly backed-up ancestors) to L2 synchronously,
        then drop the victims' L1 copies."""
        device_slots = torch.cat([n.value for n in copy])  # type: ignore[misc]
        host_slots = torch.cat([n.host_value for n in copy])  # type: ignore[misc]
        wb.controller.write_now(device_slots, host_slots)
        for n in drop:
            self.device.free(self.tree.drop_device(n))
        self.counters.backup_tokens += int(host_slots.numel())
        if wb.on_backed_up is not None:
            for n in copy:  # their L2 copies are complete: chain L3 backups, as write-through does
                wb.on_backed_up(n)


def touch_on_io_done(node: TreeNode, ack: HiCacheAck, legacy: frozenset[LegacySwitch]) -> None:
    """``wallclock-lru``: the node's LRU stamp moves to the wall-clock moment this rank
    found its own copy of it finished. That moment is rank-local (a copy engine that lags
    on one rank finds it later), so one rank's lag reorders its stamps against nodes the
    ranks touched together, and the ranks pick different victims. The fixed tree's
    logical clock only advances with tree operations, which every rank performs alike."""
    if LegacySwitch.WALLCLOCK_LRU in legacy and ack.done_at is not None:
        node.last_access = max(node.last_access, ack.done_at)
