"""DP routing: policies, the shared-memory load board, bursts, and message recipients."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import Counter

import pytest

from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.launch.dp_routing import (
    LoadBoard,
    MessageKind,
    Policy,
    Router,
    recipients,
)


class FakeClock:
    """A clock the test moves by hand, so the 20 ms refresh is deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_round_robin_cycles_and_external_routing_passes_through() -> None:
    router = Router(3)
    assert [router.route().group for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    decision = router.route(routed_dp_rank=2)
    assert (decision.group, decision.reason) == (2, "routed")
    assert router.route().group == 1  # the external request did not consume a turn
    with pytest.raises(ConfigError, match="not a DP group"):
        router.route(routed_dp_rank=3)


def test_a_burst_on_a_stale_snapshot_spreads_over_every_group() -> None:
    """100 requests inside one refresh interval: the snapshot never changes, so only the
    speculative +1 keeps the burst from landing on the group that looked emptiest."""
    clock = FakeClock()
    snapshot = [5, 0, 3, 1]
    router = Router(4, Policy.SHORTEST_QUEUE, read_loads=lambda: snapshot, clock=clock)
    picks = Counter(router.route().group for _ in range(100))
    assert router.refreshes == 1
    final = [snapshot[g] + picks[g] for g in range(4)]
    assert max(final) - min(final) <= 1, (picks, final)


def test_the_snapshot_is_reread_after_the_refresh_interval() -> None:
    clock = FakeClock()
    snapshot = [0, 0]
    router = Router(2, Policy.SHORTEST_QUEUE, read_loads=lambda: snapshot, clock=clock)
    assert router.route().group == 0
    snapshot[:] = [0, 9]  # group 1 got busy; not seen until the interval has passed
    clock.now += 0.010
    assert router.route().group == 1  # speculative count says group 0 has one more
    clock.now += 0.011
    assert router.route().group == 0
    assert router.refreshes == 2


def test_a_reread_keeps_the_requests_a_group_has_not_received_yet() -> None:
    """A burst that outlasts a refresh interval while every group is in a long step: the
    board still says 0 everywhere, but it also says no group received anything, so the
    re-read counts each dispatch as in flight and the burst stays spread."""
    clock = FakeClock()
    board = [(0, 0), (0, 0), (0, 0)]
    router = Router(3, Policy.SHORTEST_QUEUE, read_loads=lambda: board, clock=clock)
    picks = []
    for _ in range(6):
        picks.append(router.route().group)
        clock.now += 1.5 * router.refresh_s  # each dispatch past a refresh interval
    assert router.refreshes == 6
    assert max(Counter(picks).values()) == 2, picks
    # group 0 received its two and finished one: its load is what the board says
    board[:] = [(1, 2), (0, 0), (0, 0)]
    clock.now += 0.1
    assert router.route().loads == (1, 2, 2)


def test_shortest_queue_needs_a_snapshot() -> None:
    with pytest.raises(ConfigError, match="load snapshot"):
        Router(2, Policy.SHORTEST_QUEUE)


def _leader(name: str, group: int, load: int) -> None:
    board = LoadBoard(3, name)
    board.publish(group, load, step=100 + group)
    board.close()


def test_load_board_is_shared_across_processes() -> None:
    board = LoadBoard(3, create=True)
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_leader, args=(board.name, g, 10 * (g + 1)))
                 for g in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert board.loads() == [10, 20, 30]
        assert [slot.step for slot in board.snapshot()] == [100, 101, 102]
        assert all(slot.written_ns > 0 for slot in board.snapshot())
    finally:
        board.close()


def _hammer(name: str, writes: int) -> None:
    board = LoadBoard(1, name)
    for n in range(1, writes + 1):  # every field of a write holds the same number
        board.publish(0, n, step=n, received=n)
    board.close()


