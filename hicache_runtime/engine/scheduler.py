"""The scheduler of one rank: waiting queue, batch formation, decode, abort, retraction.

Each step follows SGLang's order:

1. ``cache.check_events()`` consumes completed transfers (agreed counts);
2. a prefill batch is formed from the waiting queue: prefetch check, prefix match and
   load-back, lock, device allocation (evicting on demand), chunking of long prompts;
3. otherwise a decode batch of the running requests, retracting the newest ones when L1 cannot
   hold one more token each.

Under pipeline parallelism several micro-batches are in flight: requests belong to one of
``num_slots`` micro-batch slots (SGLang's ``running_mbs``). A step forms the next batch of one
slot, after the results of that slot's previous batch have been applied; a request never moves
between slots.

The scheduler is deterministic given the same sequence of arrivals and the same cache state,
which is what keeps ranks that run their own scheduler (every TP and PP rank does) in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hicache_runtime.cache.interface import PrefixCache
from hicache_runtime.config import SchedulerConfig
from hicache_runtime.contracts.errors import InvariantViolation
from hicache_runtime.contracts.events import Ev
from hicache_runtime.dist.protocols import DrainCounts
from hicache_runtime.engine.chunking import LatencyModel
from hicache_runtime.engine.model import ForwardBatch
from hicache_runtime.kv.request import Req, ReqStatus
from hicache_runtime.telemetry.tracer import Tracer

if TYPE_CHECKING:
    from hicache_runtime.kv.radix_tree import TreeNode


@dataclass
class ScheduleBatch:
    """The requests of one step and the model's view of them."""

    reqs: list[Req]
    forward: ForwardBatch
    step: int
    slot: int = 0
    finished: list[Req] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return self.forward.is_decode


@dataclass
class MicroBatchSlot:
    """The requests of one micro-batch slot and the batch of it now in the pipeline."""

    running: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None
    in_flight: ScheduleBatch | None = None

    def reqs(self) -> list[Req]:
        """Every request this slot holds KV for (running, chunked, or in the pipeline)."""
        out = [*self.running, *([self.chunked_req] if self.chunked_req else [])]
        if self.in_flight is not None:
            out.extend(r for r in self.in_flight.reqs if r not in out and not r.done)
        return out


