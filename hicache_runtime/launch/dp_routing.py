"""Data-parallel routing: which DP group serves a request, and who receives a control message.

The DP controller is the parent of the whole ``dp × pp × tp`` rank grid and the only reader of
the request stream. It sorts messages three ways, because each way has a different failure
when it is wrong:

* a generate request goes to exactly **one** DP group (two groups would compute it twice and
  answer twice): :meth:`Router.route`;
* a global message goes to **every** worker (one left out is a rank with different state):
  upstream's profiling and blocking; here the request to dump evidence when a run fails;
* an abort-type control message goes to **each TP group's rank 0** only; the group's own
  broadcast channel copies it to its peers (sending it to every rank would deliver it twice and
  fork the message sequence): :func:`recipients`. Here the TP group that takes a DP group's
  messages is its first stage's: later stages get requests and aborts from PP0 in the step
  exchange, as upstream's later stages get them from the previous stage, so a DP group has one
  entry rank (PP0, TP0) and a control message reaches one rank per DP group.

Load for the shortest-queue policy comes from a shared-memory snapshot each group's leader
writes (:class:`LoadBoard`): lock-free for the writer, free to read, and a few milliseconds
stale. Staleness is paid for twice over: every dispatch adds a speculative +1 to the chosen
group locally, and the real snapshot is re-read at most every :data:`REFRESH_S`. Without the
speculative count a burst reads the same stale snapshot for every request and lands the whole
burst on one group. A re-read keeps the requests still in flight: each slot also holds how
many routed requests the group has received, so a dispatch the group has not received yet is
added to its load, however long the group's step takes (a re-read used to drop them, and a
burst that outlasted a slow step piled onto the group whose board said 0). The leader writes
its scheduler step next to its load: the controller's clock for the request stream is the
step every group has reached.

A request that already names its group (``routed_dp_rank``, set by an external router, as in
prefill/decode disaggregation) goes straight there: the local policy is only the fallback.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing import resource_tracker, shared_memory
from typing import NamedTuple

from hicache_runtime.contracts.errors import ConfigError

#: The most a routing decision trusts a snapshot before reading it again.
REFRESH_S = 0.020
#: A slot's words: its write count (odd while a write is under way), load, step, monotonic ns
#: when written, received count, and a check word over the other five.
_WORDS = 6
_FIELDS = struct.Struct("<5q")
_READ_TRIES = 10_000


class Policy(str, Enum):
    ROUND_ROBIN = "round-robin"
    SHORTEST_QUEUE = "shortest-queue"


class MessageKind(str, Enum):
    GENERATE = "generate"  # one DP group
    GLOBAL = "global"  # every worker (the dump request)
    CONTROL = "control"  # each DP group's entry rank (aborts, end of the stream)


class Slot(NamedTuple):
    """One DP group's entry on the board: its load, its leader's step, when it was written
    (monotonic ns; 0 until the leader first writes) and how many routed requests it has
    received so far."""

    load: int
    step: int
    written_ns: int
    received: int = 0


#: What a group shows before its leader's first whole write.
_NEVER_WRITTEN = Slot(0, 0, 0, 0)


class LoadBoard:
    """Per-DP-group load in shared memory: group leaders write, the controller reads.

    Each slot is (load, step, write time, received), written by one group's leader while the
    controller may be reading it from another process, so each slot is a sequence lock: the
    writer makes its count odd, writes, makes it even again; a reader takes the slot only when
    the count was even and unchanged around its read. Every word is one aligned 8-byte store
    or load through a ``q`` view: ``struct.pack_into`` is no such write, it zeroes its bytes
    before it fills them (CPython's ``s_pack_internal``), so a count written with it read as 0,
    an even count, in 1% of reads under a busy writer, and a reader that read 0 on both sides
    took a half-written slot (1 read in 131,742 in a CI run). A check word over the count and
    the fields is the second guard: it catches a read that a weakly ordered CPU (aarch64)
    reorders around the count, which Python has no fence to prevent. The controller creates
    the board (``create=True``) and unlinks it; ranks attach by name.
    """

    def __init__(self, groups: int, name: str | None = None, *, create: bool = False,
                 track: bool = True) -> None:
        """``track=False``: attach without leaving the segment registered with this process's
        resource tracker. A process that does not share the creator's tracker (a rank process
        the controller started) must attach so: its own tracker would unlink the segment when
        it exits, from under the controller and every other group (CPython gh-82300)."""
        if groups <= 0:
            raise ConfigError("dp", "a load board needs at least one DP group")
        self.groups = groups
        self._shm = shared_memory.SharedMemory(name=name, create=create,
                                                size=8 * _WORDS * groups)
        buf = self._shm.buf
        assert buf is not None
        # the segment is page-aligned and a slot is six words, so every word is 8-byte aligned
        self._words: memoryview | None = buf[: 8 * _WORDS * groups].cast("q")
        self._owner = create
        #: the last whole slot this reader took per group: what a dead writer's group shows
        self._last: dict[int, Slot] = {}
        #: per group, the odd count a reader gave up on (a writer that died inside a write)
        self._stuck: dict[int, int] = {}
        if create:
            for group in range(groups):  # whole, never-written slots (written_ns 0)
                self._write(group, 0, 0, 0, 0)
        elif not track:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]

    @property
    def name(self) -> str:
        return self._shm.name

    def _view(self) -> memoryview:
        assert self._words is not None, "the load board is closed"
        return self._words

    def publish(self, group: int, load: int, step: int = 0, received: int = 0) -> None:
        self._write(group, int(load), int(step), time.monotonic_ns(), int(received))

    def _write(self, group: int, load: int, step: int, written_ns: int, received: int) -> None:
        words, at = self._view(), group * _WORDS
        seq = words[at] | 1  # odd: a write is under way
        words[at] = seq
        words[at + 1], words[at + 2], words[at + 3], words[at + 4] = (
            load, step, written_ns, received)
        words[at + 5] = _check(seq + 1, load, step, written_ns, received)
        words[at] = seq + 1

    def snapshot(self) -> list[Slot]:
        return [self._read(g) for g in range(self.groups)]

    def _read(self, group: int) -> Slot:
        words, at = self._view(), group * _WORDS
        if words[at] == self._stuck.get(group):  # still the count a dead writer left
            return self._last.get(group, _NEVER_WRITTEN)
        for _ in range(_READ_TRIES):
            before = words[at]
            load, step, written_ns, received, check = words[at + 1: at + _WORDS].tolist()
            if (not before & 1 and words[at] == before
                    and check == _check(before, load, step, written_ns, received)):
                slot = self._last[group] = Slot(load, step, written_ns, received)
                return slot
            time.sleep(0)  # let the writer finish
        # a writer that died inside a write leaves its count odd and its fields half written:
        # the group shows the last whole write this reader took (or the never-written slot),
        # and later reads do not wait again until the count moves
        self._stuck[group] = before
        return self._last.get(group, _NEVER_WRITTEN)

    def loads(self) -> list[int]:
        """Every group's load."""
        return [slot.load for slot in self.snapshot()]

    def loads_received(self) -> list[tuple[int, int]]:
        """Every group's load and the routed requests it has received (the router's
        ``read_loads``), from one snapshot."""
        return [(slot.load, slot.received) for slot in self.snapshot()]

    def close(self) -> None:
        if self._words is not None:
            self._words.release()  # the segment cannot close while a view exports it
            self._words = None
        self._shm.close()
        if self._owner:
            self._shm.unlink()


