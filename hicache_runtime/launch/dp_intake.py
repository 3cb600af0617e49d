"""A DP group's side of the DP controller: the entry rank's request feed and its load report.

With several DP groups the controller (:mod:`hicache_runtime.launch.dp_controller`) owns the
request stream. Each group's entry rank (PP0, TP0) reads it through a :class:`ControllerFeed`,
the :class:`~hicache_runtime.engine.workload.Intake` of its step loop, so the group's existing
intake (the lone rank's poll, or rank 0's step exchange to its peers) is unchanged. The feed

* receives the requests routed to this group, client aborts and the end of the stream over a
  pipe the controller handed the rank when it started it (a socket pair, one per group);
* reports every request the group finished (its prompt and tokens: a chat's next turn is
  built from them) back over the same pipe;
* writes the group's load (requests it holds, not finished) and its step to the controller's
  shared-memory load board once per step, which is what shortest-queue routing reads.

An abort goes to every group's entry rank (the controller does not track who holds what, as
upstream's does not); a group applies only those of requests it holds.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.run_files import DP_RANK_ENV
from hicache_runtime.kv.request import Req, ReqStatus
from hicache_runtime.launch.dp_routing import LoadBoard
from hicache_runtime.telemetry.tracer import Tracer

ENV_DP_RANK = DP_RANK_ENV
"""The rank's DP group (every rank of a run with several groups)."""
ENV_BOARD = "HICACHE_DP_BOARD"
"""The shared-memory name of the controller's load board."""
ENV_FEED_FD = "HICACHE_DP_FEED_FD"
"""The entry rank's end of its group's pipe to the controller (a file descriptor)."""

_IDLE_WAIT_S = 0.002
"""How long an idle group's entry rank waits for the controller per step. Without a wait an
idle group spins through empty steps and takes a CPU from the groups that have work."""


@dataclass(frozen=True)
class Routed:
    """A generate request for this group and the decision that sent it here. Plain values, not
    the request itself: a request holds tensors, which the pipe's pickler would move to shared
    memory."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    arrival_step: int
    reason: str
    loads: tuple[int, ...]

    @classmethod
    def of(cls, req: Req, reason: str, loads: tuple[int, ...]) -> Routed:
        return cls(req.rid, list(req.input_ids), req.max_new_tokens, req.arrival_step, reason,
                   loads)

    def as_req(self) -> Req:
        return Req(rid=self.rid, input_ids=list(self.input_ids),
                   max_new_tokens=self.max_new_tokens, arrival_step=self.arrival_step)


@dataclass(frozen=True)
class Abort:
    """A client abort, sent to every group's entry rank."""

    rid: str


@dataclass(frozen=True)
class EndOfStream:
    """Every request of the stream has been routed: a group with nothing left may stop."""


@dataclass(frozen=True)
class Finished:
    """A request this group finished (or aborted), as the controller's stream needs it."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    status: str
    abort_reason: str | None

    @classmethod
    def of(cls, req: Req) -> Finished:
        return cls(req.rid, list(req.input_ids), list(req.output_ids), req.status.value,
                   req.abort_reason)

    def as_req(self, step: int) -> Req:
        """The request as the workload reads a finished one (finished at ``step``)."""
        return Req(rid=self.rid, input_ids=self.input_ids, max_new_tokens=len(self.output_ids),
                   output_ids=self.output_ids, status=ReqStatus(self.status),
                   finish_step=step, abort_reason=self.abort_reason)


ToGroup = Routed | Abort | EndOfStream
"""What the controller sends a group's entry rank."""
FromGroup = list[Finished]
"""What an entry rank sends the controller: the requests it finished since its last report."""


