"""Page allocator shared by the device (L1) and host (L2) pools.

Slots are token positions in a pool; pages are runs of ``page_size`` consecutive slots. The
allocator hands out whole pages and keeps a used-bitmap, so a page handed out twice or freed twice
is caught at once (SGLang's "Double-alloc detected" / "Double-free detected") instead of turning
into silent KV corruption later.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

import torch

from hicache_runtime.contracts.errors import DoubleAllocation, DoubleFree, InvariantViolation


class PageAllocator:
    """Fixed pool of pages. Thread-safe (the host pool is touched by IO threads).

    ``alloc`` returns ``None`` when the pool cannot satisfy the request: callers decide whether
    to evict and retry. ``free`` of a page that is not in use raises :class:`DoubleFree`.
    """

    def __init__(self, num_pages: int, page_size: int, name: str) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise InvariantViolation(f"{name}: pool needs pages > 0 and page_size > 0")
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used = bytearray(num_pages)
        self._lock = threading.RLock()
        # Offsets 0..page_size-1, added to page starts to expand pages into slots.
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    # --- capacity -----------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def available_pages(self) -> int:
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    # --- pages ------------------------------------------------------------------------------

    def alloc_pages(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or ``None`` (nothing taken) when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.popleft() for _ in range(n)]
            for p in pages:
                if self._used[p]:
                    raise DoubleAllocation(f"{self.name}: Double-alloc detected (page {p})")
                self._used[p] = 1
            return pages

    def free_pages(self, pages: Iterable[int]) -> None:
        """Return pages. Raises :class:`DoubleFree` (and frees nothing) if one is not in use."""
        pages = list(pages)
        with self._lock:
            seen: set[int] = set()
            for p in pages:
                if not 0 <= p < self.num_pages:
                    raise InvariantViolation(f"{self.name}: page {p} out of range")
                if not self._used[p] or p in seen:
                    raise DoubleFree(f"{self.name}: Double-free detected (page {p})")
                seen.add(p)
            for p in pages:
                self._used[p] = 0
                self._free.append(p)

    def is_used(self, page: int) -> bool:
        return bool(self._used[page])

    # --- slots ------------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Slots for ``num_tokens`` (a multiple of the page size), page-contiguous, or ``None``."""
        if num_tokens % self.page_size:
            raise InvariantViolation(
                f"{self.name}: alloc({num_tokens}) is not a multiple of page_size {self.page_size}"
            )
        pages = self.alloc_pages(num_tokens // self.page_size)
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages that ``slots`` (whole pages, as from ``alloc``) cover."""
        if slots.numel() == 0:
            return
        self.free_pages(self.slots_to_pages(slots))

    def pages_to_slots(self, pages: list[int]) -> torch.Tensor:
        starts = torch.tensor(pages, dtype=torch.int64) * self.page_size
        return (starts[:, None] + self._offsets[None, :]).reshape(-1)

    def slots_to_pages(self, slots: torch.Tensor) -> list[int]:
        if slots.numel() % self.page_size:
            raise InvariantViolation(
                f"{self.name}: {slots.numel()} slots are not whole pages of {self.page_size}"
            )
        return (slots[:: self.page_size] // self.page_size).tolist()
