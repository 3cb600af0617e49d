"""The order in which eviction takes unlocked leaves, one per SGLang eviction policy.

SGLang builds a heap of ``(strategy.get_priority(node), node)`` over the evictable leaves and
pops the smallest (0.5.23 ``unified_cache/components/full.py`` ``_evict_device_start``
L209-216 and ``drive_host_eviction`` L250-281; the strategies are ``evict_policy.py``). Here
both L1 eviction (:mod:`~hicache_runtime.cache.eviction`) and L2 eviction
(:mod:`~hicache_runtime.cache.host_space`) pop from :meth:`EvictOrder.heap`: the policy's key,
then the node id, so that two nodes never compare by identity and every rank pops the same
node (the key's stamps come from the tree's logical clock, alike on every rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hicache_runtime.contracts.profiles import EvictionPolicy

if TYPE_CHECKING:
    from hicache_runtime.kv.radix_tree import TreeNode

#: A heap entry: the policy's key, the node id (unique: no two entries tie), the node.
Entry = tuple[tuple[float, ...], int, "TreeNode"]


@dataclass(frozen=True)
class EvictOrder:
    """One eviction policy with its settings (SGLang ``--radix-eviction-policy-config``)."""

    policy: EvictionPolicy = EvictionPolicy.LRU
    protected_threshold: int = 2
    """``slru``: hits that move a node to the protected segment (``SLRUStrategy``)."""
    threshold: int = 0
    """``tlru``: tokens a conversation may recompute within its TTFT budget."""
    next_prompt_estimate: int = 0
    """``tlru``: tokens the next prompt of a conversation is expected to add."""

    @classmethod
    def of(cls, policy: EvictionPolicy, settings: Mapping[str, int]) -> EvictOrder:
        """The order a config names (its settings checked by the config)."""
        return cls(policy, **settings)

    def key(self, node: TreeNode) -> tuple[float, ...]:
        """The policy's priority of ``node``: smaller is evicted first."""
        p = self.policy
        if p is EvictionPolicy.LRU:
            return (node.last_access,)
        if p is EvictionPolicy.LFU:
            return (node.hit_count, node.last_access)
        if p is EvictionPolicy.FIFO:
            return (node.creation,)
        if p is EvictionPolicy.MRU:
            return (-node.last_access,)
        if p is EvictionPolicy.FILO:
            return (-node.creation,)
        if p is EvictionPolicy.PRIORITY:
            return (node.priority, node.last_access)
        if p is EvictionPolicy.SLRU:
            return (int(node.hit_count >= self.protected_threshold), node.last_access)
        return (self._tlru_segment(node), node.last_access)

    def _tlru_segment(self, node: TreeNode) -> int:
        """-1 when ``node``'s tokens lie past its branch's budget (TEL-safe: they cannot
        shorten the next prefill below the TTFT target), else 0 (0.5.23 ``evict_policy.py``
        ``TLRUStrategy.get_priority`` L70-81). The budget reads the branch's high-water depth,
        which does not shrink as the tail is evicted."""
        budget = max(node.history_tokens + self.next_prompt_estimate - self.threshold, 0)
        return -1 if node.depth_tokens - len(node.key) >= budget else 0

    def heap(self, nodes: list[TreeNode]) -> list[Entry]:
        """A heap of ``nodes`` (evictable leaves) in this order."""
        out = [self._entry(n) for n in nodes]
        heapq.heapify(out)
        return out

    def push(self, heap: list[Entry], node: TreeNode) -> None:
        """Add ``node`` (a parent that became a leaf) to ``heap``."""
        heapq.heappush(heap, self._entry(node))

    def _entry(self, node: TreeNode) -> Entry:
        return (self.key(node), node.id, node)

    @staticmethod
    def pop(heap: list[Entry]) -> TreeNode:
        return heapq.heappop(heap)[2]


LRU = EvictOrder()
"""Every release's default."""
