"""Cross-rank alignment of collectives and point-to-point ops (flight recorders, NCCL watchdog
sequence numbers).

Collectives: per communicator, ranks are lined up by sequence number, within the window every
rank still holds (the recorders are rings, so the oldest entries may be gone on some ranks):

* **missing-ranks**: some ranks entered seq N and others never did (their last seq is lower);
* **op-mismatch**: at the same seq, ranks ran different ops (``all_reduce`` vs ``barrier``);
* **site-mismatch**: same op, but entered from different in-app call sites;
* **size-mismatch**: same op, different input sizes (for ops whose sizes must agree);
* **crossed**: each rank's last recorded collective (its recorder's newest entry, whatever the
  group) is one that some other rank never entered, and the ranks stopped in different
  collectives: rank 0 waits in group A's ``all_reduce`` #5 that rank 1 never reached, rank 1
  waits in group B's ``broadcast`` #3 that rank 0 never reached. Recorder states do not matter
  here: gloo leaves every entry ``scheduled`` forever.

Point-to-point ops (``isend``/``recv`` on the pipeline groups) are not collectives: rank A's
k-th send to B pairs with B's k-th receive from A (:mod:`doctor.ranks.p2p`).

A group name is not a communicator: every pipeline stage has its own ``tp_compute``, so the
runtime's stage-local groups are split by stage. Unlike torch's ``fr_trace`` this works on gloo
dumps, on partial rank sets (it reports what it can decide), and names the call sites. Only the
first finding of each kind per communicator is kept.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from doctor.model.builder import Evidence
from doctor.model.evidence import Collective, RankEvidence
from doctor.model.findings import CollectiveFinding, EvidenceItem, FindingKind
from doctor.ranks.p2p import P2P_OPS, p2p_findings
from doctor.ranks.table import site_label

_SIZE_FREE = {"all_to_all", "alltoall", "all_to_all_single", "gather", "scatter", "send", "recv",
              "coalesced", "batch_isend_irecv", "barrier", "broadcast_object_list"}
#: The runtime's groups that exist once per pipeline stage (same name, different members).
_STAGE_LOCAL = ("tp_compute", "tp_cpu")

Rings = dict[int, dict[int, Collective]]
"""rank -> seq -> op, for one communicator."""


def align(evidence: Evidence) -> list[CollectiveFinding]:
    """Findings for every communicator recorded by at least two ranks, plus watchdog seq
    findings. Runtime-named groups come before torch's numbered process groups (the same ops
    seen twice: the runtime's names say what the group carries)."""
    findings: list[CollectiveFinding] = []
    for group, per_rank in sorted(_communicators(evidence).items(),
                                  key=lambda kv: (_numbered(kv[0]), kv[0])):
        if len(per_rank) < 2 or group.startswith("p2p:"):
            continue
        if any(c.op in P2P_OPS for ring in per_rank.values() for c in ring.values()):
            findings.extend(p2p_findings(group, per_rank))
        else:
            findings.extend(_group_findings(group, per_rank))
    findings.extend(_crossed_findings(evidence))
    findings.extend(_watchdog_findings(evidence) or _enqueued_findings(evidence))
    return findings


