"""The payload of every event kind: the fields a rank writes into ``attrs``, with their types.

One model per kind in :class:`~hicache_runtime.contracts.events.Ev`, the single definition both
sides use:

* the runtime's tracer checks every event it records against its model when strict events are
  on (``HICACHE_STRICT_EVENTS=1``; the test suite runs with it, so every event any test makes is
  checked) and raises :class:`EventContractError` on an unknown kind, a missing field, a field
  the model does not name or a value of the wrong type. Off, recording stays a tuple append
  (``bench/tracing_overhead.py``);
* the doctor reads a field of an event only if that kind's model names it
  (``tests/test_event_contract.py`` holds every ``attrs`` read in ``doctor/`` to the models),
  and reads bundles of every version: an older bundle's events may lack fields added since,
  which is why the doctor's reads go through ``.get`` and the models mark when a field came.

Torch-free, like all contracts.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError

from hicache_runtime.contracts.errors import validation_problem
from hicache_runtime.contracts.events import Ev

STRICT_ENV = "HICACHE_STRICT_EVENTS"
"""Set to 1: the tracer checks every event against its payload model."""

Int = StrictInt
OptInt = StrictInt | None
Ints = list[StrictInt]
Rids = list[str]


class EventContractError(ValueError):
    """An event that is not what its kind's payload model says."""


class Payload(BaseModel):
    """Fields of one event kind. Unknown fields are refused: a field the runtime writes is a
    field this module names."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- requests and scheduling ------------------------------------------------------------------


class ReqArrive(Payload):
    rid: str
    tokens: Int
    max_new: Int


class ReqAdmit(Payload):
    rid: str
    prefix: Int
    device_hit: Int
    host_hit: Int
    storage_hit: Int
    extend: Int


class ReqEnd(Payload):
    """``req.finish`` and ``req.abort``: the request left with ``output`` tokens."""

    rid: str
    output: Int
    reason: str | None


class ReqRetract(Payload):
    rid: str
    retractions: Int


class ReqReject(Payload):
    rid: str
    tokens: Int


class AbortReceived(Payload):
    rid: str
    source: str
    deferred: StrictBool
    apply_step: Int


class AbortApplied(Payload):
    rid: str
    where: str
    deferred: StrictBool
    on_the_spot: StrictBool


class PlanAborts(Payload):
    rids: Rids


class Batch(Payload):
    decode: StrictBool
    rids: Rids
    extend: Ints
    prefix: Ints
    tokens: Int
    slot: Int


class ChunkProfile(Payload):
    source: str
    samples: Int
    profile_s: float
    base: Int
    seq_lens: Ints | None = None
    latencies_ms: list[float] | None = None
    a: float | None = None
    b: float | None = None
    c: float | None = None
    refused: str | None = None


class ChunkSize(Payload):
    rid: str
    history: Int
    size: Int
    base: Int


# --- the radix tree and L1/L2 -----------------------------------------------------------------


class Match(Payload):
    rid: str
    device: Int
    host: Int
    loaded: Int
    storage: Int
    node: Int


class Insert(Payload):
    rid: str
    tokens: Int
    existing: Int
    revived: Int
    new: OptInt


class Split(Payload):
    node: Int
    upper: Int
    at: Int


class Evict(Payload):
    want: Int
    evicted: Int
    written_back: Int
    victims: Ints


class EvictHost(Payload):
    want: Int
    evicted: Int
    victims: Ints


class Transfer(Payload):
    """``l2.write.submit``, ``l2.write.ack``, ``l2.load.ack``: nodes and their tokens."""

    nodes: Ints
    tokens: Int


class LoadSubmit(Payload):
    nodes: Ints
    tokens: Int
    counter_slot: Int


class WriteSkip(Payload):
    node: Int
    tokens: Int
    parent_backed_up: StrictBool


class LoadSkip(Payload):
    node: Int
    tokens: Int
    quota: OptInt = None
    reason: str | None = None


class Drain(Payload):
    """``l2.write.drain``, ``l2.load.drain``: acks consumed, acks left."""

    count: Int
    left: Int


class CopyJob(Payload):
    dir: str
    tokens: Int
    layer_slot: OptInt
    t0_ns: Int
    dur_ns: Int


class LayerWait(Payload):
    layer: Int
    t0_ns: Int
    dur_ns: Int


# --- L3 ---------------------------------------------------------------------------------------


class BackupSubmit(Payload):
    node: Int
    pages: Int


class BackupAck(Payload):
    node: Int
    pages: Int
    of: Int
    skipped: StrictBool
    shed: Int
    agreed: OptInt


class PrefetchSubmit(Payload):
    rid: str
    start: Int
    tokens: Int


class PrefetchHit(Payload):
    rid: str
    local: Int
    agreed: Int
    span: Int
    pools: dict[str, Int]


class PrefetchAck(Payload):
    """Two writers: the scheduler, for each agreed ack it takes (``completed``, ``done``), and
    an IO thread that stops acking an op early (``stopped``, the ``abort-early-exit`` switch)."""

    rid: str
    batch: Int
    completed: OptInt = None
    done: StrictBool | None = None
    stopped: StrictBool | None = None


class PrefetchSettle(Payload):
    rid: str
    completed: Int
    """Tokens settled (hung below the anchor), after the sidecar pools' clamp."""
    local: Int
    """What this rank's own IO loaded."""
    consensus: Int
    """The agreed progress the scheduler had taken when it settled."""
    hit_pages: Int
    inserted: Int
    pools_ok: dict[str, list[StrictBool]] = {}
    """Added in bundle 1.3, hybrid models only: per sidecar pool, which of the op's pages this
    rank's IO found, in page order."""
    pools_counted: dict[str, Int] = {}
    """Added in bundle 1.3: per sidecar pool, the agreed pages the settlement counted as
    present (``sum-hit-pages`` counts pages past a hole)."""


