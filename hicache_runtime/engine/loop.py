"""The step loop of one rank, for every topology.

A single rank is the degenerate pipeline: one stage (``pp = 1``), one TP rank and no peers
(``groups`` is ``None``). Every rank runs its own scheduler over its own tree; ranks stay in step
only through the sync protocols. Iteration ``i`` of every rank, for micro-batch slot
``s = i mod pp``:

1. the step's new requests and aborts come in: a lone rank polls its workload; with peers, rank
   0 polls and its requests and aborts reach every rank together with the step's agreed drain
   counts (``step_sync``). That message is the step's plan: an abort takes effect only
   through it, at the same point of the same step on every rank; one that arrives on rank 0
   in the middle of a step (a ``chunked-abort`` fault) waits for the next step's plan;
2. the results of slot ``s``'s previous batch are applied: the last stage sent its sampled
   tokens round the ring (last -> PP0 -> PP1 ...), so every stage applies the same tokens at
   the same point of its own sequence (with one stage a batch's tokens are applied as soon as
   it ran, so no batch is left in flight);
3. slot ``s``'s next batch is formed (``check_events`` votes included);
4. the batch runs through this stage: PP0 embeds, a later stage receives the hidden states and
   the sender's batch description from the previous stage and views them with its *own* batch
   (so a disagreeing stage fails as production did); a non-last stage sends on; the last stage
   samples and, with several stages, sends the tokens to PP0.

Stages run at their own pace: PP0 runs up to ``pp`` iterations ahead of the last stage, which
is the pipeline's depth. A lone rank stops after the step that left it nothing to do; with
peers, rank 0 decides when the run is over and says so with the next step's requests. Then
every transfer is drained and pool/tree integrity is checked. The scheduler-thread fault points
fire at fixed places of the step, and the step watchdog is fed whenever a step made progress.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

import torch

from faults.kinds import KINDS, StepVisit
from faults.points import FaultPoint
from hicache_runtime.cache.accounting import check_at_drain
from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.engine.rank import RankRuntime
from hicache_runtime.engine.workload import Intake
from hicache_runtime.kv.request import Req, ReqStatus

if TYPE_CHECKING:
    from faults.injector import FaultInjector
    from hicache_runtime.dist.consensus_check import ConsensusChecker
    from hicache_runtime.dist.groups import RankGroups
    from hicache_runtime.dist.protocols import DrainCounts
    from hicache_runtime.engine.model import ForwardBatch
    from hicache_runtime.engine.scheduler import ScheduleBatch

_IDLE_SLEEP_S = 0.0005
"""Sleep when a step had nothing to run but work is pending (background copies/IO)."""
_DRAIN_POLL_S = 0.01
"""Pause between two agreed drain rounds while transfers are still in flight."""


def act_at(faults: FaultInjector | None, point: FaultPoint, step: int, tokens: int = 0) -> None:
    """Act on the faults that fire at a scheduler-thread point of ``step``; ``tokens``: what
    the forward about to run computes (``model.forward``; the start-up profile's is step 0)."""
    if faults is None or not faults.armed(point):
        return
    visit = StepVisit(point, step, tokens, journal=faults.write_journal)
    for spec in faults.fire(point, step=step):
        KINDS[spec.kind].on_step(spec, visit)


@dataclass
class EngineResult:
    """What one rank's loop produced."""

    reqs: dict[str, Req]
    steps: int
    wall_s: float

    @property
    def completed(self) -> int:
        return sum(1 for r in self.reqs.values() if r.status is ReqStatus.FINISHED)

    @property
    def aborted(self) -> int:
        return sum(1 for r in self.reqs.values() if r.status is ReqStatus.ABORTED)

    def cached_tokens(self) -> dict[str, int]:
        out = {"device": 0, "host": 0, "storage": 0}
        for r in self.reqs.values():
            for k in out:
                out[k] += r.cached[k]
        return out


class RequestMessage(TypedDict, total=False):
    """What rank 0 tells every rank at the start of a step (sent pickled, as a plain dict):
    the step's plan."""

    reqs: list[Req]
    aborts: list[str]
    """Abort intents: every rank applies them at this step (``Scheduler.abort``), whichever
    thread or step they arrived in on rank 0."""
    stop: bool


@dataclass
class StepInput:
    """What a step starts from."""

    reqs: list[Req] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    """Client aborts, then the aborts other threads asked for (``RankRuntime.aborts``)."""
    applied: list[threading.Event] = field(default_factory=list)
    """Set once the aborts are applied; only the rank that took them from its inbox has them."""
    stop: bool = False
    """Rank 0 said the run is over (ranks with peers only)."""
    agreed: DrainCounts | None = None
    """The step's drain counts agreed across ranks; ``None`` for a lone rank (its own)."""


@dataclass
class Engine:
    """Runs one rank to completion. Scheduler thread = the thread calling :meth:`run`."""

    rt: RankRuntime
    workload: Intake
    """Polled by rank 0 only (the only rank of a single-rank run)."""
    on_step: Callable[[int, int, int], None] | None = None
    """Called after each step with (step, finished, total) (progress bars)."""
    heartbeat: Callable[[], None] = field(default=lambda: None)
    step: int = 0
    groups: RankGroups | None = None
    """This rank's process groups to its peers; ``None`` for a single rank."""
    consensus: ConsensusChecker | None = None
    sampler: Callable[[int], None] | None = None
    """Called with the step number after every step (resource samples, ``samples.py``)."""
    local_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Last stage: sampled tokens of each slot's in-flight batch until they are applied (one
    round later with several stages, in the same step with one)."""
    intents: list[str] = field(default_factory=list)
    """Rank 0: aborts that arrived in the middle of a step, for the next step's plan."""
    chunks_run: dict[str, int] = field(default_factory=dict)
    """Rank 0, with a ``chunked-abort`` fault armed: chunks run so far of each request in
    chunked prefill."""

    def run(self) -> EngineResult:
        finished: dict[str, Req] = {}
        all_reqs: dict[str, Req] = {}
        start = time.monotonic()
        while self._step(finished, all_reqs):
            pass
        self._drain()
        return EngineResult(all_reqs, self.step, time.monotonic() - start)

    def _step(self, finished: dict[str, Req], all_reqs: dict[str, Req]) -> bool:
        """One iteration (module docstring); False once the run is over."""
        rt, sched = self.rt, self.rt.scheduler
        self.step += 1
        slot = (self.step - 1) % rt.rank.pp_size
        rt.tracer.step = self.step
        self._fault_point(FaultPoint.SCHEDULER_STEP)
        intake = self._poll(finished) if self.groups is None \
            else self._exchange_requests(finished)
        if intake.stop:
            return False
        self._reap_sends()
        self._apply_requests(intake, all_reqs)
        prev = sched.slots[slot].in_flight
        if prev is not None:
            sched.process_result(prev, self._result_tokens(prev))
            self._chunk_boundaries(prev)
        self._fault_point(FaultPoint.CACHE_EVENTS)
        batch = sched.next_batch(self.step, slot, intake.agreed)
        if self.consensus is not None:  # every decision up to this batch, compared first
            self.consensus.verify(self.step, rt.cfg.observability.protocol_timeout_s)
        if batch is not None:
            self._run_stage(batch)
            if rt.rank.pp_size == 1:
                sched.process_result(batch, self.local_tokens.pop(slot))
                self._chunk_boundaries(batch)
        for req in sched.finished:
            finished[req.rid] = req
        sched.finished.clear()
        self._end_step(batch is not None or bool(intake.reqs), len(finished))
        if self.groups is None and not sched.has_work and self.workload.exhausted():
            return False  # nobody to tell: a lone rank stops as soon as it is done
        if batch is None and sched.has_work:
            time.sleep(_IDLE_SLEEP_S)
        return True

    def _end_step(self, progressed: bool, finished: int) -> None:
        """Checks, the watchdog's heartbeat, progress reports and resource samples."""
        sched = self.rt.scheduler
        if self.consensus is not None:
            self.consensus.check()
        if progressed or not sched.has_work:
            self.heartbeat()
        every = self.rt.cfg.observability.check_integrity_every
        if every and self.step % every == 0:
            sched.check_integrity()
        if self.on_step is not None:
            self.on_step(self.step, finished, self.workload.total)
        if self.sampler is not None:
            self.sampler(self.step)

    def _fault_point(self, point: FaultPoint, tokens: int = 0) -> None:
        act_at(self.rt.faults, point, self.step, tokens)

    # --- requests ------------------------------------------------------------------------------

    def _poll(self, finished: dict[str, Req]) -> StepInput:
        """Rank 0 (or the only rank): the workload's arrivals and client aborts of this step,
        then the aborts other threads asked for, after the ones that arrived in the middle of
        the previous step. All of them go into this step's plan."""
        reqs = self.workload.poll(self.step, finished)
        arrived = [(rid, "client") for rid in self.workload.aborts(self.step)]
        inbox = self.rt.aborts.take()
        arrived += [(rid, "thread") for rid, _ in inbox]
        aborts, self.intents = self.intents, []
        aborts += [rid for rid, source in arrived if self._abort_arrived(rid, source, self.step)]
        return StepInput(reqs, aborts, [done for _, done in inbox])

    def _abort_arrived(self, rid: str, source: str, apply_step: int) -> bool:
        """An abort arrived on rank 0; True when it is to ride the plan of ``apply_step``.
        ``abort-chunked-on-the-spot`` tears a request between two chunks of its prefill down
        here instead, on this rank only, and tells no one."""
        legacy = LegacySwitch.ABORT_CHUNKED_ON_THE_SPOT in self.rt.cfg.legacy
        if legacy and self.rt.scheduler.abort_on_the_spot(rid):
            self.rt.tracer.emit(Ev.ABORT_RECEIVED, rid=rid, source=source, deferred=False,
                                apply_step=self.step)
            return False
        self.rt.tracer.emit(Ev.ABORT_RECEIVED, rid=rid, source=source,
                            deferred=apply_step > self.step, apply_step=apply_step)
        return True

    def _chunk_boundaries(self, batch: ScheduleBatch) -> None:
        """Rank 0, with a ``chunked-abort`` fault armed: the ``prefill.chunk`` fault point
        after each chunk of a chunked prefill. The abort arrives here, in the middle of the
        step, where the other ranks are elsewhere: it waits in ``intents`` for the next step's
        plan (or, with ``abort-chunked-on-the-spot``, tears the request down now)."""
        faults = self.rt.faults
        if faults is None or self.rt.rank.rank != 0 \
                or not faults.armed(FaultPoint.PREFILL_CHUNK):
            return
        for req, sample in zip(batch.reqs, batch.forward.sample):
            if sample:
                self.chunks_run.pop(req.rid, None)
                continue
            index = self.chunks_run.get(req.rid, 0)
            self.chunks_run[req.rid] = index + 1
            fired = [] if req.done else faults.fire(FaultPoint.PREFILL_CHUNK, step=self.step,
                                                    rid=req.rid, chunk=index)
            if not any(KINDS[s.kind].aborts(s) for s in fired):
                continue
            if self._abort_arrived(req.rid, "fault", self.step + 1):
                self.intents.append(req.rid)

    def _exchange_requests(self, finished: dict[str, Req]) -> StepInput:
        """Rank 0 polls (and decides whether the run is over); every rank gets the same message,
        and the step's agreed drain counts in the same exchange."""
        mine = StepInput()
        msg: RequestMessage | None = None
        if self.rt.rank.rank == 0:
            mine = self._poll(finished)
            stop = not mine.reqs and not self.rt.scheduler.has_work \
                and self.workload.exhausted()
            if mine.reqs or mine.aborts or stop:
                msg = {"reqs": mine.reqs, "aborts": mine.aborts, "stop": stop}
        local = self.rt.cache.local_drain_counts()
        agreed, out = self.rt.sync.step_sync(local, msg)
        got: RequestMessage = cast(RequestMessage, out or {})
        return StepInput(got.get("reqs", []), got.get("aborts", []), mine.applied,
                         bool(got.get("stop")), agreed)

    def _apply_requests(self, intake: StepInput, all_reqs: dict[str, Req]) -> None:
        sched = self.rt.scheduler
        for req in intake.reqs:
            all_reqs[req.rid] = req
            sched.add_request(req)
        if intake.aborts:
            self.rt.tracer.emit(Ev.PLAN_ABORTS, rids=list(intake.aborts))
        for rid in intake.aborts:
            sched.abort(rid)
        for applied in intake.applied:
            applied.set()

    # --- one stage of one batch -----------------------------------------------------------------

    def _run_stage(self, batch: ScheduleBatch) -> None:
        rt, rank = self.rt, self.rt.rank
        fwd = batch.forward
        hidden = None if rank.is_first_stage else self._recv_activation(fwd)
        self._fault_point(FaultPoint.FORWARD, tokens=fwd.num_tokens)
        out = rt.model.forward(fwd, rt.device_pool, hidden)
        if not rank.is_last_stage:
            self._send_activation(batch, out)
            return
        tokens = out.tolist()
        self.local_tokens[batch.slot] = tokens
        if rank.pp_size > 1:
            self._peers().pp_out.isend_object(tokens, rank.stage_ranks(0)[rank.tp_rank])

    def _send_activation(self, batch: ScheduleBatch, hidden: torch.Tensor) -> None:
        groups, rank = self._peers(), self.rt.rank
        dst = rank.rank + rank.tp_size
        fwd = batch.forward
        desc = {"step": self.step, "slot": batch.slot, "rids": fwd.rids,
                "extend": fwd.extend_lens, "prefix": fwd.prefix_lens,
                "shape": list(hidden.shape)}
        groups.pp_act.isend_object(desc, dst)
        groups.pp_act.isend(hidden.contiguous(), dst)
        self.rt.tracer.emit(Ev.PP_SEND, tokens=fwd.num_tokens, rids=fwd.rids)

    def _recv_activation(self, fwd: ForwardBatch) -> torch.Tensor:
        groups, rank = self._peers(), self.rt.rank
        src = rank.rank - rank.tp_size
        desc = groups.pp_act.recv_object(src)
        hidden = torch.empty(desc["shape"], dtype=self.rt.model.dtype)
        groups.pp_act.recv(hidden, src)
        self.rt.tracer.emit(Ev.PP_RECV, sender_tokens=desc["shape"][0],
                            local_tokens=fwd.num_tokens, sender_rids=desc["rids"],
                            local_rids=fwd.rids, sender_extend=desc["extend"],
                            local_extend=fwd.extend_lens, sender_step=desc["step"])
        return hidden

    def _reap_sends(self) -> None:
        """Bound the activation and token channels: their sends are tagged with the step that
        made them, and at step ``i`` (after the step exchange) the sends of step ``i - pp - 1``
        and before are waited on, which the peer has certainly received by then:

        * activations sent at step ``j`` are received by the next stage at its step ``j``;
          this stage's chain backpressure (``sync``) waited at step ``i`` until the next stage
          started step ``i - pp + 1`` at the latest, so it finished step ``j <= i - pp``;
        * tokens sent by the last stage at step ``j`` are received by PP0 at step ``j + pp``;
          the last stage is at step ``i`` only once PP0 started it (the chain), so PP0 has
          finished step ``i - 1 >= j + pp``; a stage forwarding tokens is covered as for
          activations.

        So the waits return at once, and the channels hold at most ``pp + 1`` steps of sends.
        (gloo's ``is_completed()`` stays false until a wait: reaping by it keeps every send.)
        A lone rank sends nothing."""
        if self.groups is None:
            return
        done = self.step - self.rt.rank.pp_size - 1
        for group in (self.groups.pp_act, self.groups.pp_out):
            group.wait_through(done)
            group.epoch = self.step

    def _result_tokens(self, batch: ScheduleBatch) -> list[int]:
        """The sampled tokens of ``batch`` (launched ``pp`` iterations ago)."""
        rank = self.rt.rank
        if rank.is_last_stage:
            return self.local_tokens.pop(batch.slot)
        groups = self._peers()
        last = rank.stage_ranks(rank.pp_size - 1)[rank.tp_rank]
        src = last if rank.is_first_stage else rank.rank - rank.tp_size
        tokens: list[int] = groups.pp_out.recv_object(src)
        nxt = rank.rank + rank.tp_size
        if rank.pp_rank + 1 < rank.pp_size - 1:
            groups.pp_out.isend_object(tokens, nxt)
        return tokens

    def _peers(self) -> RankGroups:
        """The groups to the other stages; only a rank of several stages talks to them."""
        if self.groups is None:
            raise InvariantViolation(f"rank {self.rt.rank.rank} has no peers, yet "
                                     f"{self.rt.rank.pp_size} pipeline stages")
        return self.groups

    # --- end of run -------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Consume every outstanding transfer, then check pool and tree integrity. A lone rank
        waits for its own transfers. Ranks with peers drain in rounds, each one agreed vote on
        every rank, so ranks run the same number of rounds (``idle`` alone is rank-local)."""
        cache, sync = self.rt.cache, self.rt.sync
        cache.stop_stepping()
        if self.groups is None:
            cache.drain()
            check_at_drain(cache)
            self.rt.tracer.emit(Ev.INTEGRITY, ok=True, at="drain")
            return
        rounds = 0
        while True:
            rounds += 1
            cache.check_events()
            if sync.agree_min(int(cache.idle()), "drain_idle"):
                break
            time.sleep(_DRAIN_POLL_S)
        for group in self.groups.all():
            group.wait_pending()
        check_at_drain(cache)
        self.rt.tracer.emit(Ev.INTEGRITY, ok=True, at="drain", rounds=rounds)
