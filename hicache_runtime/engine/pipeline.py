"""The event loop of one rank in a TP x PP run.

Every rank runs its own scheduler over its own tree; they stay in step only through the sync
protocols. Iteration ``i`` of every rank, for micro-batch slot ``s = i mod pp``:

1. rank 0's new requests and aborts reach every rank (``broadcast_requests``);
2. the results of slot ``s``'s previous batch are applied: the last stage sent its sampled
   tokens round the ring (last -> PP0 -> PP1 ...), so every stage applies the same tokens at
   the same point of its own sequence;
3. slot ``s``'s next batch is formed (``check_events`` votes included);
4. the batch runs through this stage: PP0 embeds, a later stage receives the hidden states and
   the sender's batch description from the previous stage and views them with its *own* batch
   (so a disagreeing stage fails as production did); a non-last stage sends on; the last stage
   samples and sends the tokens to PP0.

Stages run at their own pace: PP0 runs up to ``pp`` iterations ahead of the last stage, which
is the pipeline's depth. Rank 0 decides when the run is over and says so with the requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from faults.points import FaultPoint
from hicache_runtime.cache.accounting import check_at_drain
from hicache_runtime.contracts.events import Ev
from hicache_runtime.dist.protocols import DrainCounts
from hicache_runtime.engine.step import Engine, EngineResult
from hicache_runtime.kv.request import Req

if TYPE_CHECKING:
    from hicache_runtime.dist.consensus_check import ConsensusChecker
    from hicache_runtime.dist.groups import RankGroups
    from hicache_runtime.engine.model import ForwardBatch
    from hicache_runtime.engine.scheduler import ScheduleBatch

_IDLE_SLEEP_S = 0.0005
_DRAIN_POLL_S = 0.01


@dataclass
class PipelineEngine(Engine):
    """One rank of a multi-rank run. ``workload`` is used on rank 0 only."""

    groups: RankGroups | None = None
    consensus: ConsensusChecker | None = None
    local_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Last stage: sampled tokens of each slot's in-flight batch, applied one round later."""
    sampler: Callable[[int], None] | None = None
    """Called with the step number after every step (resource samples, ``samples.py``)."""

    def run(self) -> EngineResult:
        rt, sched = self.rt, self.rt.scheduler
        rank = rt.rank
        pp = rank.pp_size
        finished: dict[str, Req] = {}
        all_reqs: dict[str, Req] = {}
        start = time.monotonic()
        every = rt.cfg.observability.check_integrity_every
        while True:
            self.step += 1
            slot = (self.step - 1) % pp
            rt.tracer.step = self.step
            self._fault_point(FaultPoint.SCHEDULER_STEP)
            msg, agreed = self._exchange_requests(finished)
            if msg.get("stop"):
                break
            self._reap_sends()
            self._apply_requests(msg, all_reqs)
            prev = sched.slots[slot].in_flight
            if prev is not None:
                sched.process_result(prev, self._result_tokens(prev))
            self._fault_point(FaultPoint.CACHE_EVENTS)
            batch = sched.next_batch(self.step, slot, agreed)
            if batch is not None:
                self._run_stage(batch)
                if pp == 1:
                    sched.process_result(batch, self.local_tokens.pop(slot))
            for req in sched.finished:
                finished[req.rid] = req
            sched.finished.clear()
            if self.consensus is not None:
                self.consensus.check()
            if batch is not None or msg.get("reqs") or not sched.has_work:
                self.heartbeat()
            if every and self.step % every == 0:
                sched.check_integrity()
            if self.on_step is not None:
                self.on_step(self.step, len(finished), self.workload.total)
            if self.sampler is not None:
                self.sampler(self.step)
            if batch is None and sched.has_work:
                time.sleep(_IDLE_SLEEP_S)
        self._drain()
        return EngineResult(all_reqs, self.step, time.monotonic() - start)

    # --- requests ------------------------------------------------------------------------------

    def _exchange_requests(self, finished: dict[str, Req]
                           ) -> tuple[dict[str, Any], DrainCounts]:
        """Rank 0 polls the workload and client aborts; every rank gets the same message, and
        the step's agreed drain counts in the same exchange."""
        msg: dict[str, Any] | None = None
        if self.rt.rank.rank == 0:
            sched = self.rt.scheduler
            reqs = self.workload.poll(self.step, finished)
            aborts = self.workload.aborts(self.step)
            self._inbox = self.rt.aborts.take()
            aborts += [rid for rid, _ in self._inbox]
            stop = not reqs and not sched.has_work and self.workload.exhausted()
            if reqs or aborts or stop:
                msg = {"reqs": reqs, "aborts": aborts, "stop": stop}
        local = self.rt.cache.local_drain_counts()
        agreed, out = self.rt.sync.step_sync(local, msg)
        return (out or {}), agreed

    def _apply_requests(self, msg: dict[str, Any], all_reqs: dict[str, Req]) -> None:
        sched = self.rt.scheduler
        for req in msg.get("reqs", []):
            all_reqs[req.rid] = req
            sched.add_request(req)
        for rid in msg.get("aborts", []):
            sched.abort(rid)
        for _, applied in getattr(self, "_inbox", []):
            applied.set()
        self._inbox = []

    # --- one stage of one batch -----------------------------------------------------------------

    def _run_stage(self, batch: ScheduleBatch) -> None:
        rt, rank = self.rt, self.rt.rank
        fwd = batch.forward
        hidden = None if rank.is_first_stage else self._recv_activation(fwd)
        self._fault_point(FaultPoint.FORWARD)
        out = rt.model.forward(fwd, rt.device_pool, hidden)
        if not rank.is_last_stage:
            self._send_activation(batch, out)
            return
        tokens = out.tolist()
        self.local_tokens[batch.slot] = tokens
        if rank.pp_size > 1:
            assert self.groups is not None
            self.groups.pp_out.isend_object(tokens, rank.stage_ranks(0)[rank.tp_rank])

    def _send_activation(self, batch: ScheduleBatch, hidden: torch.Tensor) -> None:
        assert self.groups is not None
        rank = self.rt.rank
        dst = rank.rank + rank.tp_size
        fwd = batch.forward
        desc = {"step": self.step, "slot": batch.slot, "rids": fwd.rids,
                "extend": fwd.extend_lens, "prefix": fwd.prefix_lens,
                "shape": list(hidden.shape)}
        self.groups.pp_act.isend_object(desc, dst)
        self.groups.pp_act.isend(hidden.contiguous(), dst)
        self.rt.tracer.emit(Ev.PP_SEND, tokens=fwd.num_tokens, rids=fwd.rids)

    def _recv_activation(self, fwd: ForwardBatch) -> torch.Tensor:
        assert self.groups is not None
        rank = self.rt.rank
        src = rank.rank - rank.tp_size
        desc = self.groups.pp_act.recv_object(src)
        hidden = torch.empty(desc["shape"], dtype=self.rt.model.dtype)
        self.groups.pp_act.recv(hidden, src)
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
        (gloo's ``is_completed()`` stays false until a wait: reaping by it keeps every send.)"""
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
        assert self.groups is not None
        last = rank.stage_ranks(rank.pp_size - 1)[rank.tp_rank]
        src = last if rank.is_first_stage else rank.rank - rank.tp_size
        tokens: list[int] = self.groups.pp_out.recv_object(src)
        nxt = rank.rank + rank.tp_size
        if rank.pp_rank + 1 < rank.pp_size - 1:
            self.groups.pp_out.isend_object(tokens, nxt)
        return tokens

    # --- end of run -------------------------------------------------------------------------------

    def _drain(self) -> None:
        """Consume every outstanding transfer. Each round is one agreed vote on every rank, so
        ranks run the same number of rounds (``idle`` alone is rank-local)."""
        cache, sync = self.rt.cache, self.rt.sync
        rounds = 0
        while True:
            rounds += 1
            cache.check_events()
            if sync.agree_min(int(cache.idle()), "drain_idle"):
                break
            time.sleep(_DRAIN_POLL_S)
        for group in (self.groups.all() if self.groups is not None else []):
            group.wait_pending()
        check_at_drain(cache)
        self.rt.tracer.emit(Ev.INTEGRITY, ok=True, at="drain", rounds=rounds)