class Scheduler:
    """Forms batches for one rank and applies their results."""

    def __init__(self, cfg: SchedulerConfig, cache: PrefixCache, tracer: Tracer,
                 num_slots: int = 1) -> None:
        self.cfg = cfg
        self.cache = cache
        self.tracer = tracer
        self.page_size = cache.page_size
        self.waiting: list[Req] = []
        self.slots = [MicroBatchSlot() for _ in range(num_slots)]
        self._cur = 0
        self.finished: list[Req] = []
        self.chunk_model: LatencyModel | None = None
        """Dynamic chunking's latency model (:meth:`use_chunk_model`); None: fixed chunks."""
        self.pending_aborts: list[str] = []
        """Requests between two chunks of their prefill whose abort the step's plan carried;
        torn down at the start of the step's batch formation."""

    # The slot being formed; batch formation below only ever touches this one.
    @property
    def running(self) -> list[Req]:
        return self.slots[self._cur].running

    @property
    def chunked_req(self) -> Req | None:
        return self.slots[self._cur].chunked_req

    @chunked_req.setter
    def chunked_req(self, req: Req | None) -> None:
        self.slots[self._cur].chunked_req = req

    # --- queue --------------------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Admit a new request to the waiting queue (rejecting ones that can never fit)."""
        need = _round_up(req.seq_len + req.max_new_tokens, self.page_size)
        if need > self.cache.device.capacity_tokens:
            req.status, req.abort_reason = ReqStatus.ABORTED, "longer than the device pool"
            self.finished.append(req)
            self.tracer.emit(Ev.REQ_REJECT, rid=req.rid, tokens=need)
            return
        self.waiting.append(req)
        self.tracer.emit(Ev.REQ_ARRIVE, rid=req.rid, tokens=req.seq_len,
                         max_new=req.max_new_tokens)
        self.cache.on_enqueue(req)

    def abort(self, rid: str) -> bool:
        """Receive the abort of ``rid`` carried by the step's plan: every rank calls this at
        the same point of the step (``engine/loop.py``). Returns False if the request is
        unknown or already done.

        A waiting request holds no KV and leaves the queue at once, as does a running one
        outside the pipeline. A request whose batch is in the pipeline is finished when that
        batch comes back. One between two chunks of its prefill is never torn down here: it
        is recorded (``pending_aborts``) and torn down at the start of the step's batch
        formation (:meth:`next_batch`), where every rank tears down the same request before
        forming the same batch (SGLang's ``_pending_chunked_abort_req``)."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.cache.on_abort(req)
                return self._abort_finish(req, "waiting")
        for slot in self.slots:
            for req in slot.reqs():
                if req.rid != rid:
                    continue
                if slot.in_flight is not None and req in slot.in_flight.reqs:
                    req.abort_pending = True  # finished when its batch's result comes back
                    return True
                if req is slot.chunked_req:
                    self.pending_aborts.append(rid)
                    return True
                slot.running.remove(req)
                self.cache.cache_finished_req(req)
                return self._abort_finish(req, "running")
        return False

    def abort_on_the_spot(self, rid: str) -> bool:
        """``abort-chunked-on-the-spot``: where an abort arrives (rank 0, possibly in the middle
        of its step), a request between two chunks of its prefill and outside the pipeline
        is torn down there and then, on this rank only. Returns True when it was (the abort
        then goes no further); anything else takes the plan like every abort."""
        for slot in self.slots:
            req = slot.chunked_req
            if req is None or req.rid != rid:
                continue
            if slot.in_flight is not None and req in slot.in_flight.reqs:
                return False
            slot.chunked_req = None
            self.cache.cache_finished_req(req)
            return self._abort_finish(req, "chunked", on_the_spot=True)
        return False

    def _apply_pending_aborts(self) -> None:
        """Tear down the chunked requests whose abort was recorded: the first thing of a
        batch formation, a point every rank passes in the same state."""
        pending, self.pending_aborts = self.pending_aborts, []
        for rid in pending:
            for slot in self.slots:
                req = slot.chunked_req
                if req is None or req.rid != rid:
                    continue
                # nothing forms a batch between the abort and here, so it is still outside
                # the pipeline
                assert slot.in_flight is None or req not in slot.in_flight.reqs
                slot.chunked_req = None
                self.cache.cache_finished_req(req)
                self._abort_finish(req, "chunked", deferred=True)

    def _abort_finish(self, req: Req, where: str, *, deferred: bool = False,
                      on_the_spot: bool = False) -> bool:
        """Finish an aborted request whose KV is already released; ``where`` it was (waiting,
        chunked: between two chunks of its prefill, running), whether it waited for a batch
        formation or its batch's return (``deferred``), and whether it was torn down where the
        abort arrived instead (``on_the_spot``, the legacy path)."""
        self.tracer.emit(Ev.ABORT_APPLIED, rid=req.rid, where=where, deferred=deferred,
                         on_the_spot=on_the_spot)
        return self._finish(req, ReqStatus.ABORTED, "client abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.running or s.chunked_req or s.in_flight
                                         for s in self.slots)

    def _all_reqs(self) -> list[Req]:
        return [r for s in self.slots for r in s.reqs()]

    def held_nodes(self) -> list[TreeNode | None]:
        """Prefix nodes locked by requests (for the lock-accounting check)."""
        return [r.last_node for r in self._all_reqs()]

    def check_integrity(self) -> None:
        self.cache.check_integrity(self.request_owned_tokens(), self.held_nodes())

    def request_owned_tokens(self) -> int:
        """Device tokens held by requests outside the tree (for the integrity check)."""
        return sum(int(r.kv_slots.numel()) - r.prefix_len for r in self._all_reqs())

    # --- batch formation ---------------------------------------------------------------------

    def next_batch(self, step: int, slot: int = 0,
                   agreed: DrainCounts | None = None) -> ScheduleBatch | None:
        """Consume completions (``agreed`` counts if the caller has them), then form slot
        ``slot``'s next batch: a prefill batch, else a decode batch. The slot's previous
        batch must have been processed."""
        self._cur = slot
        if self.slots[slot].in_flight is not None:
            raise InvariantViolation(f"slot {slot} still has a batch in flight")
        self._apply_pending_aborts()
        self.cache.check_events(agreed)
        batch = self._prefill_batch(step) or self._decode_batch(step)
        # Start queued load-backs even when no batch runs now: a load whose request was not
        # admitted still holds its lock until its ack, and L1 may be full of such locks.
        consumer = self.cache.start_loading()
        if batch is not None:
            batch.slot = slot
            self.slots[slot].in_flight = batch
            batch.forward.consumer = consumer
            self.tracer.emit(Ev.BATCH, decode=batch.is_decode, rids=batch.forward.rids,
                             extend=batch.forward.extend_lens, prefix=batch.forward.prefix_lens,
                             tokens=batch.forward.num_tokens, slot=slot)
        return batch

    def _budget(self) -> int:
        running = [r for s in self.slots for r in s.running]
        reserve = sum(r.remaining_tokens for r in running) * self.cfg.decode_reserve_ratio
        return self.cache.available_tokens - int(reserve)

    def _prefill_batch(self, step: int) -> ScheduleBatch | None:
        rem_total = self._budget()
        rem_prefill = self.cfg.max_prefill_tokens
        reqs: list[Req] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            granted = self._grant(req, req.kv_len, rem_prefill, rem_total)
            if granted is None:
                return None
            reqs.append(req)
            rem_prefill, rem_total = rem_prefill - granted[0], rem_total - granted[1]
        ordered = sorted(self.waiting, key=lambda r: -r.seq_len) \
            if self.cfg.schedule_policy == "lpm" else list(self.waiting)
        for req in ordered:
            if self.chunked_req is not None or rem_prefill < self.page_size:
                break
            if self._num_running() + len(reqs) >= self.cfg.max_running_requests:
                break
            if not self.cache.prefetch_ready(req):
                continue
            plan = self.cache.prepare_prefix(req, mem_quota=max(rem_total, 0))
            self.cache.lock(plan.last_node)
            req.kv_slots, req.prefix_len, req.kv_len = plan.indices, len(plan.indices), \
                len(plan.indices)
            req.last_node = plan.last_node
            granted = self._grant(req, req.prefix_len, rem_prefill, rem_total)
            if granted is None:
                self.cache.unlock(plan.last_node)
                req.reset_kv()
                break
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            req.storage_pending = 0
            self.cache.on_admit(req)
            for tier, n in (("device", plan.device_hit), ("host", plan.host_hit - plan.storage_hit),
                            ("storage", plan.storage_hit)):
                req.cached[tier] += n
            self.tracer.emit(Ev.REQ_ADMIT, rid=req.rid, prefix=req.prefix_len,
                             device_hit=plan.device_hit, host_hit=plan.host_hit,
                             storage_hit=plan.storage_hit, extend=req.extend_len)
            reqs.append(req)
            rem_prefill, rem_total = rem_prefill - granted[0], rem_total - granted[1]
        if not reqs:
            return None
        return ScheduleBatch(reqs, self._extend_forward(reqs), step)

    def _num_running(self) -> int:
        return sum(len(s.running) + (s.chunked_req is not None) for s in self.slots)

    def use_chunk_model(self, model: LatencyModel | None) -> None:
        """Dynamic chunking: size continuation chunks with ``model`` (None: fixed chunks).
        Every rank gets the same model at start-up (``engine/profile.py``)."""
        self.chunk_model = model

    def _chunk_limit(self, req: Req, start: int) -> int:
        """The most tokens the next chunk of ``req`` may take: the fixed chunk size, or, for
        a continuation under dynamic chunking, the size the latency model gives its history
        (a pure function of it: every rank cuts the same chunk). Each such decision is an
        ``Ev.CHUNK_SIZE`` event."""
        base = self.cfg.chunked_prefill_size
        if self.chunk_model is None or req is not self.chunked_req:
            return base
        size = self.chunk_model.next_chunk(start, base, self.page_size,
                                           self.cache.device.capacity_tokens)
        self.tracer.emit(Ev.CHUNK_SIZE, rid=req.rid, history=start, size=size, base=base)
        return size

    def _grant(self, req: Req, start: int, rem_prefill: int,
               rem_total: int) -> tuple[int, int] | None:
        """Allocate slots for the next chunk of ``req`` starting at ``start``; returns
        (tokens computed, tokens allocated) or None when it does not fit."""
        extend = req.seq_len - start
        chunk = min(extend, rem_prefill, self._chunk_limit(req, start))
        if chunk < extend:
            chunk -= chunk % self.page_size
        if chunk <= 0:
            return None
        if chunk < extend and req is not self.chunked_req and any(
                sl.chunked_req is not None for sl in self.slots):
            # One chunked prefill at a time, across micro-batch slots: two half-prefilled
            # requests can hold all of L1 while each waits for the other's memory.
            return None
        have = int(req.kv_slots.numel()) - start
        need = max(0, _round_up(chunk, self.page_size) - have)
        decode_room = req.remaining_tokens if chunk == extend else 0
        if need + decode_room > rem_total:
            return None
        slots = self.cache.alloc_device(need) if need else req.kv_slots[:0]
        if slots is None:
            return None
        req.kv_slots = torch.cat([req.kv_slots, slots])
        req.extend_len = chunk
        req.chunked = chunk < extend
        if req.chunked:
            self.chunked_req = req
        elif req is self.chunked_req:
            self.chunked_req = None
        return chunk, need

    def _extend_forward(self, reqs: list[Req]) -> ForwardBatch:
        ids: list[int] = []
        pos: list[int] = []
        out: list[torch.Tensor] = []
        seq: list[torch.Tensor] = []
        for req in reqs:
            start, e = req.kv_len, req.extend_len
            ids.extend(req.fill_ids[start : start + e])
            pos.extend(range(start, start + e))
            out.append(req.kv_slots[start : start + e])
            seq.append(req.kv_slots[: start + e])
        return ForwardBatch(
            is_decode=False, rids=[r.rid for r in reqs], input_ids=torch.tensor(ids),
            positions=torch.tensor(pos), out_slots=torch.cat(out), seq_slots=seq,
            extend_lens=[r.extend_len for r in reqs], prefix_lens=[r.kv_len for r in reqs],
            sample=[not r.chunked for r in reqs])

    def _decode_batch(self, step: int) -> ScheduleBatch | None:
        if not self.running:
            return None
        self._make_room_for_decode()
        if not self.running:
            return None
        for req in self.running:
            if req.kv_len >= req.kv_slots.numel():
                page = self.cache.alloc_device(self.page_size)
                assert page is not None, "room was made for every decode page"
                req.kv_slots = torch.cat([req.kv_slots, page])
            req.extend_len = 1
        reqs = list(self.running)
        fwd = ForwardBatch(
            is_decode=True, rids=[r.rid for r in reqs],
            input_ids=torch.tensor([r.fill_ids[r.kv_len] for r in reqs]),
            positions=torch.tensor([r.kv_len for r in reqs]),
            out_slots=torch.stack([r.kv_slots[r.kv_len] for r in reqs]),
            seq_slots=[r.kv_slots[: r.kv_len + 1] for r in reqs],
            extend_lens=[1] * len(reqs), prefix_lens=[r.kv_len for r in reqs],
            sample=[True] * len(reqs))
        return ScheduleBatch(reqs, fwd, step)

    def _make_room_for_decode(self) -> None:
        """Retract the newest running requests until every one can take a decode token."""
        while self.running:
            need = sum(self.page_size for r in self.running if r.kv_len >= r.kv_slots.numel())
            if need <= self.cache.available_tokens:
                return
            victim = self.running.pop()
            self.cache.release_req(victim)
            victim.status = ReqStatus.WAITING
            victim.retractions += 1
            self.waiting.insert(0, victim)
            self.tracer.emit(Ev.REQ_RETRACT, rid=victim.rid, retractions=victim.retractions)

    # --- results ------------------------------------------------------------------------------

    def process_result(self, batch: ScheduleBatch, next_tokens: torch.Tensor | list[int]
                       ) -> list[Req]:
        """Apply sampled tokens of ``batch``; returns requests that finished."""
        tokens = next_tokens.tolist() if isinstance(next_tokens, torch.Tensor) else next_tokens
        want = sum(batch.forward.sample)
        if len(tokens) != want:
            raise InvariantViolation(
                f"micro-batch of slot {batch.slot} (step {batch.step}): {len(tokens)} sampled "
                f"tokens for {want} requests")
        self._cur = batch.slot
        slot = self.slots[batch.slot]
        slot.in_flight = None
        finished: list[Req] = []
        ti = 0
        for req, sample in zip(batch.reqs, batch.forward.sample):
            req.kv_len += req.extend_len
            if not sample:
                self.cache.cache_unfinished_req(req)
                if req.abort_pending:
                    self._abort_now(slot, req)
                continue
            req.output_ids.append(int(tokens[ti]))
            ti += 1
            if req.abort_pending:
                self._abort_now(slot, req)
            elif len(req.output_ids) >= req.max_new_tokens:
                if req in slot.running:
                    slot.running.remove(req)
                self.cache.cache_finished_req(req)
                self._finish(req, ReqStatus.FINISHED, None, batch.step)
                finished.append(req)
            elif req not in slot.running:
                slot.running.append(req)
        batch.finished = finished
        return finished

    def _abort_now(self, slot: MicroBatchSlot, req: Req) -> None:
        where = "chunked" if req is slot.chunked_req else "running"
        if req in slot.running:
            slot.running.remove(req)
        if req is slot.chunked_req:
            slot.chunked_req = None
        self.cache.cache_finished_req(req)
        self._abort_finish(req, where, deferred=True)

    def _finish(self, req: Req, status: ReqStatus, reason: str | None,
                step: int | None = None) -> bool:
        req.status, req.abort_reason, req.finish_step = status, reason, step
        self.finished.append(req)
        kind = Ev.REQ_FINISH if status is ReqStatus.FINISHED else Ev.REQ_ABORT
        self.tracer.emit(kind, rid=req.rid, output=len(req.output_ids), reason=reason)
        return True


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page
