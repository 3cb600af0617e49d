"""Matching a report's line against upstream's templates, token by token.

The index's templates are tokenised once (:mod:`signatures.index.tokens`) and every token
weighted by how rare it is among all templates (``log2(N / df)``: ``failed`` says little,
``BatchQuerySlices`` a lot). A line's candidates are the templates that share its rarer
tokens; each candidate is scored by the weight of its tokens the line holds *in order*
(recall), less a penalty for line tokens that sit between two matched tokens where the
template has no wildcard (words the template does not have). A line that differs from the
template by a word still matches, with a lower similarity; a template that fixes too little
(``Failed to {*}``) is never matched: it names no component.

Lines repeat (the same failure every step), so results are cached by the line's shape
(numbers folded); the cache is bounded.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from signatures.index.failures import interpreter_message
from signatures.index.model import Template
from signatures.index.tokens import literal_text, template_words, words

MIN_SIMILARITY = 0.7
"""Below this a line is not taken for the template."""
MIN_WEIGHT = 14.0
"""A template whose tokens weigh less than this (in bits) is too generic to match alone."""
MIN_TOKENS = 3
EXACT_UP_TO = 4
"""A template of this many tokens or fewer matches only whole: a short phrase with a word
missing is another phrase."""
MAX_CANDIDATES = 40
MAX_LINE_TOKENS = 120
CACHE_SIZE = 4096
MAX_TIES = 8
"""Readings kept per line: the same message is often built in several files and releases."""
_SHAPE = re.compile(r"0[xX][0-9a-fA-F]+|\d+")


@dataclass(frozen=True, slots=True)
class Match:
    template: Template
    similarity: float
    """1.0 when every token of the template is on the line, in order, with nothing foreign
    between tokens the template keeps together."""


class TemplateMatcher:
    """An inverted index over templates' tokens, and the scorer."""

    def __init__(self, templates: Sequence[Template]) -> None:
        self.templates = templates
        toks = [template_words(t.text) for t in templates]
        df: Counter[str] = Counter()
        for ts in toks:
            df.update({t for t in ts if t is not None})
        n = max(1, len(templates))
        self._weight = {t: max(0.5, math.log2(n / c)) for t, c in df.items()}
        max_df = max(50, n // 100)
        postings: dict[str, list[int]] = {}
        self._tokens: list[tuple[str | None, ...]] = []
        self._total: list[float] = []
        for i, ts in enumerate(toks):
            lits = [t for t in ts if t is not None]
            total = sum(self._weight[t] for t in lits)
            self._tokens.append(tuple(ts))
            self._total.append(total)
            if len(lits) < MIN_TOKENS or total < MIN_WEIGHT \
                    or interpreter_message(literal_text(templates[i].text)):
                continue
            for t in set(lits):
                if df[t] <= max_df:
                    postings.setdefault(t, []).append(i)
        self._postings = postings
        self._cache: dict[str, list[Match]] = {}

    def weight(self, token: str) -> float:
        return self._weight.get(token, math.log2(max(2, len(self.templates))))

    def match(self, text: str, limit: int = 3) -> list[Match]:
        """The templates ``text`` was most likely printed from, best first (ties within 0.05
        of the best, at most ``limit``); empty when none reaches ``MIN_SIMILARITY``."""
        key = _SHAPE.sub("0", text[:400])
        hit = self._cache.get(key)
        if hit is None:
            hit = self._match(text, MAX_TIES)
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = hit
        return hit[:limit]

    def _match(self, text: str, limit: int) -> list[Match]:
        if interpreter_message(text):
            return []  # the interpreter wrote it: no upstream template can own it
        line = words(text)[:MAX_LINE_TOKENS]
        if len(line) < 2:
            return []
        positions: dict[str, list[int]] = {}
        for i, t in enumerate(line):
            positions.setdefault(t, []).append(i)
        counts: Counter[int] = Counter()
        for t in positions:
            for tid in self._postings.get(t, ()):
                counts[tid] += 1
        scored: list[tuple[float, float, int]] = []
        for tid, _n in counts.most_common(MAX_CANDIDATES):
            s, explained = self._score(tid, positions, len(line))
            if s >= MIN_SIMILARITY:
                scored.append((s, explained, tid))
        if not scored:
            return []
        best = max(s for s, _, _ in scored)
        # near the best, the template that explains more of the line wins (a longer message
        # with a word changed over a shorter one with a word added)
        close = sorted((x for x in scored if x[0] >= best - 0.05),
                       key=lambda x: (-x[1], -x[0], x[2]))
        return [Match(self.templates[tid], round(s, 3)) for s, _, tid in close[:limit]]

    def _score(self, tid: int, positions: dict[str, list[int]],
               n_line: int) -> tuple[float, float]:
        """(similarity, weight of the line's tokens the template explains)."""
        matched = 0.0
        found = 0
        extra = 0
        pos = -1
        glued = False  # the previous template token was a literal (no wildcard since)
        slack = 0  # template tokens missed since the last match: a changed word fills one
        for tok in self._tokens[tid]:
            if tok is None:
                glued = False
                continue
            lst = positions.get(tok)
            j = bisect_right(lst, pos) if lst else 0
            if lst and j < len(lst):
                idx = lst[j]
                if glued and pos >= 0:
                    extra += max(0, idx - pos - 1 - slack)
                matched += self._weight[tok]
                found += 1
                pos = idx
                slack = 0
            else:
                slack += 1
            glued = True
        total = self._total[tid]
        if total <= 0:
            return 0.0, 0.0
        n_lit = sum(1 for t in self._tokens[tid] if t is not None)
        missing = n_lit - found
        # a long template may miss a word in four (another release's wording); a short one none
        if missing > (0 if n_lit <= EXACT_UP_TO else max(1, n_lit // 4)):
            return 0.0, 0.0
        recall = matched / total
        penalty = min(0.5, extra / max(4, n_line))
        return recall * (1 - penalty), matched