def test_a_slot_read_while_its_leader_writes_it_is_never_half_old() -> None:
    """A slot is read by the controller while the group's leader, another process, writes it:
    a read sees one whole write, never the load of one and the received count of another (a
    torn read once made a group that had received a request count as holding none, and the
    burst went to it)."""
    board = LoadBoard(1, create=True)
    try:
        proc = mp.get_context("spawn").Process(target=_hammer, args=(board.name, 300_000))
        proc.start()
        torn = seen = 0
        while proc.is_alive() or seen == 0:
            slot = board.snapshot()[0]
            seen += 1
            torn += not (slot.load == slot.step == slot.received)
        proc.join(30)
        assert proc.exitcode == 0
        assert torn == 0, f"{torn} of {seen} reads mixed two writes"
        assert board.snapshot()[0].load == 300_000
    finally:
        board.close()


def test_a_slots_count_never_reads_lower_than_it_was() -> None:
    """The sequence lock's premise: a reader never sees a count go back. A count written with
    ``struct.pack_into`` read as 0 mid-write (it zeroes its bytes before filling them), an even
    count a reader took for a whole slot; each word is now a single aligned store."""
    board = LoadBoard(1, create=True)
    try:
        proc = mp.get_context("spawn").Process(target=_hammer, args=(board.name, 100_000))
        proc.start()
        words, seen, backwards, last = board._view(), 0, 0, 0
        while proc.is_alive():
            count = words[0]
            seen += 1
            backwards += count < last
            last = max(last, count)
        proc.join(30)
        assert proc.exitcode == 0
        assert seen > 1000
        assert backwards == 0, f"{backwards} of {seen} counts went back"
    finally:
        board.close()


def _die_inside_a_write(name: str) -> None:
    board = LoadBoard(1, name)
    board.publish(0, 5, step=6, received=7)
    words = board._view()  # a crash between the words of a write, as _write lays them down
    words[0] |= 1
    words[1] = 99
    os._exit(0)


def test_a_writer_that_died_inside_a_write_leaves_its_last_whole_write() -> None:
    """The leader died between its count going odd and its fields: the reader gives up after
    its bounded tries and shows the last whole write it read, never the half-written one."""
    board = LoadBoard(1, create=True)
    try:
        assert board.snapshot()[0] == (0, 0, 0, 0)  # whole and never written
        proc = mp.get_context("spawn").Process(target=_die_inside_a_write, args=(board.name,))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        reader = LoadBoard(1, board.name)  # a reader that never saw a whole write of it
        try:
            assert reader.snapshot()[0] == (0, 0, 0, 0)
        finally:
            reader.close()
        board.publish(0, 8, step=9, received=10)  # the group's next leader writes it whole
        slot = board.snapshot()[0]
        assert (slot.load, slot.step, slot.received) == (8, 9, 10)
        board._view()[0] |= 1  # and dies inside its next write
        assert board.snapshot()[0] == slot
        started = time.monotonic()  # the reader waited once for that count, not at every read
        assert [board.snapshot()[0] for _ in range(100)] == [slot] * 100
        assert time.monotonic() - started < 0.5
        board.publish(0, 11, step=12, received=13)  # a new leader: the count moves on
        assert board.snapshot()[0].load == 11
    finally:
        board.close()


def test_fields_that_disagree_with_their_check_word_are_not_taken() -> None:
    """What a weakly ordered CPU can show a reader: an even, unchanged count around fields of
    another write. The check word over count and fields rejects it."""
    board = LoadBoard(1, create=True)
    try:
        board.publish(0, 3, step=3, received=3)
        whole = board.snapshot()[0]
        board._view()[2] = 4  # one field of a later write, count untouched
        assert board.snapshot()[0] == whole
    finally:
        board.close()


def test_recipients_by_message_kind() -> None:
    # dp=2, pp=2, tp=2: ranks 0..7, group g holds g*4..g*4+3, PP stage p at +p*2. A control
    # message reaches each group's entry rank once: later stages get it from PP0's exchange.
    assert recipients(MessageKind.GLOBAL, dp=2, pp=2, tp=2) == list(range(8))
    assert recipients(MessageKind.CONTROL, dp=2, pp=2, tp=2) == [0, 4]
    assert recipients(MessageKind.GENERATE, dp=2, pp=2, tp=2, group=1) == [4]
    with pytest.raises(ValueError, match="DP group"):
        recipients(MessageKind.GENERATE, dp=2, pp=2, tp=2)