def _crossed_findings(evidence: Evidence) -> list[CollectiveFinding]:
    """Ranks that stopped in different collectives, each waiting for a rank that is not there
    (see the module docstring)."""
    comms = _communicators(evidence)
    stops: dict[int, tuple[str, Collective]] = {}
    for group, per_rank in comms.items():
        if group.startswith("p2p:"):
            continue
        for rank, seqs in per_rank.items():
            for c in seqs.values():
                if rank not in stops or c.order > stops[rank][1].order:
                    stops[rank] = (group, c)
    if len(stops) < 2 or len({(g, c.op) for g, c in stops.values()}) < 2:
        return []
    waits: list[tuple[int, str, Collective, list[int]]] = []
    for rank, (group, c) in sorted(stops.items()):
        absent = sorted(r for r, seqs in comms[group].items()
                        if r != rank and seqs and max(seqs) < c.seq)
        if absent:
            waits.append((rank, group, c, absent))
    note = ""
    if len(waits) < 2 and all(len(comms[g]) == 1 for g, _ in stops.values()) \
            and len({g for g, _ in stops.values()}) == len(stops):
        # Nothing says who belongs to which group (gloo dumps carry no membership) and each
        # rank's last collective is in a group no other dumped rank recorded at all: every
        # group was created on every rank, and a group of one never waits, so each rank
        # waits for the others in a collective they never entered.
        waits = [(rank, group, c, sorted(r for r in stops if r != rank))
                 for rank, (group, c) in sorted(stops.items())]
        note = (" (the dumps record no group membership; no dumped rank entered another's "
                "group)")
    if len(waits) < 2:
        return []
    parts = [f"rank {rank} waits in {c.op} #{c.seq} of group {group} (from "
             f"{site_label(c.site)}), which rank{'s' if len(absent) > 1 else ''} "
             f"{', '.join(map(str, absent))} never entered" for rank, group, c, absent in waits]
    return [CollectiveFinding(
        group=",".join(sorted({g for _, g, _, _ in waits})), seq=waits[0][2].seq,
        kind=FindingKind.CROSSED, ranks=sorted(r for r, _, _, _ in waits),
        detail="ranks stopped in different collectives: " + "; ".join(parts) + note,
        evidence=[_item(c, rank) for rank, _, c, _ in waits][:4])]


def _communicators(evidence: Evidence) -> dict[str, Rings]:
    """Rings per communicator; a stage-local group gets its stage in the key when the ranks
    that recorded it sit on more than one stage, and every group its DP group when the ranks
    belong to several (each DP group is a world of its own: same names, other members)."""
    stages: dict[str, set[int | None]] = defaultdict(set)
    for ev in evidence.ranks.values():
        for group in ev.collectives:
            stages[group].add(ev.pp)
    several_dp = len({ev.dp for ev in evidence.ranks.values() if ev.dp is not None}) > 1
    out: dict[str, Rings] = defaultdict(dict)
    for ev in evidence.ranks.values():
        for group, ring in ev.collectives.items():
            out[_key(group, ev, stages[group], several_dp)][ev.rank] = {c.seq: c for c in ring}
    return out


def _key(group: str, ev: RankEvidence, stages: set[int | None], several_dp: bool) -> str:
    where = [f"DP{ev.dp}"] if several_dp and ev.dp is not None else []
    if group in _STAGE_LOCAL and len(stages) > 1 and ev.pp is not None:
        where.append(f"PP{ev.pp}")
    return f"{group} ({' '.join(where)})" if where else group


def _numbered(group: str) -> bool:
    return group.removeprefix("p2p:").removeprefix("pg").isdigit()


def _group_findings(group: str, per_rank: Rings) -> list[CollectiveFinding]:
    lasts = {r: max(seqs) for r, seqs in per_rank.items() if seqs}
    firsts = {r: min(seqs) for r, seqs in per_rank.items() if seqs}
    if len(lasts) < 2:
        return []
    window_start = max(firsts.values())
    out: list[CollectiveFinding] = []
    top = max(lasts.values())
    behind = sorted(r for r, last in lasts.items() if last < top)
    if behind:
        seq = min(lasts[r] for r in behind) + 1
        ahead = sorted(r for r, last in lasts.items() if last >= seq)
        example = per_rank[ahead[0]].get(seq)
        out.append(CollectiveFinding(
            group=group, seq=seq, kind=FindingKind.MISSING_RANKS, ranks=behind,
            detail=f"ranks {ahead} entered #{seq}"
                   + (f" ({example.op} from {site_label(example.site)})" if example else "")
                   + f"; ranks {behind} never did (their last is "
                   + ", ".join(f"{r}: #{lasts[r]}" for r in behind) + ")",
            evidence=[_item(per_rank[r][lasts[r]], r) for r in behind][:4],
            func=example.site.func if example and example.site else None))
    seen: set[FindingKind] = set()
    for seq in range(window_start, min(lasts.values()) + 1):
        entries = {r: seqs[seq] for r, seqs in per_rank.items() if seq in seqs}
        if len(entries) < 2:
            continue
        for f in _mismatches(group, seq, entries):
            if f.kind not in seen:
                seen.add(f.kind)
                out.append(f)
    return out


