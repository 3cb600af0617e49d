"""L2 space of the tiered cache: host-page allocation with LRU eviction of L2 leaves behind it.

Write-backups and the L3 tier's prefetches both take host pages here (:meth:`HostSpace.take`),
as the run's host allocation says (``contracts/profiles.py`` ``HostAlloc``): rank-local, as
every release allocates (each rank evicts once, retries and acts on its own outcome), or agreed
across ranks (two-phase: reserve, vote, commit or abort; #31425's proposal) so that one rank's
failure cannot make the trees diverge. L2 eviction deletes evicted (host-only), unpinned
leaves, least recently used first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache_runtime.contracts.events import Ev

if TYPE_CHECKING:
    import torch

    from hicache_runtime.cache.state import CacheCounters
    from hicache_runtime.dist.protocols import RankSync
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import HostKVPool
    from hicache_runtime.kv.radix_tree import RadixTree
    from hicache_runtime.telemetry.tracer import Tracer


class HostSpace:
    """Host pages for one rank's cache and L3 tier (the tier's ``HostAllocator``). Scheduler
    thread only."""

    def __init__(self, host: HostKVPool, tree: RadixTree, pins: HostPins, sync: RankSync,
                 tracer: Tracer, counters: CacheCounters, *, agreed: bool = True) -> None:
        self.agreed = agreed
        """Allocations are voted over every rank (``HostAlloc.AGREED``), else rank-local."""
        self.host = host
        self.tree = tree
        self.pins = pins
        self.sync = sync
        self.tracer = tracer
        self.counters = counters

    def take(self, num_tokens: int, site: str, *, rank_local: bool = False
             ) -> torch.Tensor | None:
        """Host slots for a write-backup or a prefetch of ``num_tokens`` (0: none, though an
        agreed allocation still votes), agreed over every rank or this rank's own as the run
        allocates; ``rank_local`` for a legacy path that allocates locally whatever the run
        does."""
        if rank_local or not self.agreed:
            return self.alloc_host(num_tokens) if num_tokens else None
        return self.alloc_host_agreed(num_tokens, site)

    def take_prefix(self, num_tokens: int, page_size: int, at_least: int
                    ) -> tuple[torch.Tensor, int] | None:
        """A release's prefetch into a full L2 (0.5.23 ``hybrid_cache_controller.py``
        ``allocate_storage_hit`` L796-829, 0.5.20 ``_try_alloc_storage_hit`` L2733-2746): once
        the full allocation failed (after its eviction), the page-aligned part of
        ``num_tokens`` that fits now, if it is at least ``at_least`` tokens; rank-local like
        every release's, so ranks whose pools differ take different lengths. None under an
        agreed allocation (the proposed protocols take all or nothing) or when too little
        fits. Returns the slots and their token count."""
        if self.agreed:
            return None
        fit = min(num_tokens, self.host.available_tokens)
        fit -= fit % page_size
        if fit <= 0 or fit < at_least:
            return None
        slots = self.host.alloc(fit)
        return (slots, fit) if slots is not None else None

    def alloc_host_agreed(self, num_tokens: int, site: str) -> torch.Tensor | None:
        """Host slots for ``num_tokens`` if *every* rank got them, else None everywhere (the
        two-phase reserve -> vote -> commit/abort proposed in #31425, over TP and PP: a
        leader-decided vote would miss a downstream stage's failure). The evict-and-retry step is
        taken only on an agreed failure and evicts by pool state, which ranks share, never by
        the local outcome, so one rank's failed allocation cannot make the trees diverge.
        ``num_tokens == 0`` votes "no" (a rank that cannot even try still votes)."""
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
        Rank-local (every release's allocation)."""
        slots = self.host.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host.available_tokens)
            slots = self.host.alloc(num_tokens)
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self.host.free(slots)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of L2 from evicted, unreferenced leaves, in the tree's
        eviction order."""
        if num_tokens <= 0:
            return 0
        order = self.tree.order
        heap = order.heap(self.tree.host_leaves())
        evicted = 0
        victims: list[int] = []
        while evicted < num_tokens and heap:
            x = order.pop(heap)
            if self.pins.pinned(x.host_value):
                continue
            self.host.free(x.host_value)  # type: ignore[arg-type]
            self.tree.delete_leaf(x)
            evicted += len(x.key)
            victims.append(x.id)
            p = x.parent
            if (p is not None and p is not self.tree.root and p.value is None
                    and not p.children and p.host_value is not None):
                order.push(heap, p)
        self.counters.evicted_host += evicted
        self.tracer.emit(Ev.EVICT_HOST, want=num_tokens, evicted=evicted, victims=victims)
        return evicted
