"""Failures the fault injector caused on purpose.

A fault whose kind is the failure itself (``crash``, ``hang``, ``rank-kill``: the runtime marks
its firing ``fatal`` in the trace event and in the bundle's ``faults_fired``) explains the run's
end: the rank failed because a test told it to, and its peers' timeouts, blocked collectives and
lost connections follow. An ``InjectedFault`` exception (what a fired ``crash`` raises) says the
same in bundles written before firings were marked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from doctor.facts.factset import FactSet, witness
from doctor.model.builder import Evidence
from doctor.model.evidence import SourceRef
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.fault_effects import FaultEffect, effect_of
from signatures.fact_names import Fact

INJECTED_EXCEPTION = "InjectedFault"
_DID = {FaultEffect.CRASH: "raised an injected crash", FaultEffect.HANG: "was made to hang",
        FaultEffect.KILL: "was killed (SIGKILL)"}


@dataclass(frozen=True)
class InjectedFailure:
    """One firing of a fatal fault on a rank."""

    rank: int
    kind: str
    effect: FaultEffect | None
    """What it did (the event's ``effect``; for older bundles, what its kind did then)."""
    spec: str
    point: str
    step: int | None
    source: SourceRef | None

    def describe(self) -> str:
        what = _DID.get(self.effect, f"failed by {self.kind}") if self.effect \
            else f"failed by {self.kind}"
        at = f" at {self.point}" if self.point else ""
        step = f", step {self.step}" if self.step is not None else ""
        who = f"rank {self.rank}" if self.rank >= 0 else "a rank"
        return f"{who} {what}{at}{step} by the injected fault {self.spec}"


def _text(value: Any) -> str:
    return str(value)[:200] if value is not None else ""


def injected_failures(ev: Evidence) -> list[InjectedFailure]:
    """Every fatal firing, one per rank and spec (a trace and a manifest both record it)."""
    seen: set[tuple[int, str]] = set()
    out: list[InjectedFailure] = []
    for r in ev.all_ranks():
        for kind, attrs, src, step in r.events:
            if kind != Ev.FAULT or attrs.get("fatal") is not True:
                continue
            key = (r.rank, _text(attrs.get("spec")))
            if key in seen:
                continue
            seen.add(key)
            out.append(InjectedFailure(r.rank, _text(attrs.get("kind")), effect_of(attrs), key[1],
                                       _text(attrs.get("point")),
                                       step if isinstance(step, int) else None, src))
    return out


def killed_on_purpose(ev: Evidence) -> set[int]:
    """Ranks an injected ``rank-kill`` fired on: their SIGKILL is the test's, not the OOM
    killer's."""
    return {f.rank for f in injected_failures(ev) if f.effect is FaultEffect.KILL}


def fact_injected(ev: Evidence, facts: FactSet) -> None:
    """``injected-failure`` from fatal firings, else from an ``InjectedFault`` exception."""
    for f in injected_failures(ev):
        facts.add(Fact.INJECTED_FAILURE, witness(f.describe(), f.source, f.rank))
    if Fact.INJECTED_FAILURE in facts:
        return
    for r in ev.all_ranks():
        for e in r.exceptions:
            if e.short_type == INJECTED_EXCEPTION:
                facts.add(Fact.INJECTED_FAILURE, witness(
                    f"rank {r.rank} raised {e.text}" if r.rank >= 0 else f"raised {e.text}",
                    e.source, r.rank))
                break
