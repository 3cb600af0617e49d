"""The named fault points of the runtime.

A fault point is a place in the runtime where an armed fault may act. Points cost nothing when no
fault targets them: components ask the injector once, at construction, whether a point is armed,
and skip the call entirely otherwise. Which kinds act at which point is stated per kind in
``faults.kinds.KINDS``.
"""

from __future__ import annotations

from enum import Enum


class FaultPoint(str, Enum):
    """Where a fault acts. One line per member says where the runtime calls it."""

    SCHEDULER_STEP = "scheduler.step"
    """Top of every scheduler loop iteration."""
    COPY_COMPLETE = "copy.complete"
    """A copy-engine job (L1<->L2) is about to signal completion."""
    HOST_ALLOC = "host.alloc"
    """The host (L2) pool is asked for pages."""
    STORAGE_EXISTS = "storage.exists"
    """An L3 existence query."""
    STORAGE_GET = "storage.get"
    """An L3 read of a batch of pages."""
    STORAGE_PAGE = "storage.page"
    """One page of an L3 read, once read; decided by the page's key and how often it was read
    before, so the same reads are hit however pages are batched into calls."""
    STORAGE_SET = "storage.set"
    """An L3 page write."""
    PREFETCH_BATCH = "prefetch.batch"
    """The prefetch IO thread is about to read one batch of pages."""
    PREFILL_CHUNK = "prefill.chunk"
    """A chunk of a chunked prefill has been applied; the request waits for its next chunk."""
    CACHE_EVENTS = "cache.events"
    """Start of ``check_hicache_events`` on the scheduler thread."""
    FORWARD = "model.forward"
    """Before a batch runs through the model."""