def _mismatches(group: str, seq: int, entries: dict[int, Collective]) -> list[CollectiveFinding]:
    out: list[CollectiveFinding] = []
    ops = {r: c.op for r, c in entries.items()}
    if len(set(ops.values())) > 1:
        out.append(_finding(group, seq, FindingKind.OP_MISMATCH, entries,
                            lambda r, c: f"rank {r}: {c.op}"
                            + (f" from {site_label(c.site)}" if c.site else "")))
        return out
    sites = {r: site_label(c.site) for r, c in entries.items()}
    if len(set(sites.values())) > 1 and all(sites.values()):
        out.append(_finding(group, seq, FindingKind.SITE_MISMATCH, entries,
                            lambda r, c: f"rank {r}: {c.op} from {site_label(c.site)}"))
    op = next(iter(ops.values()))
    sizes = {r: c.sizes for r, c in entries.items()}
    if op not in _SIZE_FREE and len(set(sizes.values())) > 1:
        out.append(_finding(group, seq, FindingKind.SIZE_MISMATCH, entries,
                            lambda r, c: f"rank {r}: {c.op} sizes {c.sizes}"))
    return out


def _finding(group: str, seq: int, kind: FindingKind, entries: dict[int, Collective],
             describe: object) -> CollectiveFinding:
    parts = [describe(r, c) for r, c in sorted(entries.items())]  # type: ignore[operator]
    return CollectiveFinding(group=group, seq=seq, kind=kind, ranks=sorted(entries),
                             detail=f"#{seq}: " + "; ".join(parts),
                             evidence=[_item(c, r) for r, c in sorted(entries.items())][:4])


def _item(c: Collective, rank: int) -> EvidenceItem:
    return EvidenceItem(text=f"rank {rank} group {c.group} seq {c.seq}: {c.op} ({c.state}) from "
                             f"{site_label(c.site)}", file=c.source.file, line=c.source.line,
                        rank=rank)


SEQ_MOMENT = 1000
"""Watchdog SeqNums further apart than this are not one hang: ranks stuck together differ by
the few collectives one of them skipped or added, so records hundreds of thousands apart are
occurrences a report quotes one after another (a job restarted, the hang came back)."""


@dataclass(frozen=True)
class WatchdogTimeout:
    """One rank's (first) NCCL watchdog timeout."""

    rank: int
    seq: int
    op: str
    numel: str | None
    item: EvidenceItem


def watchdog_moments(evidence: Evidence) -> list[dict[int, WatchdogTimeout]]:
    """Each rank's first watchdog timeout, grouped into the hangs they belong to (SeqNums
    within :data:`SEQ_MOMENT` of each other), by rising SeqNum."""
    found: list[WatchdogTimeout] = []
    for ev in evidence.ranks.values():
        stats = ev.hits.get("nccl-watchdog-timeout")
        if not stats:
            continue
        h = next(iter(stats.kept))
        seq = h.groups.get("seq")
        if seq and seq.isdigit() and len(seq) <= 12:
            found.append(WatchdogTimeout(
                ev.rank, int(seq), h.groups.get("op", "?"), h.groups.get("numel_in"),
                EvidenceItem(text=h.text, file=h.source.file, line=h.source.line, rank=ev.rank)))
    moments: list[dict[int, WatchdogTimeout]] = []
    for t in sorted(found, key=lambda t: (t.seq, t.rank)):
        if not moments or t.seq - max(x.seq for x in moments[-1].values()) > SEQ_MOMENT:
            moments.append({})
        moments[-1][t.rank] = t
    return moments


