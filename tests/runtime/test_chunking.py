"""The dynamic-chunking model: the fit, its refusals, the solved sizes and their guards."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_runtime.engine.chunking import (
    CONTEXT_MARGIN,
    MIN_SAMPLES,
    FitRefused,
    LatencyModel,
    LatencyProfile,
    chunk_schedule,
    fit_or_none,
    profile_sizes,
)

TRUE = LatencyModel(a=2e-9, b=1e-5, c=1e-3)


def _profile(model: LatencyModel, sizes: list[int], warmup: float = 5.0) -> LatencyProfile:
    lat = [model.latency(s) for s in sizes]
    lat[0] *= warmup  # the first forward pays warm-up; the fit must not see it
    return LatencyProfile(tuple(sizes), tuple(lat))


def test_profile_sizes_descend_page_aligned() -> None:
    sizes = profile_sizes(4096, 128, 64)
    assert sizes == sorted(sizes, reverse=True)
    assert len(set(sizes)) == len(sizes)
    assert sizes[0] == 4096
    assert all(s % 64 == 0 and s > 0 for s in sizes)


def test_fit_recovers_the_curve_and_drops_the_warmup_sample() -> None:
    fit = LatencyModel.fit(_profile(TRUE, profile_sizes(4096, 32, 16)))
    assert math.isclose(fit.a, TRUE.a, rel_tol=1e-6)
    assert math.isclose(fit.b, TRUE.b, rel_tol=1e-6)
    # Kept in, the inflated first sample would bend the curve.
    lat = list(_profile(TRUE, profile_sizes(4096, 32, 16)).latencies)
    bent = LatencyModel.fit(LatencyProfile((1, *profile_sizes(4096, 32, 16)),
                                           (0.0, *lat)))
    assert not math.isclose(bent.a, TRUE.a, rel_tol=1e-3)


def test_fit_refuses_too_few_samples_and_a_non_convex_curve() -> None:
    with pytest.raises(FitRefused, match="need at least"):
        LatencyModel.fit(_profile(TRUE, profile_sizes(4096, MIN_SAMPLES, 64)))
    concave = LatencyModel(a=-1e-9, b=1e-4, c=0.0)
    model, why = fit_or_none(_profile(concave, profile_sizes(4096, 32, 16)))
    assert model is None
    assert "quadratic term" in (why or "")
    assert fit_or_none(None) == (None, "no profile")


def test_continuation_chunks_take_the_base_chunks_time_with_the_guards() -> None:
    base, page, context = 2048, 16, 65536
    history = 8192
    size = TRUE.next_chunk(history, base, page, context, smooth=1.0)
    solved = TRUE.solve(history, TRUE.target(base))
    assert solved is not None
    assert size == int(solved) // 64 * 64
    # The chunk's predicted time is the base chunk's, within one alignment step.
    t = TRUE.latency(history + size) - TRUE.latency(history)
    assert t <= TRUE.target(base) < TRUE.latency(history + size + 64) - TRUE.latency(history)
    # Smoothing moves a quarter of the way back toward base.
    smoothed = TRUE.next_chunk(history, base, page, context)
    assert smoothed == int(base + 0.75 * (solved - base)) // 64 * 64
    # Floor base/4 under a very long history; cap at the context's end.
    assert TRUE.next_chunk(10**7, base, page, 10**8) == base // 4
    assert TRUE.next_chunk(8000, base, page, 8000 + CONTEXT_MARGIN + 300) == 256
    # Alignment is max(page, 64).
    assert TRUE.next_chunk(history, base, 256, context) % 256 == 0


def test_no_real_solution_means_base() -> None:
    odd = LatencyModel(a=1e-9, b=-1.0, c=0.0)  # T < 0: f(base) < f(0)
    assert odd.solve(0, odd.target(2048)) is None
    assert odd.next_chunk(4096, 2048, 16, 65536) == 2048


@settings(max_examples=60, deadline=None)
@given(a=st.floats(1e-12, 1e-6), b=st.floats(0, 1e-3), c=st.floats(0, 1e-2),
       total=st.integers(1, 200_000), base=st.sampled_from([256, 1024, 4096]),
       page=st.sampled_from([1, 16, 64, 128]))
def test_schedule_covers_the_prompt_and_repeats_exactly(a: float, b: float, c: float,
                                                        total: int, base: int,
                                                        page: int) -> None:
    model = LatencyModel(a, b, c)
    sched = chunk_schedule(model, total, base, page, context=total + 10_000)
    assert sum(sched) == total
    assert all(s > 0 for s in sched)
    assert sched[0] == min(base, total)


def test_every_rank_fits_the_same_model_from_the_broadcast_payload() -> None:
    """The payload crosses ranks as JSON-able lists; each rank's fit and schedule are equal."""
    sizes = profile_sizes(4096, 128, 64)
    noisy = [TRUE.latency(s) * (1 + 0.03 * math.sin(i)) for i, s in enumerate(sizes)]
    payload = json.loads(json.dumps(LatencyProfile(tuple(sizes), tuple(noisy)).as_payload()))
    fits = [LatencyModel.fit(LatencyProfile.from_payload(payload)) for _ in range(4)]
    assert len(set(fits)) == 1
    schedules = {tuple(chunk_schedule(f, 60_000, 4096, 64, 131072)) for f in fits}
    assert len(schedules) == 1
