"""Names of the events a rank records: the vocabulary shared by the runtime that emits them and
the doctor that reads them (torch-free, so the doctor imports it without the runtime).

Event kinds are dotted strings; :class:`Ev` lists the ones the runtime emits, so neither side
spells one as a raw string.
"""

from __future__ import annotations

from typing import Any, Protocol


class Ev:
    """Event kinds; each one's fields are its model in
    :mod:`~hicache_runtime.contracts.event_payloads`."""

    REQ_ARRIVE = "req.arrive"
    REQ_ADMIT = "req.admit"
    REQ_FINISH = "req.finish"
    REQ_ABORT = "req.abort"
    REQ_RETRACT = "req.retract"
    REQ_REJECT = "req.reject"
    ABORT_RECEIVED = "req.abort.received"
    ABORT_APPLIED = "req.abort.applied"
    PLAN_ABORTS = "sched.plan.aborts"
    BATCH = "sched.batch"
    MATCH = "tree.match"
    INSERT = "tree.insert"
    SPLIT = "tree.split"
    EVICT = "tree.evict"
    EVICT_HOST = "tree.evict_host"
    WRITE_SUBMIT = "l2.write.submit"
    WRITE_SKIP = "l2.write.skip"
    WRITE_ACK = "l2.write.ack"
    WRITE_DRAIN = "l2.write.drain"
    LOAD_SUBMIT = "l2.load.submit"
    LOAD_SKIP = "l2.load.skip"
    LOAD_ACK = "l2.load.ack"
    LOAD_DRAIN = "l2.load.drain"
    COPY = "copy.job"
    LAYER_WAIT = "copy.layer_wait"
    BACKUP_SUBMIT = "l3.backup.submit"
    BACKUP_ACK = "l3.backup.ack"
    PREFETCH_SUBMIT = "l3.prefetch.submit"
    PREFETCH_HIT = "l3.prefetch.hit"
    PREFETCH_ACK = "l3.prefetch.ack"
    PREFETCH_SETTLE = "l3.prefetch.settle"
    PREFETCH_REVOKE = "l3.prefetch.revoke"
    PREFETCH_PARTIAL = "l3.prefetch.partial"
    PREFETCH_DISCARD = "l3.prefetch.discard"
    PREFETCH_LATE_WRITE = "l3.prefetch.late_write"
    STORAGE = "l3.storage"
    VOTE = "sync.vote"
    COLLECTIVE_ENTER = "comm.enter"
    COLLECTIVE_EXIT = "comm.exit"
    FAULT = "fault.fired"
    WORKER_DIED = "thread.died"
    INTEGRITY = "check.integrity"
    CONSENSUS = "consensus.check"
    PP_PENDING = "sync.pp_pending"
    HOST_CAPACITY = "sync.host_capacity"
    PP_RECV = "pp.recv"
    PP_SEND = "pp.send"
    CHUNK_PROFILE = "sched.chunk_profile"
    CHUNK_SIZE = "sched.chunk_size"
    DP_ROUTE = "dp.route"
    DP_CONTROL = "dp.control"
    DP_RECEIVE = "dp.receive"


EventRecord = tuple[int, int, str, str, int, dict[str, Any]]
"""(per-rank sequence number, monotonic ns, kind, thread name, step, attributes): the ring's
storage form. The sequence number survives ring truncation, so rings cut at different points
can still be lined up."""


class EventSink(Protocol):
    """Where code below the runtime (the fault injector) records an event: the runtime's
    :class:`~hicache_runtime.telemetry.tracer.Tracer` is one."""

    def emit(self, kind: str, /, **attrs: Any) -> object: ...

    def emit_durable(self, kind: str, /, **attrs: Any) -> None:
        """Record it, and on disk at once (it must outlive a rank that dies in native code)."""
