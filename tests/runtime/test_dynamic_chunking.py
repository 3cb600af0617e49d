"""Dynamic chunking in one process: the start-up profile times real forwards of a stage, every
rank fits the samples the source rank shares, failures and refusals leave every rank on fixed
chunks, the legacy form keeps each rank's own timings, and the scheduler cuts continuation
chunks by the model. The real pp=2 runs are in tests/multirank/test_dynamic_chunking.py."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from faults.spec import parse_faults
from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.engine.chunking import LatencyModel, chunk_schedule
from hicache_runtime.engine.profile import (
    SAMPLES_SOURCE,
    TIMINGS_PER_SIZE,
    profiled_sizes,
    setup_chunking,
    time_forwards,
)
from hicache_runtime.engine.rank import RankRuntime, build_rank
from hicache_runtime.kv.request import Req
from tests.helpers import small_config


@dataclass
class LocalBroadcast:
    """Broadcast between ranks built in this process, run one after the other: the source's
    object is kept and handed to every later caller (what ``broadcast_object`` gives ranks
    that run at once)."""

    sent: list[Any] = field(default_factory=list)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if not self.sent:
            assert obj is not None, "the source rank broadcasts first"
            self.sent.append(obj)
        return self.sent[0]


def _cfg(**overrides: object) -> Any:
    return small_config(**{"topology.pp": 2, "scheduler.enable_dynamic_chunking": True,
                           "cache.device_tokens": 1024, "scheduler.max_prefill_tokens": 1024,
                           **overrides})


@pytest.fixture
def ranks() -> Iterator[list[RankRuntime]]:
    built: list[RankRuntime] = []
    yield built
    for rt in built:
        rt.close()


def _build(ranks: list[RankRuntime], cfg: Any, pp_rank: int) -> RankRuntime:
    rt = build_rank(cfg, RankInfo.of(pp_rank, 1, cfg.topology.pp))
    ranks.append(rt)
    return rt


def _events(rt: RankRuntime, kind: str) -> list[dict[str, Any]]:
    return [e["attrs"] for e in rt.tracer.events() if e["kind"] == kind]


def test_only_with_pipeline_parallelism() -> None:
    with pytest.raises(ConfigError, match=r"scheduler\.enable_dynamic_chunking.*pp > 1"):
        load_config({"scheduler.enable_dynamic_chunking": True})
    assert load_config({"scheduler.enable_dynamic_chunking": True, "topology.pp": 2})
    assert load_config({"workload.kind": "long-context"}).workload.kind == "long_context"


def test_the_profile_times_real_forwards_of_the_stage(ranks: list[RankRuntime]) -> None:
    # the default model: attention over a 320-token chunk clearly outweighs the fixed cost
    cfg = load_config({"topology.pp": 2, "scheduler.enable_dynamic_chunking": True})
    for pp_rank in (0, 1):
        rt = _build(ranks, cfg, pp_rank)
        free, kv = rt.device_pool.available_tokens, rt.device_pool.k.clone()
        sizes = profiled_sizes(rt)
        assert sizes[0] == 320  # 1.25 x base 256
        assert len(sizes) == 40  # 128 asked for; 40 distinct multiples of the 8-token page
        assert sizes == sorted(sizes, reverse=True)
        assert all(s % 8 == 0 for s in sizes)
        small = _build(ranks, cfg.with_overrides(**{"cache.device_tokens": 128}), pp_rank)
        assert profiled_sizes(small)[0] == 128, "no chunk is longer than the device pool"
        profile = time_forwards(rt, sizes)
        assert profile.seq_lens == tuple(sizes)
        assert all(t > 0 for t in profile.latencies)
        # attention over the chunk: the largest chunks cost clearly more than the smallest
        assert statistics.median(profile.latencies[1:6]) > statistics.median(
            profile.latencies[-5:])
        assert rt.device_pool.available_tokens == free, "a scratch pool, not the rank's"
        assert bool((rt.device_pool.k == kv).all())


def test_every_rank_fits_the_samples_the_source_shares(ranks: list[RankRuntime]) -> None:
    # a fault on the later stage's forwards never fires: only PP0 profiles
    cfg = _cfg(faults=tuple(parse_faults(["crash:pp=1,point=model.forward,steps=0-0"])))
    channel = LocalBroadcast()
    setups = [setup_chunking(_build(ranks, cfg, r), channel) for r in (0, 1)]
    first, second = setups
    assert first.profile == second.profile
    assert first.model == second.model
    for rt, setup in zip(ranks, setups, strict=True):
        assert rt.scheduler.chunk_model == setup.model
        (ev,) = _events(rt, Ev.CHUNK_PROFILE)
        assert ev["source"] == f"rank{SAMPLES_SOURCE}"
        assert ev["samples"] == len(profiled_sizes(rt))
        assert ev["seq_lens"] == list(profiled_sizes(rt))
        assert ("a" in ev) == (setup.model is not None)
        assert ("refused" in ev) == (setup.model is None)
    assert not _events(ranks[1], Ev.FAULT)
    assert _events(ranks[1], Ev.CHUNK_PROFILE)[0]["profile_s"] < \
        _events(ranks[0], Ev.CHUNK_PROFILE)[0]["profile_s"]


def test_a_failed_profile_leaves_every_rank_on_fixed_chunks(ranks: list[RankRuntime]) -> None:
    cfg = _cfg(faults=tuple(parse_faults(["crash:pp=0,point=model.forward,steps=0-0"])))
    channel = LocalBroadcast()
    for r in (0, 1):
        setup = setup_chunking(_build(ranks, cfg, r), channel)
        assert setup.model is None
        assert setup.reason is not None
        assert "InjectedFault" in setup.reason
    for rt in ranks:
        assert rt.scheduler.chunk_model is None
        (ev,) = _events(rt, Ev.CHUNK_PROFILE)
        assert ev["samples"] == 0
        assert ev["refused"].startswith("profiling failed: InjectedFault")


def test_a_refused_fit_is_refused_on_every_rank(ranks: list[RankRuntime]) -> None:
    cfg = _cfg(**{"scheduler.dynamic_chunking_samples": 6})  # 5 usable samples: too few
    channel = LocalBroadcast()
    for r in (0, 1):
        setup = setup_chunking(_build(ranks, cfg, r), channel)
        assert setup.model is None
        assert setup.profile is not None
        assert len(setup.profile.seq_lens) == 6
        assert setup.reason == "5 usable samples, need at least 8"
    assert all(rt.scheduler.chunk_model is None for rt in ranks)


def test_compute_lag_slows_the_profiled_forwards_per_token(ranks: list[RankRuntime]) -> None:
    cfg = _cfg(**{"scheduler.dynamic_chunking_samples": 10},
               faults=tuple(parse_faults(["compute-lag:pp=0,steps=0-0,ms=100"])))
    rt = _build(ranks, cfg, 0)
    profile = time_forwards(rt, profiled_sizes(rt))
    for n, t in zip(profile.seq_lens, profile.latencies, strict=True):
        assert t >= 0.1 * n / 1024
    fired = _events(rt, Ev.FAULT)
    assert len(fired) == len(profile.seq_lens) * TIMINGS_PER_SIZE
    assert {e["kind"] for e in fired} == {"compute-lag"}


def test_the_profile_times_in_rounds_over_every_size(ranks: list[RankRuntime],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of preemption lands on one round of several sizes, never on every timing of
    one size: the sizes are timed in turn, TIMINGS_PER_SIZE times over."""
    cfg = _cfg(**{"scheduler.dynamic_chunking_samples": 10})
    rt = _build(ranks, cfg, 0)
    seen: list[int] = []
    forward = rt.model.forward

    def counting(batch, pool, hidden):  # type: ignore[no-untyped-def]
        seen.append(batch.extend_lens[0])
        return forward(batch, pool, hidden)

    monkeypatch.setattr(rt.model, "forward", counting)
    sizes = profiled_sizes(rt)
    profile = time_forwards(rt, sizes)
    assert seen == sizes * TIMINGS_PER_SIZE
    assert profile.seq_lens == tuple(sizes)


