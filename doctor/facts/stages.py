"""Facts from what pipeline stages record about each other.

* ``pp.recv`` {sender_rids, sender_extend, sender_step, local_rids, local_extend}: the batch a
  downstream stage received next to the view it built of it; a difference is the prefix-length
  disagreement itself, seen at the stage that fails;
* ``sync.host_capacity`` {local, agreed, synced, bytes_per_token}: each stage's host-pool
  token capacity at start-up; different agreed values mean nothing synced them.
"""

from __future__ import annotations

from typing import Any

from doctor.facts.factset import FactSet, witness
from doctor.model.builder import Evidence
from doctor.model.evidence import SourceRef
from doctor.model.findings import Divergence
from hicache_runtime.contracts.events import Ev
from signatures.fact_names import Fact


def stage_batches(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    """``pp.recv``: a downstream stage received the hidden states of one batch and built
    another view of it (other requests or other extend lengths): the stages disagree on the
    batch's prefix lengths. The first such step per rank is the witness."""
    for r in ev.ranks.values():
        for kind, attrs, src, step in r.events:
            if kind != Ev.PP_RECV:
                continue
            sent = (attrs.get("sender_rids"), attrs.get("sender_extend"))
            built = (attrs.get("local_rids"), attrs.get("local_extend"))
            if None in sent or sent == built:
                continue
            facts.add(Fact.PREFIX_LENGTH_DIVERGENCE, witness(
                f"rank {r.rank} ({r.role}) step {step} received the batch of step "
                f"{attrs.get('sender_step')} ({attrs.get('sender_tokens')} tokens: "
                f"{_pairs(*sent)}) but built {attrs.get('local_tokens')} tokens: "
                f"{_pairs(*built)}", src, r.rank))
            break


def _pairs(rids: object, extend: object) -> str:
    if isinstance(rids, list) and isinstance(extend, list) and len(rids) == len(extend):
        return ", ".join(f"{rid} +{n}" for rid, n in zip(rids, extend))[:120]
    return f"{rids} {extend}"[:120]


def host_capacity_events(ev: Evidence, divs: list[Divergence], facts: FactSet) -> None:
    """``sync.host_capacity`` {local, agreed, synced, bytes_per_token}: stages that kept
    different capacities (nothing synced them)."""
    agreed: dict[int, tuple[Any, Any, SourceRef]] = {}
    for r in ev.ranks.values():
        for kind, attrs, src, _step in r.events:
            if kind == Ev.HOST_CAPACITY and isinstance(attrs.get("agreed"), int):
                agreed.setdefault(r.rank, (attrs["agreed"], attrs.get("bytes_per_token"), src))
    if len({a for a, _, _ in agreed.values()}) > 1:
        text = ", ".join(f"rank {k}: {a} tokens ({b} bytes/token)"
                         for k, (a, b, _) in sorted(agreed.items()))
        first = agreed[min(agreed)][2]
        facts.add(Fact.HOST_CAPACITY_DIFFERS, witness(
            f"stages kept different host capacities, never synced: {text}", first, -1))