class PrefetchRevoke(Payload):
    rid: str
    reason: str
    hit_pages: OptInt = None
    occupied: OptInt = None
    capacity: OptInt = None
    in_flight: OptInt = None


class PrefetchPartial(Payload):
    """A release's prefetch into a full L2: ``pages`` of the agreed ``hit_pages`` fitted."""

    rid: str
    hit_pages: Int
    pages: Int


class PrefetchDiscard(Payload):
    rid: str
    pool: str
    have: Int
    completed: Int
    hit_pages: Int


class PrefetchLateWrite(Payload):
    rid: str
    pages: Ints
    reused: Ints


class Storage(Payload):
    """A storage backend's notable call or state change (``op`` says which)."""

    op: str
    backend: str | None = None
    ok: StrictBool | None = None
    thread: str | None = None
    rid: str | None = None
    error: str | None = None
    what: str | None = None
    url: str | None = None
    down_s: float | None = None


# --- cross-rank -------------------------------------------------------------------------------


class Vote(Payload):
    site: str
    local: Any
    agreed: Any
    round: OptInt = None
    chained: StrictBool | None = None
    stage_local: StrictBool | None = None


class CollectiveEnter(Payload):
    group: str
    seq: Int
    op: str
    site: str
    peer: OptInt


class CollectiveExit(Payload):
    group: str
    seq: Int
    op: str
    state: str


class Consensus(Payload):
    """Every ``checked`` decision so far agreed, or decision ``divergent`` did not."""

    checked: OptInt = None
    divergent: OptInt = None
    decisions: list[str] | None = None


class PPPending(Payload):
    pending_sends: Int
    bytes: Int


class HostCapacity(Payload):
    local: Int
    agreed: Int
    synced: StrictBool
    bytes_per_token: Int


class PPSend(Payload):
    tokens: Int
    rids: Rids


class PPRecv(Payload):
    sender_tokens: Int
    local_tokens: Int
    sender_rids: Rids
    local_rids: Rids
    sender_extend: Ints
    local_extend: Ints
    sender_step: Int


class DPRoute(Payload):
    rid: str
    group: Int
    reason: str
    loads: Ints
    """What the router read (its policy's view)."""
    board: Ints
    """Every group's load on the board as it stands."""
    to: Ints
    """Grid ranks the request goes to (its group's entry rank)."""


class DPControl(Payload):
    what: str
    kind: str
    to: Ints
    rid: str | None = None
    by: OptInt = None
    outcome: str | None = None


class DPReceive(Payload):
    """A DP group's entry rank took a message: a request, an abort (``held``: whether it was
    still waiting there), or the end of the stream (``held``: requests still waiting)."""

    what: str
    group: Int
    rid: str | None = None
    reason: str | None = None
    loads: Ints | None = None
    held: StrictBool | StrictInt | None = None


# --- failures and checks ----------------------------------------------------------------------


