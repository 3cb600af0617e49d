"""Pairing point-to-point ops across ranks: rank A's k-th send to B is B's k-th receive from A.

Sends and receives are FIFO per (sender, receiver) channel, so the pairing needs each op's
ordinal on its channel, not the group's sequence number (which also counts the rank's other
sends and receives). The ordinal is known when

* the rank's ring still holds the group's first op (seq 1): count along the channel; or
* every op the rank holds on the group is on this one channel (a two-stage pipeline: PP0 only
  sends activations, PP1 only receives them): the ordinal is ``seq - 1``, whatever the ring lost.

Otherwise the channel is left alone (nothing is claimed that the evidence cannot support).
On a channel whose both ends are known:

* **unreceived-send**: A sent more than B received; the first send B never took;
* **unmatched-recv**: B waits for (or timed out on) a receive A never sent;
* **size-mismatch**: a paired send and receive with different shapes.

An isend whose state is still ``started`` is not evidence by itself: the runtime only marks an
async send complete when it reaps it, so pairing, not state, says what was received.
"""

from __future__ import annotations

from collections import defaultdict

from doctor.model.evidence import Collective
from doctor.model.findings import CollectiveFinding, EvidenceItem, FindingKind
from doctor.ranks.table import site_label

SEND_OPS = frozenset({"isend", "send"})
RECV_OPS = frozenset({"irecv", "recv"})
P2P_OPS = SEND_OPS | RECV_OPS

Rings = dict[int, dict[int, Collective]]
Channel = dict[int, Collective]
"""ordinal on the channel -> op"""


def p2p_findings(group: str, per_rank: Rings) -> list[CollectiveFinding]:
    """Findings of every (sender, receiver) channel of one group, first per kind."""
    sends: dict[tuple[int, int], Channel] = {}
    recvs: dict[tuple[int, int], Channel] = {}
    unknown: set[int] = set()
    for rank, ring in per_rank.items():
        channels = _channels(ring)
        if channels is None:
            unknown.add(rank)
            continue
        for (direction, peer), channel in channels.items():
            if direction == "send":
                sends[(rank, peer)] = channel
            else:
                recvs[(peer, rank)] = channel
    out: list[CollectiveFinding] = []
    seen: set[FindingKind] = set()
    for (src, dst) in sorted(set(sends) | set(recvs)):
        if src not in per_rank or dst not in per_rank or {src, dst} & unknown:
            continue  # one end has no recorder, or its ordinals are unknown: no claim
        for f in _channel_findings(group, src, dst, sends.get((src, dst), {}),
                                   recvs.get((src, dst), {})):
            if f.kind not in seen:
                seen.add(f.kind)
                out.append(f)
    return out


def _channels(ring: dict[int, Collective]) -> dict[tuple[str, int], Channel] | None:
    """The rank's p2p ops of one group by (direction, peer), keyed by their ordinal; None when
    the ordinals cannot be known (see the module docstring)."""
    ops = [ring[s] for s in sorted(ring) if ring[s].op in P2P_OPS and ring[s].peer is not None]
    if not ops:
        return {}
    by_channel: dict[tuple[str, int], list[Collective]] = defaultdict(list)
    for c in ops:
        by_channel[("send" if c.op in SEND_OPS else "recv", c.peer or 0)].append(c)
    if min(ring) == 1:
        return {k: dict(enumerate(v)) for k, v in by_channel.items()}
    if len(by_channel) == 1 and len(ops) == len(ring):
        ((k, v),) = by_channel.items()
        return {k: {c.seq - 1: c for c in v}}
    return None


def _channel_findings(group: str, src: int, dst: int, sent: Channel, got: Channel
                      ) -> list[CollectiveFinding]:
    out: list[CollectiveFinding] = []
    last_sent = max(sent) if sent else -1
    last_got = max(got) if got else -1
    if last_sent > last_got:
        k = last_got + 1
        if k in sent:
            c = sent[k]
            out.append(_finding(
                group, FindingKind.UNRECEIVED_SEND, c, src, [src, dst], peer=dst, detail=
                f"rank {src}'s {c.op} #{c.seq} to rank {dst} from {site_label(c.site)} "
                f"({_nth(k)} on this channel) was never received: rank {dst} received "
                f"{last_got + 1} from rank {src}" + _last(got, last_got)))
    elif last_got > last_sent:
        k = last_sent + 1
        if k in got:
            c = got[k]
            out.append(_finding(
                group, FindingKind.UNMATCHED_RECV, c, dst, [dst], peer=src, detail=
                f"rank {dst}'s {c.op} #{c.seq} from rank {src} at {site_label(c.site)} "
                f"({c.state}) waits for a send that never came: rank {src} sent "
                f"{last_sent + 1} to rank {dst}" + _last(sent, last_sent)))
    for k in sorted(set(sent) & set(got)):
        if sent[k].sizes != got[k].sizes and sent[k].sizes and got[k].sizes:
            s, g = sent[k], got[k]
            out.append(_finding(
                group, FindingKind.SIZE_MISMATCH, g, dst, [src, dst],
                f"{_nth(k)} message rank {src} -> rank {dst}: {s.op} #{s.seq} sizes {s.sizes} "
                f"from {site_label(s.site)}; {g.op} #{g.seq} sizes {g.sizes} at "
                f"{site_label(g.site)}", extra=(s, src)))
            break
    return out


def _last(channel: Channel, last: int) -> str:
    if last < 0:
        return ""
    c = channel[last]
    return f" (the last: {c.op} #{c.seq}, {c.state})"


def _nth(k: int) -> str:
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _finding(group: str, kind: FindingKind, c: Collective, rank: int, ranks: list[int], detail: str,
             extra: tuple[Collective, int] | None = None,
             peer: int | None = None) -> CollectiveFinding:
    items = [_item(c, rank)] + ([_item(*extra)] if extra else [])
    return CollectiveFinding(group=group, seq=c.seq, kind=kind, ranks=sorted(ranks),
                             detail=detail, evidence=items, peer=peer)


def _item(c: Collective, rank: int) -> EvidenceItem:
    peer = f" peer {c.peer}" if c.peer is not None else ""
    return EvidenceItem(text=f"rank {rank} group {c.group} seq {c.seq}: {c.op}{peer} ({c.state}) "
                             f"from {site_label(c.site)}", file=c.source.file,
                        line=c.source.line, rank=rank)
