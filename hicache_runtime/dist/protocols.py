"""Every cross-rank agreement the runtime makes, in one place.

Ranks stay consistent only if every decision that changes tree state is taken from *protocol
values*: numbers reduced with MIN/MAX over the TP group, or decided by PP0 and chained down the
pipeline. This module owns all of them. Callers hand in their rank-local readings and get back
the agreed value; they never talk to a process group themselves.

Which thread may call what (each thread has its own communicator, never shared):

==========================  ==================  ===========================================
method                      thread              fixed protocol
==========================  ==================  ===========================================
``drain_counts``            scheduler           TP MIN on PP0, chained to PP1.. by p2p
``agree_min``/``agree_any`` scheduler           TP MIN/MAX on PP0, chained
``agree_all``               scheduler           MIN over every rank (allocation outcomes)
``legacy_tp_min[_many]``    scheduler           classic per-stage TP MIN (legacy paths only)
``legacy_chained``          scheduler           0.5.13's per-call PP0 count chain (legacy only)
``legacy_hit_vote``         prefetch thread     classic per-stage TP MIN of the hit (legacy only)
``hit_vote``                prefetch thread     MIN over TP+PP on the prefetch-hit group
``progress_vote``           prefetch sync       MIN over TP+PP on the completion group
``backup_vote``             backup              MIN over every rank on the backup group
``host_capacity``           start-up            MIN over PP
``broadcast_requests``      scheduler           rank 0 -> all
==========================  ==================  ===========================================

:class:`SingleRankSync` is the one-rank implementation: every vote is the identity, but each is
still traced (inputs and outputs), so traces look the same whatever the topology.
:class:`DistributedSync` runs the protocols over real process groups (``groups.py``) and
restores the legacy forms behind their switches. (``consensus.py`` *checks* agreement after the
fact; it decides nothing.)
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from hicache_runtime.contracts.errors import ResourceLeak
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.dist.flight_recorder import ReduceOpType

if TYPE_CHECKING:
    from hicache_runtime.contracts.topology import RankInfo
    from hicache_runtime.dist.groups import RankGroups
    from hicache_runtime.telemetry.tracer import Tracer


class DrainCounts(NamedTuple):
    """The per-step vector agreed before any completion is consumed (SGLang's
    ``_sync_hicache_ready_counts``). Every field is a count of leading ready items."""

    write_acks: int = 0
    """L1->L2 write acks whose copy has finished."""
    load_acks: int = 0
    """L2->L1 load acks whose copy has finished."""
    prefetch_hits: int = 0
    """Prefetch ops whose agreed L3 hit length is known (``prefetch_hit_queue``)."""
    prefetch_acks: int = 0
    """Reduced prefetch progress acks (``ack_prefetch_queue``)."""
    backup_acks: int = 0
    """L2->L3 backups finished on every rank (``ack_backup_queue``, after the backup vote)."""


class RankSync(ABC):
    """Cross-rank agreement for one rank. All methods return agreed values."""

    def __init__(self, rank: RankInfo, tracer: Tracer) -> None:
        self.rank = rank
        self.tracer = tracer

    def step_sync(self, local: DrainCounts, payload: Any) -> tuple[DrainCounts, Any]:
        """Once per iteration, first thing: rank 0's new requests (``payload``, ignored on
        other ranks; None when there is nothing new) and the agreed drain counts, in one
        exchange. Returns (agreed counts, rank 0's payload)."""
        return self.drain_counts(local), self.broadcast_requests([payload])[0]

    @abstractmethod
    def drain_counts(self, local: DrainCounts) -> DrainCounts:
        """How many of each completion to consume this step. Downstream stages must then
        consume exactly that many, waiting for their own copies/threads if behind."""

    @abstractmethod
    def agree_min(self, value: int, site: str) -> int:
        """A scheduler-thread MIN decided on PP0 and chained (e.g. an immediate backup)."""

    @abstractmethod
    def agree_any(self, flag: bool, site: str) -> bool:
        """A scheduler-thread OR (MAX): true if any TP rank on PP0 says so; chained."""

    @abstractmethod
    def agree_all(self, ok: bool, site: str) -> bool:
        """A scheduler-thread AND over *every* rank, downstream stages included: for outcomes
        that any rank can fail on its own (an allocation). Stages meet here, so it is used
        only where every stage passes in the same order and rarely (inserts, prefetch hits)."""

    @abstractmethod
    def legacy_tp_min(self, value: int, site: str) -> int:
        """Classic per-stage TP MIN, used only by legacy code paths."""

    @abstractmethod
    def legacy_tp_min_many(self, values: Sequence[int], site: str) -> list[int]:
        """Classic per-stage element-wise TP MIN of several values (legacy paths only)."""

    @abstractmethod
    def legacy_chained(self, value: int, site: str) -> int:
        """0.5.13's ``_all_reduce``: a TP MIN on PP0, sent point to point down the pipeline,
        one message per call; a stage ignores its own value. Legacy paths only."""

    @abstractmethod
    def legacy_hit_vote(self, pages: Sequence[int]) -> list[int]:
        """Prefetch thread, pre-#27010: element-wise MIN of the hit pages over this stage's
        TP ranks only (the classic ``prefetch_tp_group``); stages never agree."""

    @abstractmethod
    def hit_vote(self, pages: Sequence[int]) -> list[int]:
        """Prefetch thread: element-wise MIN of the L3 leading hit pages (KV, then each
        sidecar pool) over every rank."""

    @abstractmethod
    def progress_vote(self, values: Sequence[int]) -> list[int]:
        """Prefetch sync thread: element-wise MIN of one progress ack over every rank."""

    @abstractmethod
    def backup_vote(self, pages: int) -> int:
        """Backup thread, once per backup op after its writes: MIN of the pages written
        over every rank. Returning means every rank has finished this op, so the scheduler
        never waits for a peer's storage when it drains the agreed backup acks."""

    @abstractmethod
    def host_capacity(self, tokens: int) -> int:
        """Start-up: MIN of the host pool token capacity over PP stages."""

    @abstractmethod
    def broadcast_requests(self, payload: list[Any] | None) -> list[Any]:
        """Scheduler thread: new requests from rank 0 to every rank, in the same order."""

    def flight_records(self) -> list[dict[str, Any]]:
        """Every op this rank's process groups recorded (for crash bundles); none without
        groups."""
        return []

    def pending_sends(self) -> dict[str, int] | None:
        """Async sends not yet known complete, per group (for state snapshots); ``None`` for a
        rank that never sends asynchronously."""
        return None

    def close(self) -> None:
        """Release communicators."""

    def _trace_vote(self, site: str, local: Any, agreed: Any, **extra: Any) -> None:
        self.tracer.emit(Ev.VOTE, site=site, local=_plain(local), agreed=_plain(agreed), **extra)


class SingleRankSync(RankSync):
    """One rank: every agreement is the local value. Votes are still traced."""

    def drain_counts(self, local: DrainCounts) -> DrainCounts:
        if any(local):
            self._trace_vote("drain_counts", local, local)
        return local

    def agree_min(self, value: int, site: str) -> int:
        self._trace_vote(site, value, value)
        return value

    def agree_any(self, flag: bool, site: str) -> bool:
        self._trace_vote(site, flag, flag)
        return flag

    def agree_all(self, ok: bool, site: str) -> bool:
        self._trace_vote(site, ok, ok)
        return ok

    def legacy_tp_min(self, value: int, site: str) -> int:
        return value

    def legacy_tp_min_many(self, values: Sequence[int], site: str) -> list[int]:
        return list(values)

    def legacy_chained(self, value: int, site: str) -> int:
        return value

    def legacy_hit_vote(self, pages: Sequence[int]) -> list[int]:
        return list(pages)

    def hit_vote(self, pages: Sequence[int]) -> list[int]:
        self._trace_vote("prefetch_hit", list(pages), list(pages))
        return list(pages)

    def progress_vote(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def backup_vote(self, pages: int) -> int:
        return pages

    def host_capacity(self, tokens: int) -> int:
        return tokens

    def broadcast_requests(self, payload: list[Any] | None) -> list[Any]:
        return list(payload or [])


def _plain(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return list(value)
    return value


# --- many ranks ------------------------------------------------------------------------------


class DistributedSync(RankSync):
    """The fixed protocols over real process groups, and the legacy ones behind switches.

    Scheduler-thread decisions are *leader decided*: PP0 reduces over its TP group and sends
    the result down the pipeline (``pp_sync``, point to point); a stage k > 0 never votes, it
    receives PP0's value and must consume exactly that much, waiting for its own work if it is
    behind. There is no PP collective in the scheduler loop: stages run out of phase.

    In-flight chain sends are bounded (#28916): every send on the chain groups is tagged with
    the round it was made in (the agreement helpers' between two rounds included), and each
    round first waits for the sends of rounds older than the pipeline depth, so no remainder
    is left behind. ``unbounded-pp-sends`` restores 0.5.13: no wait, and the chain's sends are
    reaped only once ``is_completed()`` (``_reap_completed_async_work``). On the gloo group
    upstream used (``pp_cache_group`` is the PP group's CPU group) a send reports completed
    only after a ``wait()``, which 0.5.13 never called, so PP0 keeps every chain send it ever
    made, one or more per round, until memory runs out.
    """

    def __init__(self, rank: RankInfo, tracer: Tracer, groups: RankGroups,
                 legacy: frozenset[LegacySwitch], pending_send_limit: int = 0) -> None:
        super().__init__(rank, tracer)
        self.groups = groups
        self.legacy = legacy
        self.pending_send_limit = pending_send_limit
        self._rounds = 0
        self._epoch = 0
        """Rounds started (drain rounds included): the tag of this round's chain sends."""
        self._window = max(1, rank.pp_size - 1)
        """Rounds whose chain sends may still be in flight when a new one starts."""
        self.unbounded = LegacySwitch.UNBOUNDED_PP_SENDS in legacy
        self._prev = rank.rank - rank.tp_size if not rank.is_first_stage else None
        self._next = rank.rank + rank.tp_size if not rank.is_last_stage else None
        self._tp_root = rank.stage_ranks(rank.pp_rank)[0]
        self._tp0 = rank.stage_ranks(0)[0]

    # --- leader-decided, scheduler thread -----------------------------------------------------

    def drain_counts(self, local: DrainCounts) -> DrainCounts:
        self._start_round()
        vec = torch.tensor(list(local), dtype=torch.int64)
        agreed = DrainCounts(*self._decide(vec, dist.ReduceOp.MIN).tolist())
        self._end_round()
        if any(local) or any(agreed):
            self._trace_vote("drain_counts", local, agreed, round=self._rounds)
        return agreed

    def agree_min(self, value: int, site: str) -> int:
        out = int(self._decide(torch.tensor([value], dtype=torch.int64),
                               dist.ReduceOp.MIN).item())
        self._trace_vote(site, value, out)
        return out

    def agree_any(self, flag: bool, site: str) -> bool:
        out = bool(self._decide(torch.tensor([int(flag)], dtype=torch.int64),
                                dist.ReduceOp.MAX).item())
        self._trace_vote(site, flag, out)
        return out

    def agree_all(self, ok: bool, site: str) -> bool:
        t = torch.tensor([int(ok)], dtype=torch.int64)
        out = bool(self.groups.alloc_vote.all_reduce(t, dist.ReduceOp.MIN).item())
        self._trace_vote(site, ok, out)
        return out

    def legacy_tp_min(self, value: int, site: str) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        out = int(self.groups.tp_cpu.all_reduce(t, dist.ReduceOp.MIN).item())
        self._trace_vote(site, value, out)
        return out

    def legacy_tp_min_many(self, values: Sequence[int], site: str) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        out = self.groups.tp_cpu.all_reduce(t, dist.ReduceOp.MIN).tolist()
        self._trace_vote(site, list(values), out)
        return out

    def legacy_chained(self, value: int, site: str) -> int:
        """Upstream sent these counts with tag 2 on the PP group, apart from the rest of the
        PP traffic; here they travel on the ``world`` group, which carries nothing else
        point to point, so they never interleave with the step exchange on ``pp_sync``.
        Messages are matched in order per sender, not per call site: a stage that skips a
        call (``skip-empty-sync``) reads that message in its next call, whatever its site,
        as upstream's stages did. Sends are reaped only once complete, as 0.5.13 did."""
        t = torch.tensor([value], dtype=torch.int64)
        if self.rank.is_first_stage:
            self.groups.tp_cpu.all_reduce(t, dist.ReduceOp.MIN)
        else:
            assert self._prev is not None
            self.groups.world.recv(t, self._prev)
        if self._next is not None:
            self.groups.world.isend(t.clone(), self._next)
            self.groups.world.reap_completed()
        out = int(t.item())
        self._trace_vote(site, value, out, chained=True)
        return out

    def legacy_hit_vote(self, pages: Sequence[int]) -> list[int]:
        t = torch.tensor(list(pages), dtype=torch.int64)
        out = self.groups.prefetch_tp.all_reduce(t, dist.ReduceOp.MIN).tolist()
        self._trace_vote("prefetch_hit", list(pages), out, stage_local=True)
        return out

    def _decide(self, vec: torch.Tensor, op: ReduceOpType) -> torch.Tensor:
        if self.rank.is_first_stage:
            self.groups.tp_cpu.all_reduce(vec, op)
        else:
            assert self._prev is not None
            self.groups.pp_sync.recv(vec, self._prev)
        if self._next is not None:
            self.groups.pp_sync.isend(vec.clone(), self._next)
        return vec

    def _start_round(self) -> None:
        """Backpressure (#28916): before a new round, wait for every chain send of the rounds
        older than the pipeline depth, whichever call made it (the step exchange, or an
        ``agree_min``/``agree_any`` after it). Upstream waits for the previous round; allowing
        ``pp - 1`` rounds in flight keeps the same bound on memory without serialising the
        pipeline. The sends of this round are tagged with it."""
        self._epoch += 1
        chain = (self.groups.pp_sync, self.groups.pp_requests)
        for group in chain:
            group.epoch = self._epoch
        self.groups.pp_requests.wait_through(self._epoch - self._window)
        if not self.unbounded:
            self.groups.pp_sync.wait_through(self._epoch - self._window)

    def _end_round(self) -> None:
        self._rounds += 1
        if self.unbounded and self._next is not None:
            pending = self.groups.pp_sync.reap_completed()
            size = self.groups.pp_sync.pending_bytes()
            self.tracer.emit(Ev.PP_PENDING, pending_sends=pending, bytes=size)
            if self.pending_send_limit and pending > self.pending_send_limit:
                raise ResourceLeak(
                    f"PP{self.rank.pp_rank} holds {pending} unfinished pp_sync sends "
                    f"({size} bytes of cloned tensors) after {self._rounds} rounds "
                    f"(observability.pending_send_limit={self.pending_send_limit})")

    def step_sync(self, local: DrainCounts, payload: Any) -> tuple[DrainCounts, Any]:
        """Requests and drain counts in one exchange: PP0's TP ranks MIN-reduce
        ``[counts..., payload size]`` (only rank 0 offers a size, others offer the maximum),
        then rank 0 broadcasts the payload bytes only when there are any; the same vector
        (and bytes) go down the pipeline. One collective per step on a quiet step, instead of
        three (request broadcast: size + data; count MIN)."""
        self._start_round()
        data = _encode(payload) if self.rank.rank == 0 and payload is not None else None
        size = data.numel() if data is not None else (0 if self.rank.rank == 0 else _NO_SIZE)
        vec = torch.tensor([*local, size], dtype=torch.int64)
        if self.rank.is_first_stage:
            self.groups.tp_cpu.all_reduce(vec, dist.ReduceOp.MIN)
        else:
            assert self._prev is not None
            self.groups.pp_sync.recv(vec, self._prev)
        size = int(vec[-1].item())
        if size:
            if self.rank.is_first_stage:
                if data is None:
                    data = torch.empty(size, dtype=torch.uint8)
                self.groups.tp_cpu.broadcast(data, self._tp0)
            else:
                assert self._prev is not None
                data = torch.empty(size, dtype=torch.uint8)
                self.groups.pp_sync.recv(data, self._prev)
        if self._next is not None:
            self.groups.pp_sync.isend(vec.clone(), self._next)
            if size:
                assert data is not None
                self.groups.pp_sync.isend(data, self._next)
        self._end_round()
        agreed = DrainCounts(*vec[:-1].tolist())
        if any(local) or any(agreed):  # quiet rounds are not traced; ``round`` aligns ranks
            self._trace_vote("drain_counts", local, agreed, round=self._rounds)
        return agreed, (_decode(data) if size and data is not None else None)

    # --- background-thread votes --------------------------------------------------------------

    def hit_vote(self, pages: Sequence[int]) -> list[int]:
        t = torch.tensor(list(pages), dtype=torch.int64)
        out = self.groups.prefetch_hits.all_reduce(t, dist.ReduceOp.MIN).tolist()
        self._trace_vote("prefetch_hit", list(pages), out)
        return out

    def progress_vote(self, values: Sequence[int]) -> list[int]:
        t = torch.tensor(list(values), dtype=torch.int64)
        return self.groups.prefetch_progress.all_reduce(t, dist.ReduceOp.MIN).tolist()

    def backup_vote(self, pages: int) -> int:
        t = torch.tensor([pages], dtype=torch.int64)
        return int(self.groups.l3_backup.all_reduce(t, dist.ReduceOp.MIN).item())

    def host_capacity(self, tokens: int) -> int:
        t = torch.tensor([tokens], dtype=torch.int64)
        return int(self.groups.world.all_reduce(t, dist.ReduceOp.MIN).item())

    # --- requests -------------------------------------------------------------------------------

    def broadcast_requests(self, payload: list[Any] | None) -> list[Any]:
        """Rank 0's new requests reach every TP rank of PP0 by broadcast, then every stage by
        point to point (each TP rank to the same TP rank of the next stage)."""
        if self.rank.is_first_stage:
            payload = self.groups.tp_cpu.broadcast_object(payload, src=self._tp0)
        else:
            assert self._prev is not None
            payload = self.groups.pp_requests.recv_object(self._prev)
        if self._next is not None:
            self.groups.pp_requests.isend_object(payload, self._next)  # reaped by rounds
        return list(payload or [])

    def flight_records(self) -> list[dict[str, Any]]:
        return self.groups.recorder.records()

    def pending_sends(self) -> dict[str, int]:
        """Async sends not yet known complete, per group (for state snapshots)."""
        return {g.name: len(g.pending) for g in self.groups.all() if g.pending}

    def close(self) -> None:
        for g in self.groups.all():
            g.close()


#: What non-zero ranks offer as the payload size in the step MIN: never the minimum.
_NO_SIZE = 2**62


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())
