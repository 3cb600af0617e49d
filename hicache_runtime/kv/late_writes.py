"""Host pages a late writer still holds after they went back to the pool.

Only the ``abort-frees-in-flight`` legacy switch makes such writers (pre-#31296: an aborted
prefetch's pages are freed while its IO thread still reads a batch into them). The batch's
bytes reach the pages whenever that read finishes: a transfer into registered host memory
(RDMA, a storage daemon's DMA) completes on its own time, not the giving-up thread's. When
it lands decides what the bug does: into free pages or under a copy still to come, nothing
goes wrong; on a new owner's complete copy, every later reader of that copy (a load back to
L1, the L3 backup) gets the late data. Left to thread timing, whether a corrupted copy was
ever loaded back before L2 evicted it varied with this machine's load (measured with the
late write landing right after a new owner's copy: 1 to 17 outputs differ per run beside
two busy loops, and a CI run in which none did).

So the reproduction picks the interleaving that corrupts and shows, as ``faults.rendezvous``
picks the one that exposes the ack bugs: the writer *arms* its batch's pages before it asks
for the abort and, once the abort freed them, *posts* the late write (the bytes it read and
how to land them); the IO thread goes on. The write lands when a load-back is about to read
one of its pages into L1 (``CacheController.start_loading`` calls :meth:`reading`), in that
thread, before the read: the pages then hold a new owner's complete copy (only a backed-up
node is evicted from L1, and only an evicted node is loaded back), and the load reads the
late data, every time. A write whose pages nobody loads back never lands (it would have
corrupted nothing anyone read); the run summary counts writes posted and writes read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

LATE_WRITE_WAIT_S = 5.0
"""Longest a load-back waits for the writer to post a write armed on its pages (the writer
has read its batch or is reading it; it posts right after the abort it asked for)."""


@dataclass
class _Posted:
    pages: frozenset[int]
    land: Callable[[], None]


class LateWrites:
    """The host pool's armed pages and posted late writes. Cheap when nothing is armed (every
    run but the legacy switch's): a reader returns before taking the lock."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._unposted: set[int] = set()
        """Armed pages whose writer is still reading its batch."""
        self._posted: list[_Posted] = []
        """Late writes waiting for a reader, oldest first (the order they land in)."""

    @property
    def armed(self) -> bool:
        """Whether any write is armed or posted (read without the lock: a container's truth
        is atomic)."""
        return bool(self._unposted) or bool(self._posted)

    @property
    def pending(self) -> int:
        """Posted late writes that have not landed."""
        with self._cv:
            return len(self._posted)

    def arm(self, pages: Iterable[int]) -> None:
        """Writer: these pages will be written late, whoever owns them by then."""
        with self._cv:
            self._unposted.update(pages)

    def disarm(self, pages: Iterable[int]) -> None:
        """Writer: no late write comes for these pages (the abort freed nothing, or reading
        the batch failed)."""
        with self._cv:
            self._unposted -= set(pages)
            self._cv.notify_all()

    def post(self, pages: Iterable[int], land: Callable[[], None]) -> None:
        """Writer: the late write of ``pages``; ``land`` writes its bytes (called once, in the
        thread of the load-back that reads one of the pages first)."""
        posted = _Posted(frozenset(pages), land)
        with self._cv:
            self._posted.append(posted)
            self._unposted -= posted.pages
            self._cv.notify_all()

    def reading(self, pages: Iterable[int], timeout_s: float) -> bool:
        """Reader: a load-back is about to read ``pages``. Every late write posted on one of
        them lands first, in posting order; a writer still reading a batch for one of them
        is waited for up to ``timeout_s``. False when it had not posted by then (the
        load-back goes on)."""
        if not self.armed:
            return True
        pages = set(pages)
        with self._cv:
            posted = self._cv.wait_for(lambda: self._unposted.isdisjoint(pages), timeout_s)
            due = [w for w in self._posted if not w.pages.isdisjoint(pages)]
            self._posted = [w for w in self._posted if w.pages.isdisjoint(pages)]
        for w in due:  # outside the lock: the pages are this reader's until it reads them
            w.land()
        return posted
