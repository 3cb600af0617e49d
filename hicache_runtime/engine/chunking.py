"""Dynamic chunking: continuation chunks sized for equal forward latency, not equal tokens.

With a fixed chunk size, each later chunk of a long prefill costs more than the one before
(attention over a longer history), so the pipeline stages holding it take longer than the
stages holding a neighbour's chunk, and the others wait: a bubble that grows with context.
Dynamic chunking fits the forward latency of a chunk of ``l`` tokens after a history of ``L``
as ``f(L + l) - f(L)`` with ``f(l) = a·l² + b·l + c``, and sizes each continuation chunk so
that its predicted latency equals that of a base-sized first chunk: it solves
``f(L + x) - f(L) = T`` with ``T = f(base) - f(0)``.

What crosses ranks is the profile's raw samples (``seq_lens`` and latencies measured on PP0),
never a rank's own timings: every rank fits the same data with the same deterministic least
squares, so :meth:`LatencyModel.next_chunk` is a pure function of the history length and every
rank of the grid cuts the same chunk with no communication at run time. Measuring on every rank
instead is the legacy ``per-rank-chunk-timing`` form: ranks time differently, fit different
curves and cut different chunks.

The numeric guards are upstream's: the first sample is dropped (it pays warm-up), fewer than
:data:`MIN_SAMPLES` samples or ``a <= 0`` refuse the fit (the caller falls back to the fixed
chunk), the smoothed size is never below ``base // 4``, is aligned down to ``max(page, 64)``,
and leaves ``context - L - 100`` tokens of room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Fewer samples than this (after the warm-up one is dropped) refuse the fit.
MIN_SAMPLES = 8
#: How far a continuation chunk moves from the base toward the solved size (1 = all the way).
SMOOTH_FACTOR = 0.75
#: Chunks are multiples of ``max(page, MIN_ALIGNMENT)``.
MIN_ALIGNMENT = 64
#: Tokens left free at the end of the context.
CONTEXT_MARGIN = 100


class FitRefused(ValueError):
    """The profile cannot give a usable model; the reason is the message."""


@dataclass(frozen=True)
class LatencyProfile:
    """Raw samples measured on PP0: the forward latency (seconds) of one chunk of
    ``seq_lens[i]`` tokens from an empty history, in the order they were taken (descending
    sizes, the first paying warm-up)."""

    seq_lens: tuple[int, ...]
    latencies: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.seq_lens) != len(self.latencies):
            raise ValueError("a profile needs one latency per sequence length")

    def as_payload(self) -> dict[str, list[float] | list[int]]:
        """What PP0 broadcasts: plain lists, so every rank rebuilds the same profile."""
        return {"seq_lens": list(self.seq_lens), "latencies": list(self.latencies)}

    @classmethod
    def from_payload(cls, payload: dict[str, list]) -> LatencyProfile:
        return cls(tuple(int(v) for v in payload["seq_lens"]),
                   tuple(float(v) for v in payload["latencies"]))


def profile_sizes(base: int, count: int, page: int) -> list[int]:
    """The descending chunk sizes to profile: ``count`` sizes from ``base`` down to about
    ``base / count``, each a positive multiple of ``page``, no size twice."""
    if base <= 0 or count <= 0 or page <= 0:
        raise ValueError("base, count and page must be positive")
    sizes: list[int] = []
    for i in range(count):
        size = max(page, (base - i * base // count) // page * page)
        if not sizes or size < sizes[-1]:
            sizes.append(size)
    return sizes


@dataclass(frozen=True)
class LatencyModel:
    """``f(l) = a·l² + b·l + c`` in seconds, fitted from a :class:`LatencyProfile`."""

    a: float
    b: float
    c: float

    @classmethod
    def fit(cls, profile: LatencyProfile) -> LatencyModel:
        """Deterministic least squares over every sample but the first. Raises
        :class:`FitRefused` with the reason when the profile cannot give a usable model."""
        xs = np.asarray(profile.seq_lens[1:], dtype=np.float64)
        ys = np.asarray(profile.latencies[1:], dtype=np.float64)
        if len(xs) < MIN_SAMPLES:
            raise FitRefused(f"{len(xs)} usable samples, need at least {MIN_SAMPLES}")
        if not (np.all(np.isfinite(xs)) and np.all(np.isfinite(ys))):
            raise FitRefused("a sample is not a finite number")
        design = np.stack([xs * xs, xs, np.ones_like(xs)], axis=1)
        (a, b, c), *_ = np.linalg.lstsq(design, ys, rcond=None)
        if not a > 0:
            raise FitRefused(f"the fitted quadratic term is {a:.3e} (must be > 0)")
        return cls(float(a), float(b), float(c))

    def latency(self, seq_len: float) -> float:
        return self.a * seq_len * seq_len + self.b * seq_len + self.c

    def target(self, base: int) -> float:
        """``T``: the predicted latency of a base-sized chunk from an empty history."""
        return self.latency(base) - self.latency(0)

    def solve(self, history: int, target: float) -> float | None:
        """The real ``x > 0`` with ``f(L + x) - f(L) = T``, or None when there is none.
        Expanded: ``a·x² + (2aL + b)·x - T = 0``; a target that is not positive (a curve
        that falls at the start) has no meaningful chunk."""
        if not target > 0:
            return None
        quad_b = 2 * self.a * history + self.b
        disc = quad_b * quad_b + 4 * self.a * target
        if disc < 0:
            return None
        x = (-quad_b + math.sqrt(disc)) / (2 * self.a)
        return x if x > 0 else None

    def next_chunk(self, history: int, base: int, page: int, context: int, *,
                   smooth: float = SMOOTH_FACTOR) -> int:
        """The size of the continuation chunk after ``history`` tokens: the solved size
        moved ``smooth`` of the way from ``base``, at least ``base // 4``, aligned down to
        ``max(page, 64)`` and capped at ``context - history - 100``. No solution: ``base``."""
        solved = self.solve(history, self.target(base))
        if solved is None:
            return base
        size = max(int(base + smooth * (solved - base)), base // 4)
        align = max(page, MIN_ALIGNMENT)
        size = max(align, size // align * align)
        # Room at the end of the context, aligned again; too little room for one aligned
        # chunk leaves the choice to the caller's own cap (the tokens the request has left).
        aligned = min(size, context - history - CONTEXT_MARGIN) // align * align
        return aligned if aligned >= align else base


def chunk_schedule(model: LatencyModel | None, total: int, base: int, page: int,
                   context: int) -> list[int]:
    """The chunk sizes a prefill of ``total`` tokens is cut into: the first chunk is ``base``
    and each continuation is sized by ``model`` (``None``: fixed ``base`` chunks)."""
    out: list[int] = []
    done = 0
    while done < total:
        size = base if model is None or done == 0 else model.next_chunk(done, base, page, context)
        size = min(max(size, 1), total - done)
        out.append(size)
        done += size
    return out


def fit_or_none(profile: LatencyProfile | None) -> tuple[LatencyModel | None, str | None]:
    """The model, or None with the reason the caller warns with before falling back to the
    fixed chunk size."""
    if profile is None:
        return None, "no profile"
    try:
        return LatencyModel.fit(profile), None
    except FitRefused as exc:
        return None, str(exc)

