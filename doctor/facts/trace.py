"""Facts from the runtime's traces, state snapshots and samples.

What the analyzers read (the contract with the runtime's event attributes):

* divergences of drain counts / prefix lengths / evictions (:mod:`doctor.ranks.divergence`);
* ``req.abort`` {rid} between ``l3.prefetch.submit`` {rid} and ``l3.prefetch.settle`` {rid}
  on a rank: an abort during prefetch; also a fired ``mid-prefetch-abort`` fault;
* ``l3.prefetch.ack`` {rid} counts per rank: fewer acks on one rank for the same op;
* ``l3.prefetch.settle`` {rid, pools_ok: {pool: [bool]}, pools_counted: {pool: int}}: a hole
  counted as coverage when a sidecar pool's counted pages exceed the leading run of the pages
  this rank found; or wrong output after a fired ``storage-shortfall`` fault with ``mode=holes``;
* ``l2.write.skip`` {parent_backed_up: true}: an allocation refused a backup;
* ``req.abort.applied`` {rid} on a rank but not on a peer of its DP group: the ranks' histories
  differ from there (an eviction divergence after it is a consequence);
* ``check.integrity`` {ok: false}, ``consensus.check`` {divergent}, ``l3.storage``
  {ok: false}, ``thread.died`` {error};
* samples: ``pending_sends`` (``sync.pp_pending``, or log lines) and ``rss_mb`` (log lines) per
  rank;

Every field named here is a field of the kind's payload model
(:mod:`hicache_runtime.contracts.event_payloads`; ``tests/test_event_contract.py`` checks it).
* state snapshots: ``cache.host.capacity``, ``prefetch_tokens_occupied`` with no prefetch in
  flight, ``pending_sends``;
* pipeline stages' own records (:mod:`doctor.facts.stages`): ``pp.recv``, ``sync.host_capacity``.
"""

from __future__ import annotations

import itertools
from typing import Any

from doctor.facts.factset import FactSet, witness
from doctor.facts.stages import host_capacity_events, stage_batches
from doctor.model.builder import Evidence
from doctor.model.evidence import RankEvidence, SourceRef
from doctor.model.findings import Divergence
from doctor.ranks.divergence import DRAIN_KINDS, EVICT_KINDS, PREFIX_KINDS
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.fault_effects import FaultEffect, effect_of
from signatures.fact_names import Fact
from signatures.matching import Witness

_DIVERGENCE_FACT = {**dict.fromkeys(DRAIN_KINDS, Fact.DRAIN_COUNT_DIVERGENCE),
                    **dict.fromkeys(PREFIX_KINDS, Fact.PREFIX_LENGTH_DIVERGENCE),
                    **dict.fromkeys(EVICT_KINDS, Fact.EVICTION_DIVERGENCE)}
_MIN_SAMPLES = 4


#: Votes on how many completed transfers to consume (the fixed chain and the legacy TP MINs).
_DRAIN_VOTES = ("drain_counts", "writing_check", "loading_check")


def divergence_fact(d: Divergence) -> Fact | None:
    """The fact a divergence of this kind supports (None for kinds no signature reads)."""
    if d.kind == Ev.VOTE and (d.key in _DRAIN_VOTES
                                  or (d.key.startswith("drain_") and d.key != "drain_idle")):
        return Fact.DRAIN_COUNT_DIVERGENCE
    return _DIVERGENCE_FACT.get(d.kind)


def _one_sided_abort_step(ev: Evidence) -> int | None:
    """The earliest step at which a rank applied an abort that a peer of its DP group, whose
    trace covers that step (a ring that lost its start, a rank that died, cover less), never
    applied: from there the ranks' histories differ (a request's pages went back on one rank
    only)."""
    applied: dict[int, dict[str, int]] = {}
    for r in ev.ranks.values():
        for kind, attrs, _src, step in r.events:
            if kind == Ev.ABORT_APPLIED and attrs.get("rid") is not None:
                applied.setdefault(r.rank, {}).setdefault(str(attrs["rid"]), step)
    first: int | None = None
    for rank, rids in applied.items():
        peers = [q for q in ev.ranks.values() if q.rank != rank
                 and q.dp == ev.ranks[rank].dp and q.trace_end is not None]
        for rid, step in rids.items():
            if any(_covers(q.trace_start or 0, q.trace_end or 0, step)
                   and rid not in applied.get(q.rank, {}) for q in peers):
                first = step if first is None else min(first, step)
    return first


def _covers(start: int, last: int, step: int) -> bool:
    """Whether a trace from ``start`` to ``last`` holds all of ``step``'s events (a ring's first
    step may be partial, unless the ring holds the run from its start)."""
    return (start <= 1 or start < step) and step <= last


