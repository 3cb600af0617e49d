"""The prefix-cache interface the scheduler talks to, and the cache-disabled implementation.

The scheduler never touches the tree, pools or controller directly; it asks a
:class:`PrefixCache`. :class:`~hicache_runtime.cache.hicache.HiCache` is the real three-tier cache;
:class:`NoPrefixCache` computes everything from scratch and is the reference every cached run is
compared against.

Contract shared by all implementations (scheduler thread only):

* ``prepare_prefix`` may load back from L2 and split nodes; its ``indices`` are valid only after
  the scheduler locks ``last_node`` and until it unlocks it.
* ``alloc_device`` evicts unlocked L1 pages on demand; ``None`` means L1 is really full.
* ``cache_finished_req`` hands the request's KV to the cache and releases every slot and lock
  the request held; ``release_req`` does the same without caching (retraction, abort).
* ``check_integrity(request_owned)`` raises :class:`InvariantViolation` with the numbers when
  ``free + evictable + protected + request_owned != capacity`` on any tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.dist.protocols import DrainCounts

if TYPE_CHECKING:
    from hicache_runtime.kv.host_pins import HostPins
    from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool
    from hicache_runtime.kv.radix_tree import RadixTree, TreeNode
    from hicache_runtime.kv.request import Req
    from hicache_runtime.l3.tier import L3Tier

_EMPTY = torch.empty(0, dtype=torch.int64)


class PrefixPlan(NamedTuple):
    """A usable prefix for a request: ``indices`` (device slots) end at ``last_node``.

    ``device_hit`` tokens were already in L1, ``host_hit`` are being loaded back from L2 and
    ``storage_hit`` of those came from L3 for this request (a settled prefetch)."""

    indices: torch.Tensor
    last_node: TreeNode | None
    device_hit: int
    host_hit: int
    storage_hit: int = 0


class CacheParts(NamedTuple):
    """The parts of a cache that hold pages, as end-of-run accounting measures them; a part
    the cache does not have is ``None``."""

    device: DeviceKVPool
    tree: RadixTree | None = None
    host: HostKVPool | None = None
    pins: HostPins | None = None
    l3: L3Tier | None = None


class PrefixCache(ABC):
    """What the scheduler needs from a KV cache. See the module docstring for the contract."""

    page_size: int
    device: DeviceKVPool

    @abstractmethod
    def prepare_prefix(self, req: Req, mem_quota: int) -> PrefixPlan: ...

    @abstractmethod
    def lock(self, node: TreeNode | None) -> None: ...

    @abstractmethod
    def unlock(self, node: TreeNode | None) -> None: ...

    def alloc_device(self, num_tokens: int) -> torch.Tensor | None:
        """Device slots for ``num_tokens`` (page multiple), evicting on demand."""
        slots = self.device.alloc(num_tokens)
        if slots is None:
            self.evict(num_tokens - self.device.available_tokens)
            slots = self.device.alloc(num_tokens)
        return slots

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None: ...

    def release_req(self, req: Req) -> None:
        """Free every request-owned slot and the request's lock, caching nothing."""
        self.device.free(req.kv_slots[req.prefix_len :])
        self.unlock(req.last_node)
        req.reset_kv()

    def on_enqueue(self, req: Req) -> None:
        """A request entered the waiting queue (L3 prefetch starts here)."""

    def prefetch_ready(self, req: Req) -> bool:
        """False keeps the request waiting for its L3 prefetch (checked before admission)."""
        return True

    def on_abort(self, req: Req) -> None:
        """A waiting request was aborted (release its prefetch)."""

    def on_admit(self, req: Req) -> None:
        """A request was admitted into a batch (pages held for it may be released)."""

    def local_drain_counts(self) -> DrainCounts:
        """Ready completions of this rank, to be agreed on across ranks."""
        return DrainCounts()

    def check_events(self, agreed: DrainCounts | None = None) -> None:
        """Consume completed transfers (scheduler thread, before batch formation); with
        ``agreed``, exactly those counts (already agreed across ranks)."""

    def start_loading(self) -> int | None:
        """Launch queued load-backs; returns the layer-counter slot the batch must consume."""
        return None

    @property
    @abstractmethod
    def evictable_tokens(self) -> int: ...

    @property
    def available_tokens(self) -> int:
        """Device tokens obtainable now: free plus evictable."""
        return self.device.available_tokens + self.evictable_tokens

    @abstractmethod
    def check_integrity(self, request_owned: int,
                        held: Sequence[TreeNode | None] | None = None) -> None:
        """Raise ``InvariantViolation`` on broken accounting. ``held``: the prefix nodes that
        requests hold locks on; when given, every lock in the tree must be accounted for."""

    @abstractmethod
    def snapshot(self) -> dict[str, Any]: ...

    def parts(self) -> CacheParts:
        """The page-holding parts, for accounting (read-only use)."""
        return CacheParts(self.device)

    def counters(self) -> dict[str, Any]:
        """The cache's raw counters for the run's stats (a cache without tiers counts none)."""
        return {}

    def idle(self) -> bool:
        """True when no transfer or background work is in flight."""
        return True

    def stop_stepping(self) -> None:
        """The steps are over; the end-of-run drain comes next. A transfer a fault held back
        for a number of steps counts from now on as soon as it has finished."""

    def drain(self) -> None:
        """End of a single-rank run: wait for every transfer and consume it, so ``idle()``
        holds. (Several ranks drain in agreed rounds of ``check_events`` instead.)"""

    def shutdown(self) -> None:
        """Stop background threads and wait for copies."""


class NoPrefixCache(PrefixCache):
    """Cache disabled: no reuse; every finished request frees all its slots."""

    def __init__(self, device: DeviceKVPool) -> None:
        self.device = device
        self.page_size = device.page_size

    def prepare_prefix(self, req: Req, mem_quota: int) -> PrefixPlan:
        return PrefixPlan(_EMPTY, None, 0, 0)

    def lock(self, node: TreeNode | None) -> None:
        if node is not None:
            raise InvariantViolation("NoPrefixCache has no nodes to lock")

    def unlock(self, node: TreeNode | None) -> None:
        self.lock(node)

    def evict(self, num_tokens: int) -> int:
        return 0

    def cache_finished_req(self, req: Req) -> None:
        self.release_req(req)

    def cache_unfinished_req(self, req: Req) -> None:
        """Chunked prefill: the request keeps its slots; nothing to share."""

    @property
    def evictable_tokens(self) -> int:
        return 0

    def check_integrity(self, request_owned: int,
                        held: Sequence[TreeNode | None] | None = None) -> None:
        free, cap = self.device.available_tokens, self.device.capacity_tokens
        if free + request_owned != cap:
            raise InvariantViolation(
                f"device pool: free {free} + requests {request_owned} != capacity {cap}"
            )

    def snapshot(self) -> dict[str, Any]:
        return {"kind": "none", "device_free": self.device.available_tokens,
                "device_capacity": self.device.capacity_tokens}
