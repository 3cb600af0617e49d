"""L1 <-> L2 transfers of the tiered cache: write-backup and load-back.

A backup (:class:`WriteBackup`) reserves host pages and commits only if every rank got them; a
load-back (:class:`LoadBack`) brings an evicted path back to L1, all or nothing. Both queue
their copies on the :class:`~hicache_runtime.kv.transfer_queues.CacheController` and record
them in the shared :class:`~hicache_runtime.cache.state.InFlight` until ``check_events``
consumes their acks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch

if TYPE_CHECKING:
    from hicache_runtime.cache.host_space import HostSpace
    from hicache_runtime.cache.state import CacheCounters, InFlight
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import DeviceKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.transfer_queues import CacheController
    from hicache_runtime.telemetry.tracer import Tracer


class WriteBackup:
    """L1 -> L2 backups of tree nodes. Scheduler thread only."""

    def __init__(self, space: HostSpace, controller: CacheController, tree: RadixTree,
                 in_flight: InFlight, tracer: Tracer, counters: CacheCounters,
                 legacy: frozenset[LegacySwitch]) -> None:
        self.space = space
        self.controller = controller
        self.tree = tree
        self.in_flight = in_flight
        self.tracer = tracer
        self.counters = counters
        self.legacy = legacy

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Back ``node`` up to L2. Returns the tokens queued (0: not backed up). With
        ``write_back`` only the host pages are reserved: the caller copies synchronously.

        Host residency stays contiguous from the root: a node whose parent has no host copy is
        not backed up. The allocation is the run's (``HostSpace.take``): agreed across ranks
        before anything is committed, or each rank's own as releases allocate."""
        if node.host_value is not None or node.value is None:
            return 0
        parent = node.parent
        parent_ok = parent is self.tree.root or (parent is not None and parent.backuped)
        # skip-empty-sync: the classic rank-local decision, whatever the run's allocation
        slots = self.space.take(len(node.key) if parent_ok else 0, "write_backup",
                                rank_local=LegacySwitch.SKIP_EMPTY_SYNC in self.legacy)
        if slots is None:
            self.counters.backup_skipped += len(node.key)
            self.tracer.emit(Ev.WRITE_SKIP, node=node.id, tokens=len(node.key),
                             parent_backed_up=parent_ok)
            return 0
        node.host_value = slots
        if write_back:
            return len(node.key)
        self.tree.inc_lock_ref(node)
        self.in_flight.ongoing_write_through[node.id] = node
        self.in_flight.write_tokens[node.id] = len(node.key)
        self.controller.write(node.value, slots, node.id)
        self.counters.backup_tokens += len(node.key)
        return len(node.key)


class LoadBack:
    """L2 -> L1 load-backs of evicted paths. Scheduler thread only.

    ``evict`` frees L1 (the cache's eviction): a load-back that finds L1 full evicts once and
    retries."""

    def __init__(self, controller: CacheController, device: DeviceKVPool, tree: RadixTree,
                 pins: HostPins, evict: Callable[[int], int], in_flight: InFlight,
                 tracer: Tracer, counters: CacheCounters, threshold: int) -> None:
        self.controller = controller
        self.device = device
        self.tree = tree
        self.pins = pins
        self.evict = evict
        self.in_flight = in_flight
        self.tracer = tracer
        self.counters = counters
        self.threshold = threshold
        """Paths shorter than this many tokens are recomputed rather than loaded back."""

    def load_back(self, node: TreeNode, mem_quota: int) -> torch.Tensor | None:
        """Load the evicted path ending at ``node`` back to L1 (all or nothing)."""
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
        ancestor = None if x is self.tree.root else x
        total = sum(len(n.key) for n in path)
        if total < self.threshold or total > mem_quota:
            self.counters.load_skipped += total
            self.tracer.emit(Ev.LOAD_SKIP, node=node.id, tokens=total, quota=mem_quota)
            return None
        host_slots = torch.cat([n.host_value for n in path])  # type: ignore[misc]
        self.pins.pin(host_slots)  # keep L2 eviction (reachable via write_back) off the path
        if ancestor is not None:  # keep eviction off the path's device-resident ancestor
            self.tree.inc_lock_ref(ancestor)
        try:
            device_slots = self.controller.load(host_slots, node.id)
            if device_slots is None:
                self.evict(total - self.device.available_tokens)
                device_slots = self.controller.load(host_slots, node.id)
        finally:
            if ancestor is not None:
                self.tree.dec_lock_ref(ancestor)
            self.pins.unpin(host_slots)
        if device_slots is None:
            self.counters.load_skipped += total
            self.tracer.emit(Ev.LOAD_SKIP, node=node.id, tokens=total, reason="device_full")
            return None
        offset = 0
        for n in path:
            self.tree.attach_device(n, device_slots[offset : offset + len(n.key)])
            offset += len(n.key)
        self.tree.inc_lock_ref(node)
        self.in_flight.ongoing_load_back[node.id] = node
        self.counters.load_tokens += total
        return device_slots