class ControllerFeed:
    """The entry rank's :class:`~hicache_runtime.engine.workload.Intake`: the controller's feed.

    ``busy`` tells whether the rank's scheduler has work; when it has none and nothing came in,
    a poll waits a little for the controller instead of returning at once."""

    def __init__(self, conn: Connection, board: LoadBoard, group: int, total: int,
                 tracer: Tracer, busy: Callable[[], bool]) -> None:
        self._conn = conn
        self._board = board
        self.group = group
        self._total = total
        self._tracer = tracer
        self._busy = busy
        self._arrived: list[Req] = []
        self._aborts: list[str] = []
        self._held: set[str] = set()
        self._received = 0
        """Routed requests taken so far: the router counts the rest of its dispatches as in
        flight."""
        self._reported = 0
        self._ended = False

    @property
    def total(self) -> int:
        return self._total

    def poll(self, step: int, finished: dict[str, Req]) -> list[Req]:
        self._report(finished)
        self._receive(wait=not self._ended and not self._busy())
        self._board.publish(self.group, len(self._held), step, self._received)
        out, self._arrived = self._arrived, []
        return out

    def aborts(self, step: int) -> list[str]:
        out, self._aborts = self._aborts, []
        return out

    def exhausted(self) -> bool:
        return self._ended and not self._arrived

    def close(self) -> None:
        self._conn.close()
        self._board.close()

    def _report(self, finished: dict[str, Req]) -> None:
        """Send the controller the requests finished since the last report (``finished``
        only grows, in finishing order)."""
        if len(finished) == self._reported:
            return
        new = [Finished.of(r) for r in itertools.islice(finished.values(), self._reported, None)]
        self._reported = len(finished)
        self._held.difference_update(f.rid for f in new)
        self._send(new)

    def _receive(self, wait: bool) -> None:
        got = self._conn.poll(_IDLE_WAIT_S if wait else 0)
        while got:
            try:
                msg: ToGroup = self._conn.recv()
            except EOFError:
                raise RuntimeError(f"DP group {self.group}: the DP controller closed the "
                                   "request feed") from None
            self._take(msg)
            got = self._conn.poll(0)

    def _take(self, msg: ToGroup) -> None:
        if isinstance(msg, Routed):
            self._arrived.append(msg.as_req())
            self._held.add(msg.rid)
            self._received += 1
            self._tracer.emit(Ev.DP_RECEIVE, what="request", rid=msg.rid, group=self.group,
                              reason=msg.reason, loads=list(msg.loads))
        elif isinstance(msg, Abort):
            held = msg.rid in self._held
            if held:
                self._aborts.append(msg.rid)
            self._tracer.emit(Ev.DP_RECEIVE, what="abort", rid=msg.rid, group=self.group,
                              held=held)
        else:
            self._ended = True
            self._tracer.emit(Ev.DP_RECEIVE, what="end", group=self.group,
                              held=len(self._held))

    def _send(self, msg: FromGroup) -> None:
        try:
            self._conn.send(msg)
        except OSError as exc:
            raise RuntimeError(f"DP group {self.group}: cannot report to the DP controller "
                               f"({exc})") from None


def controller_feed(cfg_dp: int, rank: int, tracer: Tracer, total: int,
                    busy: Callable[[], bool]) -> ControllerFeed | None:
    """The feed of a DP group's entry rank started by the controller; ``None`` on any other
    rank (and in a run of one group). ``cfg_dp``: the run's DP size; ``rank``: the rank in its
    group's world."""
    fd = os.environ.get(ENV_FEED_FD)
    if cfg_dp == 1 or rank != 0:
        return None
    if fd is None or ENV_BOARD not in os.environ or ENV_DP_RANK not in os.environ:
        raise ConfigError("topology.dp", f"{cfg_dp} DP groups take their requests from the DP "
                          "controller: start the run with 'hicache run --dp'")
    board = LoadBoard(cfg_dp, os.environ[ENV_BOARD], track=False)
    return ControllerFeed(Connection(int(fd)), board, int(os.environ[ENV_DP_RANK]), total,
                          tracer, busy)


def dp_rank_from_env() -> int:
    """This rank's DP group (0 in a run of one group)."""
    return int(os.environ.get(ENV_DP_RANK, "0"))
