"""The start-up latency profile of dynamic chunking, and the model every rank cuts chunks with.

Fixed form (upstream after #37669 and #37675): PP0 times real forwards of its stage on dummy
chunks of descending sizes (``chunking.profile_sizes`` from 1.25 x the base chunk down; every
TP rank of PP0 runs them, since the forward's all_reduce needs them all); global rank 0's raw
samples reach every rank in one broadcast over the world group; every rank fits them with the
same deterministic least squares (``chunking.LatencyModel.fit``). From then on a continuation
chunk's size is a pure function of the request's history, the same on every rank, and nothing
is exchanged at run time. A profile that fails (an exception while timing) travels as ``None``
and every rank falls back to the fixed chunk size together; a refused fit is refused on every
rank alike, because every rank fits the same samples.

``per-rank-chunk-timing`` (legacy, upstream 0.5.12 to 0.5.16 on attention-CP ranks): every rank
times its own stage, takes part in the broadcast but drops what it received, and fits its own
samples. Stages cost differently and timings are noisy, so the ranks fit different curves and
cut different chunks; a downstream stage then views the hidden states it received with its
own, different batch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from faults.points import FaultPoint
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.engine.chunking import LatencyModel, LatencyProfile, fit_or_none, profile_sizes
from hicache_runtime.engine.loop import act_at
from hicache_runtime.engine.model import ForwardBatch
from hicache_runtime.engine.rank import RankRuntime
from hicache_runtime.kv.pools import DeviceKVPool

log = logging.getLogger(__name__)

PROFILE_STEP = 0
"""The scheduler step fault selectors see while the profile runs (before the first step)."""
PROBE_MARGIN = 1.25
"""The largest profiled chunk is this many times the base chunk (upstream's probe margin)."""
SAMPLES_SOURCE = 0
"""The global rank whose samples every rank fits (a PP0 rank)."""
TIMINGS_PER_SIZE = 3
"""Forwards timed per size, the fastest kept as its sample: on a shared CPU, preemption only
ever adds time, and one slow outlier can bend the fit below ``a > 0`` (upstream times each
size once, on a dedicated accelerator). The timings run in rounds over every size, not back to
back per size, so that a burst of preemption (another process busy for a while) lands on one
round of several sizes rather than on every timing of one size."""


class SampleChannel(Protocol):
    """Where PP0's samples travel to every rank (the world group)."""

    def broadcast_object(self, obj: Any, src: int) -> Any: ...


@dataclass(frozen=True)
class ChunkingSetup:
    """What start-up settled: the model (None: fixed chunks) and, without one, why."""

    model: LatencyModel | None
    reason: str | None
    profile: LatencyProfile | None


def profiled_sizes(rt: RankRuntime) -> list[int]:
    """The chunk sizes the profile times, largest first (none above the device pool: no
    chunk of a run can be longer)."""
    sched, page = rt.cfg.scheduler, rt.cfg.cache.page_size
    top = min(int(sched.chunked_prefill_size * PROBE_MARGIN), rt.cfg.cache.device_tokens)
    return profile_sizes(max(page, top - top % page), sched.dynamic_chunking_samples, page)


def time_forwards(rt: RankRuntime, sizes: list[int]) -> LatencyProfile:
    """Time real forwards of this rank's stage per size: a prefill of that many dummy tokens
    from an empty history, into a scratch pool (the rank's own pool and tree stay untouched),
    in :data:`TIMINGS_PER_SIZE` rounds over the sizes in order, the fastest timing of each
    size kept. A stage after the first gets zero hidden states, as upstream's proxy tensors.
    The ``model.forward`` fault point fires before each forward, inside the timed span."""
    model, device, page = rt.model, rt.device, rt.cfg.cache.page_size
    largest = max(sizes)
    pool = DeviceKVPool(model.kv_shape(), -(-largest // page) * page, page, device)
    vocab = rt.cfg.model.vocab_size
    inputs = []
    for n in sizes:
        slots = torch.arange(n)
        batch = ForwardBatch(
            is_decode=False, rids=["profile"], input_ids=torch.arange(n) % (vocab - 1) + 1,
            positions=torch.arange(n), out_slots=slots, seq_slots=[slots], extend_lens=[n],
            prefix_lens=[0], sample=[True])
        hidden = None if rt.rank.is_first_stage else torch.zeros(
            (n, rt.cfg.model.hidden_size), dtype=model.dtype, device=device)
        inputs.append((n, batch, hidden))
    fastest = [math.inf] * len(sizes)
    for _ in range(TIMINGS_PER_SIZE):
        for i, (n, batch, hidden) in enumerate(inputs):
            _synchronize(device)
            start = time.perf_counter()
            act_at(rt.faults, FaultPoint.FORWARD, PROFILE_STEP, tokens=n)
            model.forward(batch, pool, hidden)
            _synchronize(device)
            fastest[i] = min(fastest[i], time.perf_counter() - start)
    return LatencyProfile(tuple(sizes), tuple(fastest))


def setup_chunking(rt: RankRuntime, channel: SampleChannel | None) -> ChunkingSetup:
    """Profile, share and fit (module notes); hand the model to the scheduler and record the
    outcome (``Ev.CHUNK_PROFILE``) on every rank. ``channel`` reaches every rank of the run
    (None: no peers, this rank fits its own samples). Every rank calls this at start-up; the
    broadcast is also where the ranks that do not profile wait for those that do."""
    per_rank = LegacySwitch.PER_RANK_CHUNK_TIMING in rt.cfg.legacy
    profile: LatencyProfile | None = None
    failure: str | None = None
    sizes = profiled_sizes(rt)
    began = time.monotonic()
    if per_rank or rt.rank.is_first_stage:
        try:
            profile = time_forwards(rt, sizes)
        except Exception as exc:  # upstream's failure safety: warn and keep fixed chunks
            failure = f"profiling failed: {type(exc).__name__}: {exc}".splitlines()[0]
    took = time.monotonic() - began
    if channel is not None:
        sent = {"profile": profile.as_payload() if profile is not None else None,
                "failure": failure} if rt.rank.rank == SAMPLES_SOURCE else None
        got = channel.broadcast_object(sent, SAMPLES_SOURCE)
        if not per_rank:  # the legacy form drops what it received and keeps its own
            payload = got.get("profile")
            profile = LatencyProfile.from_payload(payload) if payload is not None else None
            failure = got.get("failure")
    model, reason = fit_or_none(profile)
    if profile is None and failure is not None:
        reason = failure
    setup = ChunkingSetup(model, reason, profile)
    _record(rt, setup, per_rank, took)
    rt.scheduler.use_chunk_model(model)
    return setup


def _record(rt: RankRuntime, setup: ChunkingSetup, per_rank: bool, took: float) -> None:
    """``Ev.CHUNK_PROFILE``: whose samples (``source``: ``own`` or the rank they came from),
    how many, this rank's profiling time, the samples themselves, and the fitted
    coefficients or why there is no model."""
    profile = setup.profile
    attrs: dict[str, Any] = {
        "source": "own" if per_rank else f"rank{SAMPLES_SOURCE}",
        "samples": len(profile.seq_lens) if profile is not None else 0,
        "profile_s": round(took, 4),
        "base": rt.cfg.scheduler.chunked_prefill_size,
    }
    if profile is not None:
        attrs["seq_lens"] = list(profile.seq_lens)
        attrs["latencies_ms"] = [round(v * 1e3, 4) for v in profile.latencies]
    if setup.model is not None:
        attrs.update(a=setup.model.a, b=setup.model.b, c=setup.model.c)
    else:
        attrs["refused"] = setup.reason
        log.warning("rank %d: dynamic chunking off (%s); prefill chunks stay %d tokens",
                    rt.rank.rank, setup.reason, rt.cfg.scheduler.chunked_prefill_size)
    rt.tracer.emit(Ev.CHUNK_PROFILE, **attrs)


def _synchronize(device: torch.device) -> None:
    """Wait for the device, so a timed span holds the whole forward."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
