"""The state HiCache's parts share: its counters and the L1<->L2 copies in flight.

:class:`~hicache_runtime.cache.hicache.HiCache` owns one of each and hands them to the parts
that write them (host space, write-backup, load-back, eviction), so every writer is named in a
constructor rather than found on a shared ``self``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache_runtime.kv.radix_tree import TreeNode


@dataclass
class CacheCounters:
    """Tokens moved, skipped and evicted by one rank's cache (the snapshot's ``stats``)."""

    backup_tokens: int = 0
    backup_skipped: int = 0
    load_tokens: int = 0
    load_skipped: int = 0
    evicted_device: int = 0
    evicted_host: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class InFlight:
    """L1<->L2 copies whose acks are not consumed yet; each holds a lock on its node until
    ``check_events`` consumes its ack."""

    ongoing_write_through: dict[int, TreeNode] = field(default_factory=dict)
    write_tokens: dict[int, int] = field(default_factory=dict)
    """Tokens each in-flight L1->L2 write covers: a split while it is in flight moves its
    leading pages into new ancestors of the node, which the write covers too."""
    ongoing_load_back: dict[int, TreeNode] = field(default_factory=dict)

    def holders(self) -> list[TreeNode]:
        """The nodes in-flight copies hold locks on."""
        return [*self.ongoing_write_through.values(), *self.ongoing_load_back.values()]
