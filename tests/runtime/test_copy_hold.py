"""``dma-lag``'s ``hold``: a rank's scheduler sees a finished copy only ``hold`` steps after
submitting it, whatever the copy's own time, and the end-of-run drain (where no step comes)
still consumes every held transfer."""

from __future__ import annotations

from faults.spec import parse_fault
from tests.helpers import CacheRig


def _rig(fault: str) -> CacheRig:
    return CacheRig.make(**{"faults": (parse_fault(fault),), "cache.write_policy":
                            "write_through"})


def test_a_held_write_is_seen_finished_only_hold_steps_after_submission() -> None:
    rig = _rig("dma-lag:hold=3")
    try:
        ctl, tracer = rig.cache.controller, rig.rt.tracer
        assert ctl is not None
        tracer.step = 10
        req = rig.admit("a", list(range(1, 33)))
        assert req is not None
        rig.finish(req)  # write-through: the prefix's copy to L2 is submitted now
        ctl.start_writing()
        assert ctl.ack_write_queue, "a write to L2 is in flight"
        ack = ctl.ack_write_queue[0]
        ack.event.synchronize()  # the copy itself is done at once
        assert ack.seen_from_step == 13
        for step in (10, 11, 12):
            tracer.step = step
            assert ctl.ready_count(ctl.ack_write_queue) == 0, f"seen at step {step}"
        tracer.step = 13
        assert ctl.ready_count(ctl.ack_write_queue) == len(ctl.ack_write_queue)
    finally:
        rig.close()


def test_the_drain_consumes_held_transfers_without_steps() -> None:
    rig = _rig("dma-lag:hold=1000")
    try:
        cache, ctl = rig.cache, rig.cache.controller
        assert ctl is not None
        req = rig.admit("a", list(range(1, 33)))
        assert req is not None
        rig.finish(req)
        ctl.start_writing()
        assert ctl.ready_count(ctl.ack_write_queue) == 0
        cache.stop_stepping()
        rig.drain()  # would spin for ever if the hold outlived the steps
        assert cache.idle()
    finally:
        rig.close()


def test_a_lag_in_time_and_a_hold_in_steps_fire_apart() -> None:
    """One spec lags in ms or holds in steps: a hold is asked at submission only, never in
    the copy thread, so a hold that fires once is counted once."""
    rig = _rig("dma-lag:hold=2,count=1")
    try:
        ctl = rig.cache.controller
        assert ctl is not None
        for rid, first in (("a", 1), ("b", 101)):
            req = rig.admit(rid, list(range(first, first + 32)))
            assert req is not None
            rig.finish(req)
            ctl.start_writing()
        assert [a.seen_from_step for a in ctl.ack_write_queue] == [2, 0]
        fired = rig.rt.faults.fired if rig.rt.faults is not None else []
        assert len(fired) == 1
    finally:
        rig.close()
