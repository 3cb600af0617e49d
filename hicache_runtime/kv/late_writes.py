"""Host pages a late writer still holds after they went back to the pool.

Only the ``abort-frees-in-flight`` legacy switch makes such writers (pre-#31296: an aborted
prefetch's pages are freed while its IO thread still reads a batch into them). Which
interleaving that read finishes in decides what the bug does: before a new owner's copy lands
in the pages, the owner's copy covers it and nothing goes wrong; after the owner's copy landed
and before anything read it, every reader of that copy (a load back to L1, the L3 backup)
gets the late data. Left to thread timing the second happens in some runs and not in others,
and a layer-by-layer copy still in progress is half overwritten: the reproduction would show
the bug or not depending on this machine's load.

So the reproduction picks the interleaving that corrupts, as ``faults.rendezvous`` picks the
one that exposes the ack bugs: the writer *arms* its batch's pages before it asks for the
abort; the thread that completes a new owner's copy into an armed page (the write-through ack,
the synchronous write-back copy) reports it and waits, bounded, until the late write landed;
the writer waits for that report and then *disarms*. The owner's copy is then wrong, every
time, before anyone reads it. A prefetch that takes an armed page reports too: its copy comes
from the writer's own IO thread, so the late write lands first and is covered (the same every
time as well). Only when no owner comes within a number of scheduler steps does the writer
land early on free pages.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

LATE_WRITE_WAIT_S = 5.0
"""Longest an owner waits for a late write pending on its pages (the writer, once told, only
writes the batch it already read)."""


class LateWrites:
    """The host pool's armed pages. Cheap when nothing is armed (every run but the legacy
    switch's): an owner's report then returns before taking the lock."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: set[int] = set()
        self._landed: set[int] = set()
        """Armed pages whose new owner's copy is complete (reported, not yet written over)."""
        self._queued: set[int] = set()
        """Armed pages a prefetch took: its copy comes from the writer's own thread, after."""

    @property
    def armed(self) -> bool:
        """Whether any page is armed (read without the lock: a set's truth is atomic)."""
        return bool(self._armed)

    def arm(self, pages: Iterable[int]) -> None:
        """Writer: these pages will be written late, whoever owns them by then."""
        with self._cv:
            self._armed.update(pages)

    def disarm(self, pages: Iterable[int]) -> None:
        """Writer: done with these pages (written or given up); owners waiting go on."""
        pages = set(pages)
        with self._cv:
            self._armed -= pages
            self._landed -= pages
            self._queued -= pages
            self._cv.notify_all()

    def owner(self, pages: Iterable[int]) -> str | None:
        """Writer: ``"copied"`` once a new owner's copy into one of ``pages`` is complete,
        ``"queued"`` once a prefetch took one (its copy follows this thread's write), else
        None."""
        pages = set(pages)
        with self._cv:
            if not self._landed.isdisjoint(pages):
                return "copied"
            return "queued" if not self._queued.isdisjoint(pages) else None

    def wait(self, timeout_s: float) -> None:
        """Writer: sleep until an owner reports or ``timeout_s`` passes."""
        with self._cv:
            self._cv.wait(timeout_s)

    def queued(self, pages: Iterable[int]) -> None:
        """Owner: a prefetch took ``pages``; the IO thread that writes them is the one a late
        write pending on them runs on, so its copy lands after that write."""
        if not self.armed:
            return
        with self._cv:
            self._queued |= self._armed.intersection(pages)
            self._cv.notify_all()

    def copied(self, pages: Iterable[int], timeout_s: float) -> bool:
        """Owner: a copy into ``pages`` is complete and nothing has read it yet. If a late
        write is pending on one of them, report it and wait until it landed; False when it
        did not within ``timeout_s`` (the owner goes on)."""
        if not self.armed:
            return True
        pages = set(pages)
        with self._cv:
            hit = pages & self._armed
            if not hit:
                return True
            self._landed |= hit
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._armed.isdisjoint(pages), timeout_s)
