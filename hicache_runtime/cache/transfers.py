"""L1 <-> L2 transfers of the tiered cache: write-backup, host allocation, load-back.

Part of :class:`~hicache_runtime.cache.hicache.HiCache` (a mixin, so the policies read top to bottom
in one place each): a backup reserves host pages and commits only if every rank got them; a
load-back brings an evicted path back to L1, all or nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch

if TYPE_CHECKING:
    from hicache_runtime.config import CacheConfig
    from hicache_runtime.dist.protocols import RankSync
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.transfer_queues import CacheController
    from hicache_runtime.telemetry.tracer import Tracer


class TransferMixin:
    """Write-backup and load-back; mixed into ``HiCache`` (which provides the attributes)."""

    cfg: CacheConfig
    page_size: int
    device: DeviceKVPool
    host: HostKVPool | None
    controller: CacheController | None
    tree: RadixTree
    sync: RankSync
    tracer: Tracer
    legacy: frozenset[LegacySwitch]
    pins: HostPins
    stats: dict[str, int]
    ongoing_write_through: dict[int, TreeNode]
    write_tokens: dict[int, int]
    ongoing_load_back: dict[int, TreeNode]

    if TYPE_CHECKING:  # provided by EvictionMixin and HiCache
        def evict(self, num_tokens: int) -> int: ...
        def evict_host(self, num_tokens: int) -> int: ...
        def lock(self, node: TreeNode | None) -> None: ...
        def unlock(self, node: TreeNode | None) -> None: ...

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
        self.write_tokens[node.id] = len(node.key)
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

