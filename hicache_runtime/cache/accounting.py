"""End-of-run page accounting: what a rank still holds once it has drained.

At drain nothing may own a page but the radix tree, and no tree page may stay locked: every
request has finished or aborted, every L1<->L2 copy and every L3 prefetch or backup has been
consumed. The drain's integrity check (``PrefixCache.check_integrity(0, [])``) raises on the
first rule that breaks; this module measures the same state without raising, so a run result
can say *how much* leaked and *where* (a property campaign judges ``no-leaked-page`` on it, and
a drain that failed its check still reports the numbers behind the failure).

Counted in pages (L3 reservations are tokens of prefetch budget, rounded up to pages):

* ``device_unowned`` — L1 pages allocated but in no tree node;
* ``device_locked`` — L1 pages in tree nodes that are still locked (no holder is left);
* ``host_unowned`` — L2 pages allocated but in no tree node;
* ``host_pinned`` — L2 pages still pinned (a backup, prefetch or load-back that never let go);
* ``l3_reserved`` — prefetch budget still reserved (``prefetch_tokens_occupied``);
* ``l3_open`` — L3 operations still open (prefetches and backups), in operations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, computed_field, model_validator

if TYPE_CHECKING:
    from hicache_runtime.cache.interface import PrefixCache

#: Fields of :class:`DrainAccount` that count leaked pages (``leaked_pages`` is their sum).
LEAK_FIELDS = ("device_unowned", "device_locked", "host_unowned", "host_pinned", "l3_reserved")


class DrainAccount(BaseModel):
    """One rank's holdings at drain; every counter is 0 on a rank that leaked nothing. The
    one definition: measured here, carried in the rank's result to the launcher (validated
    there), summed into the run's leak check."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device_capacity: int
    device_free: int
    device_tree: int
    device_unowned: int = 0
    device_locked: int = 0
    host_capacity: int = 0
    host_free: int = 0
    host_tree: int = 0
    host_unowned: int = 0
    host_pinned: int = 0
    l3_reserved: int = 0
    l3_open: int = 0

    @model_validator(mode="before")
    @classmethod
    def _recount(cls, data: Any) -> Any:
        # the serialised form carries the sum; it is recomputed, never taken as given
        if isinstance(data, dict) and "leaked_pages" in data:
            data = {k: v for k, v in data.items() if k != "leaked_pages"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def leaked_pages(self) -> int:
        return sum(getattr(self, f) for f in LEAK_FIELDS)

    def leaks(self) -> dict[str, int]:
        """The non-zero leak counters (``l3_open`` included), for a one-line report."""
        return {f: getattr(self, f) for f in (*LEAK_FIELDS, "l3_open") if getattr(self, f)}



def drain_account(cache: PrefixCache) -> DrainAccount:
    """Measure ``cache``'s parts (:meth:`~.interface.PrefixCache.parts`) as they stand. Call
    it after the drain: before, requests and transfers legitimately hold pages."""
    ps = cache.page_size
    parts = cache.parts()
    dev = parts.device.allocator
    tree = parts.tree
    tree_pages = locked = 0
    host_tree = 0
    if tree is not None:
        for node in tree.nodes():
            n = len(node.key) // ps
            if node.value is not None:
                tree_pages += n
                locked += n if node.lock_ref and node is not tree.root else 0
            if node.host_value is not None:
                host_tree += n
    dev_used = dev.used_pages
    account: dict[str, int] = {
        "device_capacity": dev.num_pages, "device_free": dev.available_pages,
        "device_tree": tree_pages, "device_unowned": max(0, dev_used - tree_pages),
        "device_locked": locked}
    host = parts.host
    if host is not None:
        alloc = host.allocator
        pins = parts.pins
        account.update(host_capacity=alloc.num_pages, host_free=alloc.available_pages,
                       host_tree=host_tree,
                       host_unowned=max(0, alloc.used_pages - host_tree),
                       host_pinned=pins.pinned_pages if pins is not None else 0)
    l3 = parts.l3
    if l3 is not None:
        account.update(l3_reserved=-(-max(0, l3.occupied) // ps), l3_open=l3.open_ops())
    return DrainAccount(**account)


def check_at_drain(cache: PrefixCache) -> None:
    """The drain's integrity check; a failure is marked as raised at drain."""
    from hicache_runtime.contracts.errors import InvariantViolation

    try:
        cache.check_integrity(0, [])
    except InvariantViolation as exc:
        exc.at_drain = True
        raise


def reached_drain(exc: BaseException) -> bool:
    """Whether ``exc`` is the drain's own integrity check failing (the run got to its end and
    its holdings are what is left, not what a step in flight held)."""
    from hicache_runtime.contracts.errors import InvariantViolation

    return isinstance(exc, InvariantViolation) and exc.at_drain