def _check(seq: int, load: int, step: int, written_ns: int, received: int) -> int:
    """A slot's check word: 8 bytes of BLAKE2b over its count and fields, as a signed word."""
    digest = hashlib.blake2b(_FIELDS.pack(seq, load, step, written_ns, received), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


@dataclass
class Decision:
    """One routing decision, for the trace: the group, why, and the loads it saw."""

    group: int
    reason: str  # "routed" | "round-robin" | "shortest-queue"
    loads: tuple[int, ...] = ()


@dataclass
class Router:
    """Picks a DP group per generate request. ``read_loads`` returns the current snapshot (one
    entry per group: its load, or its load and the routed requests it has received); ``clock``
    is injectable so refresh timing is testable."""

    groups: int
    policy: Policy = Policy.ROUND_ROBIN
    read_loads: Callable[[], Sequence[int | tuple[int, int]]] | None = None
    clock: Callable[[], float] = time.monotonic
    refresh_s: float = REFRESH_S
    _next: int = 0
    _loads: list[int] = field(default_factory=list)
    _read_at: float = float("-inf")
    _sent: list[int] = field(default_factory=list)
    refreshes: int = 0

    def __post_init__(self) -> None:
        if self.groups <= 0:
            raise ConfigError("dp", "must be at least 1")
        if self.policy is Policy.SHORTEST_QUEUE and self.read_loads is None:
            raise ConfigError("dp_policy", "shortest-queue routing needs a load snapshot")
        self._loads = [0] * self.groups
        self._sent = [0] * self.groups

    def route(self, routed_dp_rank: int | None = None) -> Decision:
        if routed_dp_rank is not None:
            if not 0 <= routed_dp_rank < self.groups:
                raise ConfigError("routed_dp_rank", f"{routed_dp_rank} is not a DP group "
                                  f"(0..{self.groups - 1})")
            self._speculate(routed_dp_rank)
            return Decision(routed_dp_rank, "routed")
        if self.policy is Policy.ROUND_ROBIN:
            group = self._next
            self._next = (self._next + 1) % self.groups
            return Decision(group, Policy.ROUND_ROBIN.value)
        self._refresh()
        loads = tuple(self._loads)
        group = min(range(self.groups), key=lambda g: (self._loads[g], g))
        self._speculate(group)
        return Decision(group, Policy.SHORTEST_QUEUE.value, loads)

    def _refresh(self) -> None:
        now = self.clock()
        if now - self._read_at < self.refresh_s:
            return
        assert self.read_loads is not None
        board = list(self.read_loads())
        if len(board) != self.groups:
            raise ValueError(f"load snapshot has {len(board)} groups, expected {self.groups}")
        loads = []
        for g, entry in enumerate(board):
            if isinstance(entry, tuple):  # with the group's received count: add what is in
                load, received = entry  # flight, sent here and not received there yet
                loads.append(max(0, int(load)) + max(0, self._sent[g] - int(received)))
            else:
                loads.append(max(0, int(entry)))
        self._loads = loads
        self._read_at = now
        self.refreshes += 1

    def _speculate(self, group: int) -> None:
        # The request just sent is not in the snapshot yet: count it here until the next read
        # (which counts it again as in flight until its group has received it).
        self._loads[group] += 1
        self._sent[group] += 1


def recipients(kind: MessageKind, *, dp: int, pp: int, tp: int,
               group: int | None = None) -> list[int]:
    """Grid ranks that receive a message. Ranks are numbered ``dp_rank * pp * tp +
    pp_rank * tp + tp_rank``; a generate request goes to its group's entry rank (PP0, TP0),
    whose peers receive it over the group's own step exchange; a control message goes to every
    group's entry rank (see the module notes)."""
    per_group = pp * tp
    if kind is MessageKind.GLOBAL:
        return list(range(dp * per_group))
    if kind is MessageKind.CONTROL:
        return [d * per_group for d in range(dp)]
    if group is None or not 0 <= group < dp:
        raise ValueError("a generate request needs its DP group")
    return [group * per_group]