def _watchdog_findings(evidence: Evidence) -> list[CollectiveFinding]:
    """NCCL watchdog timeouts name (SeqNum, OpType) per rank; differing ones tell who is
    behind or running another op (within one hang: :func:`watchdog_moments`)."""
    out = []
    for seen in watchdog_moments(evidence):
        if len(seen) < 2 or len({(t.seq, t.op) for t in seen.values()}) == 1:
            continue
        low = min(t.seq for t in seen.values())
        ops = {t.op for t in seen.values() if t.seq == low}
        kind = FindingKind.OP_MISMATCH if len({t.seq for t in seen.values()}) == 1 \
            else FindingKind.SEQ_BEHIND
        ranks = sorted(r for r, t in seen.items() if t.seq == low)
        detail = "watchdog timeouts: " + "; ".join(
            f"rank {r}: SeqNum {t.seq} {t.op}" for r, t in sorted(seen.items()))
        if kind == FindingKind.SEQ_BEHIND:
            detail += f" (ranks {ranks} are behind at SeqNum {low} {'/'.join(sorted(ops))})"
        out.append(CollectiveFinding(group="nccl", seq=low, kind=kind, ranks=ranks,
                                     detail=detail,
                                     evidence=[t.item for t in seen.values()][:4]))
    return out


#: The process group a watchdog line names: ``[PG ID 0 PG GUID 0(default_pg) Rank 1]``,
#: ``[PG 2 Rank 0]``.
_PG = re.compile(r"\[PG(?: ID)? (?P<pg>\d{1,9})\b")


def _enqueued_findings(evidence: Evidence) -> list[CollectiveFinding]:
    """The last NCCL work each rank had enqueued when its watchdog fired ("last enqueued NCCL
    work: N"), per process group, where the watchdog lines give no SeqNum to compare (cut,
    wrapped or pasted without the WorkNCCL line). Sequence numbers count a group's
    collectives: ranks of one group that enqueued different numbers did not issue the same
    collectives, and the ones behind never issued one the others wait in (what torch's own
    desync report calls ranks that never joined). Ranks of different groups say nothing."""
    with_seq = [ev for ev in evidence.ranks.values() if (w := ev.hits.get("nccl-watchdog-timeout"))
                and any((h.groups.get("seq") or "").isdigit() for h in w.kept)]
    if len(with_seq) >= 2:
        return []  # the watchdogs' own SeqNums decide (_watchdog_findings)
    groups: dict[str, dict[int, tuple[int, EvidenceItem]]] = defaultdict(dict)
    for ev in evidence.ranks.values():
        stats = ev.hits.get("nccl-last-enqueued")
        if not stats or ev.rank < 0:
            continue
        for h in stats.kept:
            enqueued = h.groups.get("enqueued", "")
            if not enqueued.isdigit() or len(enqueued) > 12:
                continue  # -1: nothing enqueued yet
            m = _PG.search(h.text)
            group = groups[f"PG {m['pg']}" if m else "nccl"]
            n, prev = int(enqueued), group.get(ev.rank)
            if prev is None or n > prev[0]:
                group[ev.rank] = (n, EvidenceItem(text=h.text, file=h.source.file,
                                                  line=h.source.line, rank=ev.rank))
    out = []
    for name, by_rank in sorted(groups.items()):
        values = {n for n, _ in by_rank.values()}
        if len(by_rank) < 2 or len(values) < 2:
            continue
        low = min(values)
        ranks = sorted(r for r, (n, _) in by_rank.items() if n == low)
        detail = ("last enqueued NCCL work: " + "; ".join(
            f"rank {r}: {n}" for r, (n, _) in sorted(by_rank.items()))
            + f" (ranks {ranks} are behind at {low}: they never issued a collective the others "
              "wait in)")
        out.append(CollectiveFinding(group=name, seq=low, kind=FindingKind.SEQ_BEHIND,
                                     ranks=ranks, detail=detail,
                                     evidence=[it for _, it in by_rank.values()][:4]))
    return out
