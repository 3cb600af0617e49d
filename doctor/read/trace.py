"""The runtime's own traces: ``events.jsonl`` (event ring or ``--trace`` file) and ``state.json``.

From events the doctor keeps two things per rank:

* **decisions** — events whose values must be identical on every rank (the batch a step runs,
  the prefix a request was admitted with, an eviction, an agreed vote, a drain count, a prefetch
  settlement, a dynamic chunk size), reduced to the attributes that must agree (``DECISIONS``);
* **notable events** — aborts, prefetch lifecycle, skipped backups, fired faults, consensus and
  integrity checks, the batch a downstream stage received (``pp.recv``), host capacities — which
  the fact analyzers read.

Lines are filtered on their ``"kind"`` value before any JSON parsing, so huge traces stream at
disk speed; malformed lines are counted, never fatal.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from doctor.model.builder import EvidenceBuilder
from doctor.model.evidence import (
    MAX_ARRIVALS,
    Decision,
    RankHint,
    SourceRef,
    TimedEvent,
)
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.jsonl import iter_lines

#: kind -> (attribute naming the decision's subject or None, attributes that must agree)
DECISIONS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    Ev.BATCH: (None, ("rids", "extend", "prefix")),
    Ev.REQ_ADMIT: ("rid", ("prefix", "extend")),
    Ev.MATCH: ("rid", ("device", "host")),
    Ev.EVICT: (None, ("evicted", "victims")),
    Ev.EVICT_HOST: (None, ("evicted", "victims")),
    Ev.WRITE_DRAIN: (None, ("count",)),
    Ev.LOAD_DRAIN: (None, ("count",)),
    Ev.VOTE: ("site", ("agreed",)),
    Ev.PREFETCH_HIT: ("rid", ("agreed",)),
    Ev.PREFETCH_SETTLE: ("rid", ("completed", "hit_pages")),
    Ev.CHUNK_SIZE: ("rid", ("history", "size")),
    Ev.PREFETCH_PARTIAL: ("rid", ("pages",)),
}
NOTABLE = frozenset({
    Ev.REQ_ABORT, Ev.PREFETCH_SUBMIT, Ev.PREFETCH_ACK, Ev.PREFETCH_SETTLE, Ev.PREFETCH_HIT,
    Ev.PREFETCH_REVOKE, Ev.PREFETCH_PARTIAL, Ev.WRITE_SKIP, Ev.FAULT, Ev.CONSENSUS,
    Ev.INTEGRITY, Ev.STORAGE, Ev.VOTE, Ev.WORKER_DIED, Ev.PP_RECV,
    Ev.HOST_CAPACITY, Ev.PREFETCH_LATE_WRITE, Ev.ABORT_APPLIED,
})
#: event attribute -> sample series (``sync.pp_pending`` carries PP0's pending sends; memory
#: samples come from log lines, which is where a deployment prints them)
_SAMPLE_ATTRS = {"pending_sends": "pending_sends"}
#: Decisions about one request: comparable across ranks only if its arrival is traced.
REQUEST_KEYED = frozenset({Ev.REQ_ADMIT, Ev.MATCH, Ev.PREFETCH_HIT, Ev.PREFETCH_SETTLE,
                           Ev.CHUNK_SIZE, Ev.PREFETCH_PARTIAL})
#: Events drawn on the incident page's per-rank timeline (with their time and step).
TIMELINE = frozenset({
    Ev.BATCH, Ev.COLLECTIVE_ENTER, Ev.COLLECTIVE_EXIT, Ev.FAULT, Ev.REQ_ABORT,
    Ev.BACKUP_SUBMIT, Ev.BACKUP_ACK, Ev.PREFETCH_SUBMIT, Ev.PREFETCH_SETTLE,
    Ev.STORAGE, Ev.INTEGRITY, Ev.CONSENSUS,
    Ev.WORKER_DIED, Ev.PP_SEND, Ev.PP_RECV,
})
_WANTED = {k.encode() for k in (*DECISIONS, *NOTABLE, *TIMELINE, Ev.REQ_ARRIVE)}
_SAMPLE_BYTES = tuple(f'"{a}"'.encode() for a in _SAMPLE_ATTRS)
_KIND = b'"kind":'
MAX_TRACE_LINE = 1 << 20


def read_events(stream: BinaryIO, name: str, hint: RankHint, sink: EvidenceBuilder) -> int:
    """Stream one JSONL trace; returns the events kept. Each event names its own rank."""
    kept = bad = 0
    for lineno, raw in iter_lines(stream, MAX_TRACE_LINE):
        if raw is None:  # over-long: skipped as it streamed past, never held whole
            bad += 1
            continue
        i = raw.find(_KIND)
        if i < 0:
            bad += raw.strip() != b""
            continue
        q = raw.find(b'"', i + len(_KIND))
        kind = raw[q + 1:raw.find(b'"', q + 1)] if q >= 0 else b""
        if kind not in _WANTED and not any(a in raw for a in _SAMPLE_BYTES):
            continue
        try:
            ev = json.loads(raw)
        except (ValueError, RecursionError):
            bad += 1
            continue
        if isinstance(ev, dict) and _file_event(ev, SourceRef(name, lineno), hint, sink,
                                                len(raw)):
            kept += 1
    if bad:
        sink.problem(f"{name}: skipped {bad} malformed trace line(s)")
    return kept


def _file_event(ev: dict[str, Any], src: SourceRef, hint: RankHint,
                sink: EvidenceBuilder, nbytes: int) -> bool:
    kind, attrs = ev.get("kind"), ev.get("attrs")
    if not isinstance(kind, str) or not isinstance(attrs, dict) or not sink.retain(nbytes):
        return False
    own = RankHint(rank=_int(ev.get("rank")), tp=_int(ev.get("tp")), pp=_int(ev.get("pp")),
                   dp=_int(ev.get("dp")))
    slot = sink.slot(own.merged(hint))
    step = _int(ev.get("step")) or 0
    # a journal line (the rank died before dumping its ring) is an event that happened, but
    # its file holds only a few kinds: it says nothing of what did not happen (no coverage,
    # no decisions to compare)
    journal = ev.get("durable") is True
    slot.kinds.add("journal" if journal else "trace")
    if not journal:
        if slot.trace_start is None or step < slot.trace_start:
            slot.trace_start = step
        if slot.trace_end is None or step > slot.trace_end:
            slot.trace_end = step
        if kind == Ev.REQ_ARRIVE and len(slot.arrived) < MAX_ARRIVALS:
            slot.arrived.add(str(attrs.get("rid", "")))
        for attr, sample in _SAMPLE_ATTRS.items():
            value = attrs.get(attr)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                slot.add_sample(sample, float(value), src)
    if kind in NOTABLE:
        slot.events.append((kind, attrs, src, step))
    t_ns = _int(ev.get("t_ns"))
    if kind in TIMELINE and t_ns is not None:
        slot.timeline.append(_timed(kind, attrs, t_ns, step))
    spec = DECISIONS.get(kind)
    if spec is not None and not journal and not _traced_conditionally(kind, attrs):
        key_attr, fields = spec
        key = str(attrs.get(key_attr, "")) if key_attr else ""
        value = {f: attrs[f] for f in fields if f in attrs}
        if value:
            slot.add_decision(Decision(kind, key, json.dumps(value, sort_keys=True, default=str),
                                       step, src))
    return True


def _timed(kind: str, attrs: dict[str, Any], t_ns: int, step: int) -> TimedEvent:
    """A timeline event: what it says in a few words (bounded: the trace is untrusted)."""
    key = ""
    if kind in (Ev.COLLECTIVE_ENTER, Ev.COLLECTIVE_EXIT):
        key = f"{attrs.get('group')}#{attrs.get('seq')}"[:80]
        label = f"{attrs.get('op', '?')} {key}" + (
            f" from {attrs['site']}" if kind == Ev.COLLECTIVE_ENTER and attrs.get("site")
            else f" {attrs['state']}" if attrs.get("state") else "")
    elif kind == Ev.FAULT:
        label = str(attrs.get("spec") or attrs.get("kind") or "fault")
    elif kind == Ev.BATCH:
        label = f"step {step}"
    else:
        what = attrs.get("rid") or attrs.get("op") or attrs.get("error") or attrs.get("ok")
        label = kind + (f" {what}" if what not in (None, "") else "")
    return TimedEvent(t_ns, step, kind, label[:160], key)


def _traced_conditionally(kind: str, attrs: dict[str, Any]) -> bool:
    """A decision some ranks trace and others do not, so its occurrences cannot be aligned:
    the runtime traces a ``drain_counts`` round only when this rank's local or agreed counts
    are non-zero, so an all-zero agreement shows up on the ranks that had something locally
    and not on the others."""
    if kind != Ev.VOTE or attrs.get("site") != "drain_counts":
        return False
    agreed = attrs.get("agreed")
    return isinstance(agreed, list) and not any(agreed)


def read_state(data: Any, name: str, hint: RankHint, sink: EvidenceBuilder) -> None:
    """A ``state.json`` snapshot (``bundle.RankState``: rank, tp_rank, pp_rank, step, ...)."""
    if not isinstance(data, dict):
        return
    own = RankHint(rank=_int(data.get("rank")), tp=_int(data.get("tp_rank")),
                   pp=_int(data.get("pp_rank")), dp=_int(data.get("dp_rank")))
    slot = sink.slot(own.merged(hint))
    slot.kinds.add("state")
    slot.state, slot.state_source = data, SourceRef(name, None)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
