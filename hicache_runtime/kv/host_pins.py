"""Host-page pins: L2 pages that must not be freed while someone still reads them.

An L3 backup reads a node's host pages, a prefetch hangs new pages below an anchor node, a
load-back copies host pages to L1: each pins the pages it needs (SGLang's ``protect_host`` /
``release_host``). Pins are counted per *page*, not per node, so a node split while pinned can
neither leak a pin on the new upper node nor lose one (the classic per-node host ref counter
has exactly that hazard). L2 eviction skips any node with a pinned page.
"""

from __future__ import annotations

from collections import Counter

import torch

from hicache_runtime.contracts.errors import InvariantViolation


class HostPins:
    """Per-page pin counts. Scheduler thread only."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._pins: Counter[int] = Counter()

    def pin(self, slots: torch.Tensor | None) -> None:
        for page in self._pages(slots):
            self._pins[page] += 1

    def unpin(self, slots: torch.Tensor | None) -> None:
        pages = self._pages(slots)
        for page in pages:
            if self._pins[page] <= 0:
                raise InvariantViolation(f"host page {page} unpinned more often than pinned")
        for page in pages:
            self._pins[page] -= 1
            if not self._pins[page]:
                del self._pins[page]

    def pinned(self, slots: torch.Tensor | None) -> bool:
        return any(p in self._pins for p in self._pages(slots))

    def count(self, slots: torch.Tensor | None) -> int:
        """Total pins over the pages of ``slots`` (a node's host refs, for snapshots)."""
        return sum(self._pins.get(p, 0) for p in self._pages(slots))

    def expected_from(self, holders: list[torch.Tensor | None]) -> Counter[int]:
        """The pin counts that ``holders`` (each holding one pin on its slots) account for."""
        out: Counter[int] = Counter()
        for slots in holders:
            out.update(self._pages(slots))
        return out

    def check(self, holders: list[torch.Tensor | None]) -> None:
        """Raise unless every pin is held by one of ``holders`` and vice versa."""
        expected = self.expected_from(holders)
        if expected != self._pins:
            extra = {p: c for p, c in self._pins.items() if expected.get(p, 0) != c}
            raise InvariantViolation(
                f"host pins out of balance on {len(extra)} page(s), e.g. "
                f"{dict(list(extra.items())[:3])} (expected {dict(list(expected.items())[:3])})")

    @property
    def pinned_pages(self) -> int:
        return len(self._pins)

    def _pages(self, slots: torch.Tensor | None) -> list[int]:
        if slots is None or slots.numel() == 0:
            return []
        return (slots[:: self.page_size] // self.page_size).tolist()