def _divergences(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    """One witness per divergence. An eviction that differs only after the ranks' histories
    already differed (a prefix, hit or drain divergence came first, or an abort applied on one
    rank only) is a consequence, not ranks evicting differently "from the same history": it
    supports no eviction fact."""
    other_first = False
    one_sided = _one_sided_abort_step(ev)
    for d in divs:  # earliest first
        fact = divergence_fact(d)
        if fact is None:
            continue
        if fact is Fact.EVICTION_DIVERGENCE and (
                other_first or (one_sided is not None and d.steps
                                and one_sided <= min(d.steps.values()))):
            continue
        other_first |= fact is not Fact.EVICTION_DIVERGENCE
        e = d.evidence[0] if d.evidence else None
        values = ", ".join(f"rank {r}: {v}" for r, v in sorted(d.values.items()))
        facts.add(fact, Witness(f"{d.label} #{d.index}: {values}"[:300],
                                e.file if e else None, e.line if e else None, -1))


def _prefetch_lifecycle(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    acks: dict[str, dict[int, int]] = {}
    last_ack: dict[tuple[str, int], SourceRef] = {}
    agreed: dict[tuple[int, str], int] = {}
    stops: list[tuple[int, str, int]] = []
    """(rank, op, batch) of each op a rank's IO stopped acking early."""
    order: dict[int, list[str]] = {}
    """Each rank's agreed acks, in the order its scheduler took them (the op of each)."""
    for r in ev.ranks.values():
        in_flight: dict[str, SourceRef] = {}
        for kind, attrs, src, _step in r.events:
            rid = str(attrs.get("rid", ""))
            if kind == Ev.PREFETCH_SUBMIT:
                in_flight[rid] = src
            elif kind in (Ev.PREFETCH_SETTLE, Ev.PREFETCH_REVOKE):
                in_flight.pop(rid, None)
            elif kind == Ev.REQ_ABORT and rid in in_flight:
                facts.add(Fact.ABORT_DURING_PREFETCH, witness(
                    f"rank {r.rank}: {rid} aborted while its prefetch was in flight", src, r.rank))
            elif kind == Ev.PREFETCH_LATE_WRITE and attrs.get("reused"):
                facts.add(Fact.HOST_POOL_DOUBLE_USE, witness(
                    f"rank {r.rank}: the prefetch IO of {rid} wrote host pages "
                    f"{attrs.get('reused')} after its abort had freed them and they were "
                    "handed out again", src, r.rank))
            elif kind == Ev.PREFETCH_ACK and attrs.get("stopped") is True:
                # the IO thread's own record that it returned without acking the rest
                batch = attrs.get("batch")
                if isinstance(batch, int) and not isinstance(batch, bool):
                    stops.append((r.rank, rid, batch))
                facts.add(Fact.PREFETCH_ACKS_STOPPED, witness(
                    f"rank {r.rank}: the prefetch IO of {rid} stopped acking at batch "
                    f"{attrs.get('batch')} (no further batch acks, no completion ack)",
                    src, r.rank))
            elif kind == Ev.PREFETCH_ACK:
                acks.setdefault(rid, {}).setdefault(r.rank, 0)
                acks[rid][r.rank] += 1
                last_ack[(rid, r.rank)] = src
                order.setdefault(r.rank, []).append(rid)
                _check_agreed_progress(r.rank, rid, attrs, src, agreed, facts)
            elif kind == Ev.FAULT and attrs.get("kind") == "mid-prefetch-abort":
                facts.add(Fact.ABORT_DURING_PREFETCH, witness(
                    f"rank {r.rank}: fault {attrs.get('spec', 'mid-prefetch-abort')} fired "
                    f"(request {attrs.get('rid')})", src, r.rank))
    _surplus_acks(ev, stops, order, facts)
    for rid, per_rank in acks.items():
        if len(per_rank) >= 2 and len(set(per_rank.values())) > 1:
            short = min(per_rank, key=lambda k: (per_rank[k], k))
            facts.add(Fact.PREFETCH_ACKS_STOPPED, witness(
                f"prefetch {rid}: acks per rank {dict(sorted(per_rank.items()))}; rank {short} "
                f"stopped after {per_rank[short]} (its last ack here)",
                last_ack.get((rid, short)), short))


def _surplus_acks(ev: Evidence, stops: list[tuple[int, str, int]],
                  order: dict[int, list[str]], facts: FactSet) -> None:
    """A rank whose IO stopped an op at batch ``b`` emitted ``b`` acks of it; a peer that took
    more than ``b`` agreed acks of the same op got the extra ones from votes the stopped rank
    entered with *later* ops' acks (the vote pairs every rank's k-th ack, whatever op it
    belongs to). From then on each of the peer's acks is voted against another op's, so an
    agreed ack the peer took after that op's is mispaired."""
    for rank, rid, batch in stops:
        for peer, rids in order.items():
            if peer == rank or rids.count(rid) <= batch:
                continue
            last = len(rids) - 1 - rids[::-1].index(rid)
            later = [x for x in rids[last + 1:] if x != rid]
            if not later:
                continue
            facts.add(Fact.PREFETCH_ACKS_MISPAIRED, Witness(
                f"rank {rank} stopped acking {rid} after {batch} ack(s); rank {peer} took "
                f"{rids.count(rid)} agreed acks of it, so its later acks ({', '.join(later[:3])}"
                f"{', ...' if len(later) > 3 else ''}) were voted against other ops' acks",
                None, None, peer))


def _check_agreed_progress(rank: int, rid: str, attrs: dict[str, Any], src: SourceRef,
                           agreed: dict[tuple[int, str], int], facts: FactSet) -> None:
    """Each rank's progress of one op only grows, so the MIN over ranks of its k-th acks does
    too (upstream asserts it where the scheduler drains the agreed acks: sglang 0.5.23
    ``srt/mem_cache/unified_radix_cache.py`` ``_drain_ack_prefetch``, L3217). A value that
    goes down came from a vote that paired this op's ack with another op's."""
    done, completed = attrs.get("done"), attrs.get("completed")
    if done is not False or isinstance(completed, bool) or not isinstance(completed, int):
        return
    before = agreed.get((rank, rid))
    agreed[(rank, rid)] = completed if before is None else max(before, completed)
    if before is not None and completed < before:
        facts.add(Fact.PREFETCH_ACKS_MISPAIRED, witness(
            f"rank {rank}: the agreed progress of {rid} went from {before} to {completed} "
            f"tokens at batch {attrs.get('batch')}: its ack was voted with another op's",
            src, rank))


def _holes(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    holes_fault = None
    for r in ev.ranks.values():
        for kind, attrs, src, _step in r.events:
            if kind == Ev.PREFETCH_SETTLE:
                _counted_past_a_hole(r.rank, attrs, src, facts)
            if kind == Ev.FAULT and effect_of(attrs) is FaultEffect.STORAGE_HOLES:
                holes_fault = holes_fault or witness(
                    f"rank {r.rank}: fault {attrs.get('spec')} fired", src, r.rank)
    if holes_fault is not None and (ev.outcome == "wrong-output" or ev.mismatches):
        facts.add(Fact.PREFETCH_HOLE_COMMITTED, Witness(
            f"outputs differ after {holes_fault.text} (pages failed in the middle of a "
            "prefetch)", holes_fault.file, holes_fault.line, holes_fault.rank))


def _counted_past_a_hole(rank: int, attrs: dict[str, Any], src: SourceRef,
                         facts: FactSet) -> None:
    """A hybrid prefetch's settlement: per sidecar pool, the pages this rank found
    (``pools_ok``) and the agreed pages counted as present (``pools_counted``). Counting more
    than the leading run of found pages takes a hole for coverage (``sum-hit-pages``)."""
    found, counted = attrs.get("pools_ok"), attrs.get("pools_counted")
    if not isinstance(found, dict) or not isinstance(counted, dict):
        return
    for pool, ok in found.items():
        n = counted.get(pool)
        if not isinstance(ok, list) or not isinstance(n, int) or isinstance(n, bool):
            continue
        lead = next((i for i, x in enumerate(ok) if x is not True), len(ok))
        if n > lead:
            shown = "".join("+" if x is True else "." for x in ok[:64])
            facts.add(Fact.PREFETCH_HOLE_COMMITTED, witness(
                f"rank {rank}: {attrs.get('rid')} counted {n} pages of pool {pool} as present "
                f"but only the first {lead} arrived (pages found: {shown})", src, rank))


def _allocation_and_checks(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    for r in ev.ranks.values():
        skips = [(a, s) for k, a, s, _ in r.events
                 if k == Ev.WRITE_SKIP and a.get("parent_backed_up", True)]
        if len(skips) >= 3:
            facts.add(Fact.HOST_ALLOC_FAILING, witness(
                f"rank {r.rank}: {len(skips)} backups refused by the host pool", skips[0][1],
                r.rank))
        for kind, attrs, src, _step in r.events:
            fact = None
            if attrs.get("ok") is False:
                fact = {Ev.INTEGRITY: Fact.INVARIANT_BROKEN,
                        Ev.STORAGE: Fact.STORAGE_ERRORS}.get(kind)
            elif kind == Ev.CONSENSUS and "divergent" in attrs:
                fact = Fact.CONSENSUS_FIRED
            elif kind == Ev.WORKER_DIED:
                fact = Fact.HOST_POOL_DOUBLE_USE if "Double" in str(attrs.get("error")) \
                    else Fact.CRASH
            if fact is not None:
                facts.add(fact, witness(f"rank {r.rank}: {kind} {attrs}"[:300], src, r.rank))


def _samples(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    for r in ev.ranks.values():
        for name, fact, floor in (("rss_mb", Fact.MEMORY_GROWS, 0.0),
                                  ("pending_sends", Fact.PENDING_SENDS_GROW, 32.0)):
            series = list(r.samples.get(name, ()))
            if _grows(series, floor):
                first, last = series[0], series[-1]
                facts.add(fact, witness(
                    f"rank {r.rank} ({r.role}): {name} {first[0]:g} -> {last[0]:g} over "
                    f"{len(series)} samples", last[1], r.rank))


def _grows(series: list[tuple[float, SourceRef]], floor: float) -> bool:
    """Steady growth: enough samples, mostly rising, ending well above the start."""
    if len(series) < _MIN_SAMPLES:
        return False
    values = [v for v, _ in series]
    rises = sum(b > a for a, b in itertools.pairwise(values))
    return (values[-1] >= max(values[0] * 1.3, floor) and values[-1] > values[0]
            and rises >= 0.75 * (len(values) - 1))


def _state(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    capacities: dict[int, tuple[int, SourceRef | None]] = {}
    pending: dict[int, tuple[float, SourceRef | None]] = {}
    for r in ev.ranks.values():
        _capacity_from_logs(r, capacities)
        if r.state is None:
            continue
        cap = _dig(r.state, ("cache", "host", "capacity"))
        if isinstance(cap, int) and cap > 0:
            capacities.setdefault(r.rank, (cap, r.state_source))
        occupied = _find_key(r.state, "prefetch_tokens_occupied")
        flight = _find_key(r.state, "ongoing_prefetch")
        n_flight = len(flight) if isinstance(flight, (list, dict)) else flight
        if isinstance(occupied, int) and occupied > 0 and n_flight in (0, None):
            facts.add(Fact.RESERVATION_LEAKED, witness(
                f"rank {r.rank}: prefetch_tokens_occupied={occupied} with no prefetch in flight",
                r.state_source, r.rank))
        # the count chain's own group when the snapshot splits them (other groups' sends are
        # reaped each step and say nothing about the chain)
        sends = _dig(r.state, ("pending_sends_by_group", "pp_sync"))
        if sends is None and not isinstance(r.state.get("pending_sends_by_group"), dict):
            sends = _find_key(r.state, "pending_sends")
        n_sends = len(sends) if isinstance(sends, list) else sends
        if isinstance(n_sends, (int, float)) and not isinstance(n_sends, bool):
            pending[r.rank] = (float(n_sends), r.state_source)
    if len({c for c, _ in capacities.values()}) > 1:
        text = ", ".join(f"rank {k}: {c}" for k, (c, _) in sorted(capacities.items()))
        src = next(iter(capacities.values()))[1]
        facts.add(Fact.HOST_CAPACITY_DIFFERS, witness(f"host token capacity differs: {text}",
                                                      src, -1))
    for rank, (n, src) in pending.items():
        others = [m for k, (m, _) in pending.items() if k != rank]
        if n >= 64 and n >= 8 * max(others or [0]):
            facts.add(Fact.PENDING_SENDS_GROW, witness(
                f"rank {rank}: {n:g} pending count-chain sends in its state snapshot (other "
                f"ranks: {others})", src, rank))


def _capacity_from_logs(r: RankEvidence, out: dict[int, tuple[int, SourceRef | None]]) -> None:
    stats = r.hits.get("host-capacity")
    if stats is None or r.rank < 0:
        return
    for h in stats.kept:
        value = h.groups.get("tokens") or h.groups.get("capacity")
        if value and value.isdigit() and len(value) <= 12:
            out.setdefault(r.rank, (int(value), h.source))


def _dig(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _find_key(data: Any, key: str, depth: int = 0) -> Any:
    """The first value stored under ``key`` anywhere in a nested snapshot."""
    if depth > 6:
        return None
    if isinstance(data, dict):
        if key in data:
            return data[key]
        for v in data.values():
            found = _find_key(v, key, depth + 1)
            if found is not None:
                return found
    return None


TRACE_FACTS = (_divergences, _prefetch_lifecycle, _holes, _allocation_and_checks, _samples,
               _state, stage_batches, host_capacity_events)
