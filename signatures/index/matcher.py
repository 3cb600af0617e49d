"""Matching a report's line against upstream's templates, token by token.

Every template's tokens come with the index (:mod:`signatures.index.model`, computed by
:func:`signatures.index.tokens.template_words` when the index was built), as one array of
vocabulary ids. Each token is weighted by how rare it is among all templates
(``log2(N / df)``: ``failed`` says little, ``BatchQuerySlices`` a lot). A line's candidates are
the templates that share its rarer tokens (an inverted index, built with numpy when the index
loads); each candidate is scored by the weight of its tokens the line holds *in order*
(recall), less a penalty for line tokens that sit between two matched tokens where the template
has no wildcard (words the template does not have). A line that differs from the template by a
word still matches, with a lower similarity; a template that fixes too little (``Failed to
{*}``) is never matched: it names no component.

Lines repeat (the same failure every step), so results are cached by the line's shape
(numbers folded); the cache is bounded.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from signatures.index.failures import interpreter_message
from signatures.index.model import Template
from signatures.index.tokens import words

MIN_SIMILARITY = 0.7
"""Below this a line is not taken for the template."""
MIN_WEIGHT = 14.0
"""A template whose tokens weigh less than this (in bits) is too generic to match alone."""
MIN_TOKENS = 3
EXACT_UP_TO = 4
"""A template of this many tokens or fewer matches only whole: a short phrase with a word
missing is another phrase."""
MAX_CANDIDATES = 400
MAX_LINE_TOKENS = 120
CACHE_SIZE = 4096
MAX_TIES = 8
"""Readings kept per line: the same message is often built in several files and releases."""
ANCHOR_SLACK = 2
PREFIX_SIMILARITY = 0.75
"""A line that is a template's opening sentence whole (see ``TemplateMatcher._prefix``): the
rest of the message cut by the paste, or not yet in the release that printed it."""
PREFIX_MIN_TOKENS = 6
PREFIX_MIN_WEIGHT = 2 * MIN_WEIGHT
_SENTENCE_END = (".", ":", "!")
#: What a quoted condition compares with (a line with none of them and no "assert" is no
#: bare assert's report).
_COMPARISONS = ("==", "!=", "<=", ">=", " < ", " > ", " is not ", " not in ", "isinstance(")
OPTIONAL_WORDS = ("assert", "self")
"""Template words a line may lack at no cost (see ``TemplateMatcher._optional``)."""
_SHAPE = re.compile(r"0[xX][0-9a-fA-F]+|\d+")
NEAR_MIN = 6
"""A line's word of this many letters or more that no template has is read as the template
word one edit away (a letter changed, added, dropped or two swapped: ``PR0CESSING``,
``recieve``), when exactly one word is that close."""
NEAR_CREDIT = 0.5
"""What such a word weighs, as a share of the word it stands for: a misspelt word is weaker
evidence than the word itself."""


@dataclass(frozen=True, slots=True)
class Match:
    template: Template
    similarity: float
    """1.0 when every token of the template is on the line, in order, with nothing foreign
    between tokens the template keeps together."""
    anchored: bool = True
    """The template accounts for the line's start: it opens with a wildcard, or its first
    word is among the line's first ``ANCHOR_SLACK + 1`` (an exception type may precede it).
    A template that fits only a phrase further in may be a quotation of another message."""


class TemplateMatcher:
    """An inverted index over templates' tokens, and the scorer.

    ``tokens`` holds every template's token ids back to back (-1 where a wildcard stands),
    ``offsets[i]:offsets[i + 1]`` template ``i``'s; ``vocab`` names the ids."""

    def __init__(self, templates: Sequence[Template], vocab: list[str], tokens: np.ndarray,
                 offsets: np.ndarray) -> None:
        self.templates = templates
        self._vocab = {w: i for i, w in enumerate(vocab)}
        self._toks = tokens.astype(np.int32, copy=False)
        self._offs = offsets.astype(np.int64, copy=False)
        n = max(1, len(offsets) - 1)
        v = max(1, len(vocab))
        owner = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(self._offs))
        lit = self._toks >= 0
        lit_owner, lit_tok = owner[lit], self._toks[lit].astype(np.int64)
        pairs = _sorted_unique(lit_owner * v + lit_tok)  # each (template, token) once
        pair_owner, pair_tok = pairs // v, pairs % v
        df = np.bincount(pair_tok, minlength=v)
        with np.errstate(divide="ignore"):
            weight = np.maximum(0.5, np.log2(n / np.maximum(df, 1)))
        self._weight = weight
        # the words a bare assert's template adds to its condition: an AssertionError's message
        # (or a report quoting the condition) seldom has them, so their absence costs nothing
        self._optional = np.zeros(v, dtype=bool)
        for w in OPTIONAL_WORDS:
            if w in self._vocab:
                self._optional[self._vocab[w]] = True
        self._total = np.bincount(lit_owner, weights=weight[lit_tok], minlength=n)
        self._nlit = np.bincount(lit_owner, minlength=n)
        # a template that fixes too little names no component, but it is still indexed: a line
        # it explains whole must not be taken for a longer template it resembles
        self._generic = ~((self._nlit >= MIN_TOKENS) & (self._total >= MIN_WEIGHT))
        # the scorer reads these one element at a time, hundreds of thousands of times per
        # corpus: Python lists answer that several times faster than numpy scalar indexing
        self._weight_at: list[float] = weight.tolist()
        self._optional_at: list[bool] = self._optional.tolist()
        # a bare assert's condition ("assert self.layout == 'page_first'") is printed only
        # where the assertion is (its traceback line, an AssertionError, a quote of the
        # condition): a line that neither says "assert" nor compares anything and holds the
        # same words (a server-args echo, layout='page_first') was not printed by it, however
        # rare its words
        self._bare_assert = np.array([t.startswith("assert ") for t in _texts(templates)],
                                     dtype=bool)
        max_df = max(50, n // 100)
        # every template is reachable through its rarest token, common or not (a generic
        # message has no rare one), and through every rare one
        pair_w = weight[pair_tok]
        order0 = np.lexsort((-pair_w, pair_owner))
        first = np.ones(len(order0), dtype=bool)
        first[1:] = pair_owner[order0][1:] != pair_owner[order0][:-1]
        rarest = np.zeros(len(pairs), dtype=bool)
        rarest[order0[first]] = True
        keep = (self._nlit[pair_owner] >= 2) & ((df[pair_tok] <= max_df) | rarest)
        order = np.argsort(pair_tok[keep], kind="stable")
        self._post = pair_owner[keep][order]
        self._ptr = np.searchsorted(pair_tok[keep][order], np.arange(v + 1))
        self._cache: dict[str, list[Match]] = {}
        # for the scorer's first test, done for all candidates at once: a template whose
        # required literals (not optional words) are missing from the line more times than
        # it may miss any is no match, wherever the others are
        self._required = lit & ~self._optional[np.maximum(self._toks, 0)]
        self._allowed = np.array([_allowed_misses(int(k)) for k in self._nlit.tolist()],
                                 dtype=np.int64)
        self._tok_lists: dict[int, list[int]] = {}
        # every vocabulary word of NEAR_MIN letters or more under each of its one-letter
        # deletions (-2 where two words share one): two words one edit apart share a deletion
        # or one is a deletion of the other (the symmetric-deletion scheme)
        self._near: dict[str, int] = {}
        for i, w in enumerate(vocab):
            if len(w) >= NEAR_MIN:
                for k in range(len(w)):
                    d = w[:k] + w[k + 1:]
                    self._near[d] = i if self._near.get(d, i) == i else -2

    def _nearest(self, word: str) -> int:
        """The one vocabulary word one edit from ``word`` (an unknown word), or -1."""
        found: set[int] = set()
        for d in {word[:k] + word[k + 1:] for k in range(len(word))} | {word}:
            hit = self._near.get(d, -1)
            if hit == -2:
                return -1
            if hit >= 0:
                found.add(hit)
            if d != word and len(d) >= NEAR_MIN:
                found.add(self._vocab.get(d, -1))
        found.discard(-1)
        return found.pop() if len(found) == 1 else -1

    def tokens_of(self, tid: int) -> list[int]:
        toks = self._tok_lists.get(tid)
        if toks is None:
            toks = self._tok_lists[tid] = self._toks[self._offs[tid]:self._offs[tid + 1]].tolist()
        return toks

    def _possible(self, cands: np.ndarray, present: np.ndarray) -> np.ndarray:
        """The candidates that miss no more required literals than they may: a literal of the
        template that is nowhere on the line is a miss wherever the others are, so any other
        candidate scores 0 (exactly what :meth:`_score` would find, word by word)."""
        starts = self._offs[cands]
        lengths = self._offs[cands + 1] - starts
        # every candidate's token positions, back to back, and whose each one is
        owner = np.repeat(np.arange(len(cands)), lengths)
        at = starts[owner] + np.arange(len(owner)) - (np.cumsum(lengths) - lengths)[owner]
        absent = self._required[at] & ~present[np.maximum(self._toks[at], 0)]
        misses = np.bincount(owner, weights=absent, minlength=len(cands))
        return cands[misses <= self._allowed[cands]]

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
        toks = words(text)[:MAX_LINE_TOKENS]
        ids = [self._vocab.get(w, -1) for w in toks]
        if len(ids) < 2:
            return []
        positions: dict[int, list[int]] = {}
        near: set[int] = set()  # line positions of words read as a word one edit away
        for i, t in enumerate(ids):
            if t < 0 and len(toks[i]) >= NEAR_MIN:
                t = self._nearest(toks[i])
                if t >= 0:
                    near.add(i)
            if t >= 0:
                positions.setdefault(t, []).append(i)
        slices = [self._post[self._ptr[t]:self._ptr[t + 1]] for t in positions]
        if not slices:
            return []
        # a candidate ranks by the weight of the line's tokens that reach it, not by their
        # count: a template of common words is reachable through its rarest one only, and a
        # count would drop it behind a hundred templates that share two common words
        owners = np.concatenate(slices)
        reach = np.concatenate([np.full(len(s), self._weight[t]) for t, s in
                                zip(positions, slices, strict=True)])
        cands, inverse = np.unique(owners, return_inverse=True)
        if len(cands) > MAX_CANDIDATES:
            gain = np.bincount(inverse, weights=reach, minlength=len(cands))
            top = np.argpartition(-gain, MAX_CANDIDATES - 1)[:MAX_CANDIDATES]
            cands = cands[top]
        scored: list[tuple[float, float, int]] = []
        anchored: dict[int, bool] = {}
        says_assert = "assert" in text.lower() or any(op in text for op in _COMPARISONS)
        present = np.zeros(len(self._weight), dtype=bool)
        present[list(positions)] = True
        for tid in self._possible(cands, present).tolist():
            if not says_assert and self._bare_assert[tid]:
                continue
            s, explained, first = self._score(tid, positions, len(ids), near)
            if s >= MIN_SIMILARITY:
                scored.append((s, explained, tid))
                anchored[tid] = self._toks[self._offs[tid]] < 0 or 0 <= first <= ANCHOR_SLACK
        if not scored:
            return self._prefix(text, ids, cands.tolist())
        best = max(s for s, _, _ in scored)
        # near the best, the template that explains more of the line wins (a longer message
        # with a word changed over a shorter one with a word added)
        close = sorted((x for x in scored if x[0] >= best - 0.05),
                       key=lambda x: (-x[1], -x[0], x[2]))
        if self._generic[close[0][2]]:
            # a generic message explains the line best: it names no component, unless the
            # line is word for word the opening of a longer message (a generic one, "assert
            # CANDIDATES <= 32", takes a word of it and leaves the rest unexplained)
            return self._prefix(text, ids, cands.tolist())
        return [Match(self.templates[tid], round(s, 3), anchored[tid])
                for s, _, tid in close[:limit] if not self._generic[tid]]

    def _prefix(self, text: str, ids: list[int], cands: list[int]) -> list[Match]:
        """The template whose opening sentence the line is, word for word: the line ends a
        sentence (a logger's trailing call site aside), every one of its tokens (after at
        most ``ANCHOR_SLACK`` leading ones, an exception type) is the template's next literal
        in order, the template goes on past them after a sentence end, and what the line
        holds weighs at least ``PREFIX_MIN_WEIGHT`` (a short generic opening names nothing).
        Read at ``PREFIX_SIMILARITY``: the line is part of the message, not all of it."""
        body = _without_call_site(text)
        if not body.endswith(_SENTENCE_END):
            return []
        if body != text:
            ids = [self._vocab.get(w, -1) for w in words(body)[:MAX_LINE_TOKENS]]
        best: tuple[float, int] | None = None
        for tid in cands:
            if self._generic[tid]:
                continue
            toks = self.tokens_of(tid)
            for start in range(min(ANCHOR_SLACK, len(ids) - PREFIX_MIN_TOKENS) + 1):
                line = ids[start:]
                if len(line) < PREFIX_MIN_TOKENS or len(line) >= len(toks) \
                        or toks[:len(line)] != line:
                    continue
                w = float(self._weight[np.asarray(line)].sum())
                if w >= PREFIX_MIN_WEIGHT and _goes_on(self.templates[tid].text) \
                        and (best is None or w > best[0]):
                    best = (w, tid)
                break
        if best is None:
            return []
        return [Match(self.templates[best[1]], PREFIX_SIMILARITY, True)]

    def _score(self, tid: int, positions: dict[int, list[int]], n_line: int,
               near: AbstractSet[int] = frozenset()) -> tuple[float, float, int]:
        """(similarity, weight of the line's tokens the template explains, the line position
        of its first matched token or -1). A token at a position in ``near`` (a misspelling
        of the template's word) counts ``NEAR_CREDIT`` of its weight."""
        matched = 0.0
        extra = 0
        pos = -1
        glued = False  # the previous template token was a literal (no wildcard since)
        slack = 0  # template tokens missed since the last match: a changed word fills one
        first = -1
        skipped_w, skipped_n = 0.0, 0
        missed = 0  # literals neither found nor optional: past the allowance, no match
        n_all = int(self._nlit[tid])
        allowed = _allowed_misses(n_all)
        weight, optional = self._weight_at, self._optional_at
        for tok in self.tokens_of(tid):
            if tok < 0:
                glued = False
                continue
            lst = positions.get(tok)
            j = bisect_right(lst, pos) if lst else 0
            if lst and j < len(lst):
                idx = lst[j]
                if glued and pos >= 0:
                    extra += max(0, idx - pos - 1 - slack)
                matched += weight[tok] * (NEAR_CREDIT if idx in near else 1.0)
                pos = idx
                if first < 0:
                    first = idx
                slack = 0
            elif optional[tok]:
                skipped_w += weight[tok]
                skipped_n += 1
                allowed = _allowed_misses(n_all - skipped_n)
                continue
            else:
                slack += 1
                missed += 1
                # a long template may miss a word in four (another release's wording), a
                # short one none; the allowance only shrinks as optional words are skipped:
                # past it now, past it at the end (most candidates stop here, a word or two in)
                if missed > allowed:
                    return 0.0, 0.0, -1
            glued = True
        if missed > allowed:  # optional words skipped after the last miss shrank it
            return 0.0, 0.0, -1
        total = float(self._total[tid]) - skipped_w
        if total <= 0:
            return 0.0, 0.0, -1
        recall = matched / total
        penalty = min(0.5, extra / max(4, n_line))
        return recall * (1 - penalty), matched, first

    @property
    def size(self) -> int:
        return len(self._offs) - 1


def _texts(templates: Sequence[Template]) -> Iterable[str]:
    """The templates' texts; the index's own sequence reads them without building each
    template (``Templates.texts``)."""
    texts = getattr(templates, "texts", None)
    return texts() if callable(texts) else (t.text for t in templates)


def _allowed_misses(n_lit: int) -> int:
    """Literals a template of ``n_lit`` may miss and still match: a long one a word in four
    (another release's wording), a short one none."""
    return 0 if n_lit <= EXACT_UP_TO else max(1, n_lit // 4)


def _goes_on(template: str) -> bool:
    """The template holds a sentence end before its last words (``. `` or ``: ``): the
    message has an opening sentence a line can be."""
    body = template.rstrip()
    return any(f"{end} " in body for end in _SENTENCE_END)


def _without_call_site(text: str) -> str:
    """``text`` less trailing blanks and a logger's trailing call site after the message
    (LMCache's ``(file.py:724:module)``: 1-200 characters in parentheses, none of them a
    parenthesis). From the end, by hand: the pattern ``(?:\\s*\\([^()]{1,200}\\))?\\s*$``
    retried a run of blanks from every start in it (quadratic: 8 KB of blanks then a word,
    0.78 s per line)."""
    body = text.rstrip()
    if body.endswith(")"):
        start = body.rfind("(")
        inside = body[start + 1:-1]
        if start >= 0 and 1 <= len(inside) <= 200 and ")" not in inside:
            return body[:start].rstrip()
    return body


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """``np.unique(x)`` for a flat integer array, by a sort and a mask. numpy 2.4's
    ``np.unique`` takes a hash table for integers and sorts its result afterwards: over the
    index's literal (template, token) pairs it took 0.21 s of the matcher's 0.44 s build,
    which every ``hicache doctor`` command pays; the sort takes about a tenth of that."""
    s = np.sort(x)  # equal integers are alike: no need for a stable sort (twice as slow)
    keep = np.empty(len(s), dtype=bool)
    keep[:1] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]
