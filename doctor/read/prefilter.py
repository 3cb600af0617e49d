"""Find the lines of a large buffer that contain any of many literal triggers, fast.

Running ``bytes.find`` once per trigger costs one pass over the data per trigger (~1 GB/s
each), far too slow for ~80 triggers. Instead this is a q-gram filter vectorised with numpy:

1. each trigger is represented by one of its byte pairs, chosen to be the *rarest* pair in a
   sample of the input (so candidate positions are few on normal log lines);
2. the buffer is viewed as little-endian ``uint16`` at even and at odd offsets (zero-copy), and a
   65536-entry table marks the chosen pairs: two gathers and two ``flatnonzero`` find every
   candidate position;
3. each candidate is verified with ``bytes.startswith`` for the triggers that own that pair.

The result is exact (no false positives or negatives); only speed depends on the sample. A
chunk where the chosen pairs turn out common (an input whose head differs from its body, or one
made so) is planned again on its own bytes, so candidates stay few.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from signatures.linear import linear

SAMPLE_BYTES = 1 << 20
DENSE = 64
"""A chunk with more than one candidate per this many bytes gets its own plan."""


class TriggerIndex:
    """Literal multi-pattern line finder. ``plan`` once per input, then ``lines`` per chunk."""

    def __init__(self, triggers: list[bytes]) -> None:
        layout = _pair_layout(frozenset(t for t in triggers if len(t) >= 2))
        self.triggers = layout.triggers
        self._first, self._pairs, self._offset, self._span = (
            layout.first, layout.pairs, layout.offset, layout.span)
        self._table = np.zeros(65536, dtype=np.uint8)
        self._codes = np.zeros(0, dtype=np.int64)  # each trigger's chosen pair
        self._best: list[int] = []  # and its offset in the trigger
        self._owners: dict[int, list[tuple[bytes, int]]] = {}  # filled as pairs are met
        self._any: Any = None  # the triggers as one RE2 alternation, built when first needed
        self.plan(b"")

    def _candidates(self, buf: bytes, end: int) -> np.ndarray:
        return _candidates_of(self._table, buf, end)

    def plan(self, sample: bytes) -> int:
        """Choose each trigger's rarest byte pair as seen in ``sample``. Returns how often
        the chosen pairs occur in (the first ``SAMPLE_BYTES`` of) it."""
        hist = _pair_histogram(sample[:SAMPLE_BYTES])
        table = np.zeros(65536, dtype=np.uint8)  # uint8 + take() beats bool fancy indexing
        self._owners = {}
        if not self.triggers:
            self._table = table
            return 0
        # each trigger's rarest pair, the last of equally rare ones: the smallest key of
        # its segment, where a key orders by count, then by offset from the end
        key = hist[self._pairs] * self._span + (self._span - 1 - self._offset)
        best = self._span - 1 - np.minimum.reduceat(key, self._first) % self._span
        self._codes = self._pairs[self._first + best]
        self._best = best.tolist()
        table[self._codes] = 1
        self._table = table
        return int(hist[np.flatnonzero(table)].sum())

    def _owners_of(self, code: int) -> list[tuple[bytes, int]]:
        """The triggers (in order) whose chosen pair is ``code``, each with the pair's offset
        in it; worked out the first time a chunk holds that pair (a small input meets few)."""
        owners = self._owners.get(code)
        if owners is None:
            owners = self._owners[code] = [(self.triggers[i], self._best[i]) for i in
                                           np.flatnonzero(self._codes == code).tolist()]
        return owners

    def lines(self, buf: bytes, end: int) -> list[int]:
        """Sorted start offsets of the lines in ``buf[:end]`` that contain a trigger."""
        if end < 2:
            return []
        cand = self._candidates(buf, end)
        if cand.size > end // DENSE:
            # The pairs chosen on the input's head are common here (the input changed, or was
            # made to): choose again on this chunk, else every candidate is verified in Python
            found = self.plan(buf[:end])
            if found * end // min(end, SAMPLE_BYTES) > end // DENSE:
                return self._dense_lines(buf, end)  # every pair is common here
            cand = self._candidates(buf, end)
            if cand.size > end // DENSE:
                return self._dense_lines(buf, end)
        if cand.size == 0:
            return []
        cand.sort()
        starts: list[int] = []
        owners_of, find, rfind = self._owners_of, buf.find, buf.rfind
        positions = cand.tolist()
        i, n = 0, len(positions)
        while i < n:
            p = positions[i]
            i += 1
            for trig, off in owners_of(buf[p] | buf[p + 1] << 8):
                s = p - off
                if s >= 0 and s + len(trig) <= end and buf.startswith(trig, s):
                    start = rfind(b"\n", 0, s) + 1
                    line_end = find(b"\n", p, end)
                    if not starts or starts[-1] != start:
                        starts.append(start)
                    # the line is selected: jump past its other candidates (a line made of
                    # trigger fragments holds dozens)
                    i = n if line_end < 0 else bisect_left(positions, line_end, i)
                    break
        return starts


    def _dense_lines(self, buf: bytes, end: int) -> list[int]:
        """:meth:`lines` for a chunk where every pair is common (text made of the triggers'
        fragments): one automaton search per selected line, from the end of the last one,
        instead of verifying hundreds of candidates per line in Python."""
        if self._any is None:
            self._any = _alternation(tuple(self.triggers))
        starts: list[int] = []
        pos, search, find, rfind = 0, self._any.search, buf.find, buf.rfind
        while pos < end:
            m = search(buf, pos, end)
            if m is None:
                break
            starts.append(rfind(b"\n", 0, m.start()) + 1)
            line_end = find(b"\n", m.end(), end)
            pos = end if line_end < 0 else line_end + 1
        return starts


@dataclass(frozen=True)
class _PairLayout:
    """Every trigger's byte pairs laid end to end, so a plan ranks them all in a few numpy
    operations (a Python loop over them cost ~10 ms per input, most of a small input's
    diagnosis): ``pairs[k]`` is pair ``k`` (its two bytes as one little-endian code) at
    ``offset[k]`` in its trigger, ``first[i]`` where trigger ``i``'s pairs start, and ``span``
    exceeds every offset."""

    triggers: list[bytes]
    first: np.ndarray
    pairs: np.ndarray
    offset: np.ndarray
    span: int


@lru_cache(maxsize=8)
def _alternation(triggers: tuple[bytes, ...]) -> Any:
    """The triggers as one RE2 alternation: an index is made per input, its triggers are the
    same few sets (compiling 300 escaped literals each time was a tenth of a small input's
    diagnosis)."""
    return linear(b"|".join(re.escape(t) for t in triggers))


@lru_cache(maxsize=8)
def _pair_layout(triggers: frozenset[bytes]) -> _PairLayout:
    """Made once per trigger set (every input of a process scans for the same triggers)."""
    ordered = sorted(triggers)
    if not ordered:
        empty = np.zeros(0, dtype=np.int64)
        return _PairLayout([], empty, empty, empty, 1)
    lengths = np.array([len(t) - 1 for t in ordered], dtype=np.int64)
    codes = [np.frombuffer(t, dtype=np.uint8).astype(np.int64) for t in ordered]
    return _PairLayout(
        ordered, np.concatenate(([0], np.cumsum(lengths)[:-1])),
        np.concatenate([b[:-1] | b[1:] << 8 for b in codes]),
        np.concatenate([np.arange(n) for n in lengths]), int(lengths.max()) + 1)


def _candidates_of(table: np.ndarray, buf: bytes, end: int) -> np.ndarray:
    even = np.frombuffer(buf, dtype="<u2", count=end // 2)
    odd = np.frombuffer(buf, dtype="<u2", count=(end - 1) // 2, offset=1)
    return np.concatenate((np.flatnonzero(np.take(table, even)) * 2,
                           np.flatnonzero(np.take(table, odd)) * 2 + 1))


def _pair_histogram(sample: bytes) -> np.ndarray:
    if len(sample) < 2:
        return np.zeros(65536, dtype=np.int64)
    even = np.frombuffer(sample, dtype="<u2", count=len(sample) // 2)
    odd = np.frombuffer(sample, dtype="<u2", count=(len(sample) - 1) // 2, offset=1)
    return np.bincount(even, minlength=65536) + np.bincount(odd, minlength=65536)