class FaultFired(Payload):
    kind: str
    point: str
    spec: str
    rid: str | None
    fatal: StrictBool
    effect: str | None = None
    """Added in bundle 1.4: what the firing did (``contracts.fault_effects.FaultEffect``);
    the doctor reads a fault by it, never by the kind's name."""


class WorkerDied(Payload):
    thread: str
    error: str


class Integrity(Payload):
    ok: StrictBool
    at: str
    rounds: OptInt = None


PAYLOADS: dict[str, type[Payload]] = {
    Ev.REQ_ARRIVE: ReqArrive, Ev.REQ_ADMIT: ReqAdmit, Ev.REQ_FINISH: ReqEnd,
    Ev.REQ_ABORT: ReqEnd, Ev.REQ_RETRACT: ReqRetract, Ev.REQ_REJECT: ReqReject,
    Ev.ABORT_RECEIVED: AbortReceived, Ev.ABORT_APPLIED: AbortApplied,
    Ev.PLAN_ABORTS: PlanAborts, Ev.BATCH: Batch, Ev.MATCH: Match, Ev.INSERT: Insert,
    Ev.SPLIT: Split, Ev.EVICT: Evict, Ev.EVICT_HOST: EvictHost, Ev.WRITE_SUBMIT: Transfer,
    Ev.WRITE_SKIP: WriteSkip, Ev.WRITE_ACK: Transfer, Ev.WRITE_DRAIN: Drain,
    Ev.LOAD_SUBMIT: LoadSubmit, Ev.LOAD_SKIP: LoadSkip, Ev.LOAD_ACK: Transfer,
    Ev.LOAD_DRAIN: Drain, Ev.COPY: CopyJob, Ev.LAYER_WAIT: LayerWait,
    Ev.BACKUP_SUBMIT: BackupSubmit, Ev.BACKUP_ACK: BackupAck,
    Ev.PREFETCH_SUBMIT: PrefetchSubmit, Ev.PREFETCH_HIT: PrefetchHit,
    Ev.PREFETCH_ACK: PrefetchAck, Ev.PREFETCH_SETTLE: PrefetchSettle,
    Ev.PREFETCH_REVOKE: PrefetchRevoke, Ev.PREFETCH_PARTIAL: PrefetchPartial,
    Ev.PREFETCH_DISCARD: PrefetchDiscard,
    Ev.PREFETCH_LATE_WRITE: PrefetchLateWrite, Ev.STORAGE: Storage, Ev.VOTE: Vote,
    Ev.COLLECTIVE_ENTER: CollectiveEnter, Ev.COLLECTIVE_EXIT: CollectiveExit,
    Ev.FAULT: FaultFired, Ev.WORKER_DIED: WorkerDied, Ev.INTEGRITY: Integrity,
    Ev.CONSENSUS: Consensus, Ev.PP_PENDING: PPPending, Ev.HOST_CAPACITY: HostCapacity,
    Ev.PP_RECV: PPRecv, Ev.PP_SEND: PPSend, Ev.CHUNK_PROFILE: ChunkProfile,
    Ev.CHUNK_SIZE: ChunkSize, Ev.DP_ROUTE: DPRoute, Ev.DP_CONTROL: DPControl,
    Ev.DP_RECEIVE: DPReceive,
}
"""Every kind the runtime emits, with its payload model."""


def fields_of(kind: str) -> frozenset[str]:
    """The field names of ``kind``'s payload (empty for a kind no model names)."""
    model = PAYLOADS.get(kind)
    return frozenset(model.model_fields) if model is not None else frozenset()


def strict_events() -> bool:
    return os.environ.get(STRICT_ENV) == "1"


def check_event(kind: str, attrs: dict[str, Any], *, older: bool = False) -> None:
    """Raise :class:`EventContractError` unless ``attrs`` is what ``kind``'s model says.
    ``older``: the event comes from an older bundle, which may lack fields added since (but
    never holds one no model names, nor a value of the wrong type)."""
    model = PAYLOADS.get(kind)
    if model is None:
        raise EventContractError(f"event kind {kind!r} has no payload model "
                                 "(hicache_runtime/contracts/event_payloads.py)")
    try:
        model.model_validate(attrs)
    except ValidationError as exc:
        errors = [e for e in exc.errors() if not (older and e["type"] == "missing")]
        if errors:
            where, what = validation_problem(errors[0])
            raise EventContractError(f"{kind}: {where}: {what} "
                                     f"(attrs {sorted(attrs)})") from None
