"""The outage state machine the remote backends share (``hicache_runtime/l3/outage.py``),
driven directly on a clock the test moves: what a call may do in each state, the backoff,
what is counted and traced. The backends' own tests (test_redis_backend.py,
test_mooncake_backend.py) drive it through a real server that is killed and restarted."""

from __future__ import annotations

from typing import Any

from hicache_runtime.l3.outage import Outage


class Record:
    def __init__(self) -> None:
        self.now = 100.0
        self.counts: dict[str, float] = {}
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.dropped = 0

    def count(self, **deltas: float) -> None:
        for k, v in deltas.items():
            self.counts[k] = self.counts.get(k, 0) + v

    def emit(self, op: str, **attrs: Any) -> None:
        self.events.append((op, attrs))

    def drop(self) -> None:
        self.dropped += 1


def _outage(rec: Record) -> Outage:
    return Outage("redis", "127.0.0.1:1", base_backoff_s=1.0, max_backoff_s=3.0,
                  count=rec.count, emit=rec.emit, url="redis://127.0.0.1:1", on_down=rec.drop,
                  clock=lambda: rec.now)


def test_up_every_call_goes_ahead_and_nothing_is_counted() -> None:
    rec = Record()
    o = _outage(rec)
    assert all(o.may_try() for _ in range(3))
    o.mark_up()
    assert rec.counts == {}
    assert rec.events == []
    assert not o.down


def test_an_outage_is_reported_once_and_probed_by_one_caller_after_the_backoff() -> None:
    rec = Record()
    o = _outage(rec)
    o.mark_down("connection refused")
    o.mark_down("connection refused")  # a call that started before the outage was noticed
    assert o.down
    assert o.last_error == "connection refused"
    assert rec.counts == {"outages": 1}
    assert rec.dropped == 1
    assert [e for e, _ in rec.events] == ["outage"]
    rec.now += 0.9
    assert not o.may_try()  # within the backoff
    rec.now += 0.2
    assert o.may_try()  # the probe
    assert not o.may_try()  # one probe at a time
    o.mark_down("still refused")  # the probe met the outage: the backoff doubles
    assert o.state()["backoff_s"] == 2.0
    assert o.last_error == "still refused"
    rec.now += 1.9
    assert not o.may_try()
    rec.now += 0.2
    assert o.may_try()
    o.mark_down("refused")
    assert o.state()["backoff_s"] == 3.0  # capped
    rec.now += 3.1
    assert o.may_try()
    o.mark_up()  # the probe went through
    assert not o.down
    assert rec.counts == {"outages": 1, "reconnects": 1}
    assert [e for e, _ in rec.events] == ["outage", "reconnect"]
    assert rec.events[1][1]["down_s"] == 6.3  # 0.9 + 0.2 + 1.9 + 0.2 + 3.1


def test_a_call_that_succeeds_while_down_is_no_probe_and_a_released_slot_is_free() -> None:
    rec = Record()
    o = _outage(rec)
    o.mark_down("gone")
    o.mark_up()  # started before the outage, finished after: not the probe
    assert o.down
    rec.now += 1.5
    assert o.may_try()
    o.release()  # the probe raised for its own reasons
    assert o.may_try()  # the slot is free again
    o.mark_up()
    assert not o.down