def test_legacy_ranks_keep_their_own_timings(ranks: list[RankRuntime]) -> None:
    cfg = _cfg(legacy=frozenset({LegacySwitch.PER_RANK_CHUNK_TIMING}))
    channel = LocalBroadcast()
    first, second = (setup_chunking(_build(ranks, cfg, r), channel) for r in (0, 1))
    assert first.profile is not None
    assert second.profile is not None
    assert first.profile.seq_lens == second.profile.seq_lens
    assert first.profile.latencies != second.profile.latencies, "each rank timed its own"
    assert channel.sent[0]["profile"]["latencies"] == list(first.profile.latencies)
    for rt in ranks:
        (ev,) = _events(rt, Ev.CHUNK_PROFILE)
        assert ev["source"] == "own"
        assert ev["profile_s"] > 0


# --- the scheduler cuts continuation chunks by the model ---------------------------------------

MODEL = LatencyModel(a=2e-7, b=1e-5, c=1e-3)


def _prefill(rt: RankRuntime, req: Req) -> list[int]:
    """Form and complete one request's prefill batches; their extend lengths."""
    sched = rt.scheduler
    sched.add_request(req)
    extends: list[int] = []
    step = 0
    while not req.output_ids:
        step += 1
        batch = sched.next_batch(step, 0)
        assert batch is not None
        extends.append(batch.forward.extend_lens[0])
        sched.process_result(batch, [7] * sum(batch.forward.sample))
    return extends


def test_continuation_chunks_follow_the_model(ranks: list[RankRuntime]) -> None:
    base, page, total = 256, 4, 900
    rt = _build(ranks, _cfg(**{"scheduler.chunked_prefill_size": base}), 0)
    rt.scheduler.use_chunk_model(MODEL)
    extends = _prefill(rt, Req(rid="long", input_ids=list(range(1, total + 1)),
                               max_new_tokens=2))
    # the history's attention makes a base-sized chunk slower: continuations shrink
    assert extends == chunk_schedule(MODEL, total, base, page, 1024)
    assert extends[:4] == [256, 128, 128, 64], extends
    decisions = _events(rt, Ev.CHUNK_SIZE)
    assert [d["history"] for d in decisions] == [sum(extends[:i]) for i in
                                                  range(1, len(extends))]
    assert all(d["rid"] == "long" and d["base"] == base for d in decisions)
    assert [min(d["size"], total - d["history"]) for d in decisions] == extends[1:]


def test_without_a_model_chunks_stay_fixed(ranks: list[RankRuntime]) -> None:
    rt = _build(ranks, _cfg(), 0)
    extends = _prefill(rt, Req(rid="long", input_ids=list(range(1, 301)), max_new_tokens=2))
    assert extends == [64, 64, 64, 64, 44]
    assert not _events(rt, Ev.CHUNK_SIZE)
