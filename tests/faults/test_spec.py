"""Fault specs: compact strings round-trip, bad specs are refused with the part named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faults.injector import FaultInjector
from faults.points import FaultPoint
from faults.spec import FaultKind, FaultSpec, parse_fault, parse_faults
from hicache_runtime.contracts.errors import InvalidFaultSpec
from hicache_runtime.contracts.topology import RankInfo


@pytest.mark.parametrize("text", [
    "stage-lag:pp=1,ms=30",
    "host-alloc-fail:tp=1,steps=20-60,p=0.5",
    "storage-shortfall:rank=1,mode=holes,pages=2,at=1",
    "mid-prefetch-abort:rid=req-0*,batch=1",
    "crash:steps=12-12,point=scheduler.step",
    "rank-kill:rank=3,steps=40-40",
])
def test_compact_round_trip(text: str) -> None:
    spec = parse_fault(text)
    assert parse_fault(spec.compact()) == spec


@pytest.mark.parametrize(("text", "needle"), [
    ("nope:ms=3", "unknown fault kind"),
    ("stage-lag:pages=3", "has no key .pages."),
    ("stage-lag:ms=-1", "ms"),
    ("crash", "needs point="),
    ("crash:point=storage.get", "cannot act at"),
    ("dma-lag:steps=9-3", "empty or negative"),
    ("dma-lag:ms", "expected key=value"),
    ("storage-shortfall:mode=sideways", "short or holes"),
])
def test_bad_specs_name_the_problem(text: str, needle: str) -> None:
    with pytest.raises(InvalidFaultSpec, match=needle):
        parse_fault(text)


@pytest.mark.parametrize(("text", "wanted"), [
    # the part as typed, never rewritten (step=1-2 used to be echoed as '1-2-1-2')
    ("crash:point=scheduler.step,step=1-2", ["step= takes one step like 12", "'1-2'"]),
    ("dma-lag:msx=5", ["has no key 'msx'; did you mean 'ms'?"]),
    ("dma-lg:ms=5", ["unknown fault kind 'dma-lg'; did you mean 'dma-lag'?"]),
    ("crash:point=sched.step", ["did you mean 'scheduler.step'?",
                                "(it acts at scheduler.step, cache.events or model.forward)"]),
    ("dma-lag:ms=5,ms=6", ["'ms=5' and 'ms=6' set ms twice"]),
    ("crash:point=cache.events,step=3,steps=1-4", ["set steps twice"]),
    ("dma-lag:ms=", ["ms= has no value"]),
    ("dma-lag:rid=,ms=1", ["rid= has no value"]),
    # every problem at once, each with the value given
    ("dma-lag:msx=5,count=,rnk=1", ["'msx'", "count= has no value", "did you mean 'rank'?"]),
    ("dma-lag:ms=abc,p=2", ["p=2: Input should be less than or equal to 1", "ms=abc:"]),
])
def test_spec_errors_say_everything_wrong_with_the_part_typed(text: str,
                                                               wanted: list[str]) -> None:
    with pytest.raises(InvalidFaultSpec) as info:
        parse_fault(text)
    for part in wanted:
        assert part in str(info.value), str(info.value)
    if "kind" not in str(info.value) and "=abc" not in text:
        assert "rank, tp, pp, rid, step, steps, p, count" in info.value.hint


def test_several_specs_in_one_string() -> None:
    specs = parse_faults(["dma-lag:ms=5;host-alloc-fail:tp=1", "storage-error"])
    assert [s.kind for s in specs] == [FaultKind.DMA_LAG, FaultKind.HOST_ALLOC_FAIL,
                                       FaultKind.STORAGE_ERROR]


@given(seed=st.integers(0, 2**32), p=st.floats(0.05, 0.95))
def test_injector_replays_exactly_from_the_seed(seed: int, p: float) -> None:
    spec = FaultSpec(kind=FaultKind.HOST_ALLOC_FAIL, p=p)
    rank = RankInfo.of(1, 2, 1)

    def pattern() -> list[bool]:
        inj = FaultInjector([spec], seed, rank)
        return [bool(inj.fire(FaultPoint.HOST_ALLOC, step=i)) for i in range(64)]

    assert pattern() == pattern()


def test_selectors_and_count() -> None:
    specs = [FaultSpec(kind=FaultKind.HOST_ALLOC_FAIL, tp=1, steps=(5, 9), count=2)]
    other = FaultInjector(specs, 0, RankInfo.of(0, 2, 1))
    assert not other.armed(FaultPoint.HOST_ALLOC), "tp=0 is not selected"
    inj = FaultInjector(specs, 0, RankInfo.of(1, 2, 1))
    fired = [bool(inj.fire(FaultPoint.HOST_ALLOC, step=s)) for s in range(12)]
    assert fired == [False] * 5 + [True, True] + [False] * 5
    assert [f.step for f in inj.fired] == [5, 6]


def test_request_selector_is_a_glob() -> None:
    spec = parse_fault("mid-prefetch-abort:rid=chat1-*")
    assert spec.matches_request("chat1-t0")
    assert not spec.matches_request("chat10-t0")
    assert not spec.matches_request(None)
