"""Scoring an observation against every signature, with a rule log (Socorro-style).

The doctor reduces its evidence to an :class:`Observation`: exceptions (type, message, in-app
functions), stacks of failing and blocked threads, log-pattern hit counts, derived facts and the
bundle's legacy switches, each with witnesses (file:line). :func:`score_all` evaluates every
recogniser of every signature against it:

* a matched recogniser adds its weight (negative weights subtract); the score is clamped to
  [0, 1] and is the verdict's confidence;
* a signature is **named** only if its score reaches its threshold *and* at least one positive
  *structural* recogniser matched (frames, a fact, a legacy switch, or a log pattern marked
  ``specific``): a message alone never names a signature;
* everything else that scored at least ``NEAR_MISS`` is a near miss, with the reason.

Every decision is a :class:`RuleResult` line, kept for the report's rule log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from signatures.facts import Fact
from signatures.models import Catalog, Signature

NEAR_MISS = 0.25
#: Outcome facts say *that* something failed, not *how*: they are not structure.
_NOT_STRUCTURAL = {Fact.HANG, Fact.CRASH, Fact.WRONG_OUTPUT, Fact.OOM_KILLED}


@dataclass(frozen=True)
class Witness:
    """A piece of evidence: what was seen, where, on which rank (-1: unknown)."""

    text: str
    file: str | None = None
    line: int | None = None
    rank: int = -1


@dataclass
class ObservedException:
    type: str
    message: str
    in_app: list[str]
    """In-app function names of its stack, innermost first."""
    witness: Witness
    secondary: bool = False
    """It reports a peer's failure (a timeout, a lost connection), not this rank's own."""


@dataclass
class ObservedStack:
    kind: str
    """``exception`` (a failing stack) or ``blocked`` (a thread stuck in a collective)."""
    in_app: list[str]
    witness: Witness


@dataclass
class Observation:
    exceptions: list[ObservedException] = field(default_factory=list)
    stacks: list[ObservedStack] = field(default_factory=list)
    log_hits: dict[str, tuple[int, list[Witness]]] = field(default_factory=dict)
    facts: dict[Fact, list[Witness]] = field(default_factory=dict)
    legacy: dict[str, Witness] = field(default_factory=dict)


@dataclass
class RuleResult:
    signature: str
    recogniser: str
    matched: bool
    weight: float
    structural: bool
    why: str
    witnesses: list[Witness] = field(default_factory=list)

    def line(self) -> str:
        sign = f"{self.weight:+.2f}" if self.matched else "  -  "
        return f"{self.signature}: {sign} {self.recogniser}: {self.why}"


@dataclass
class Score:
    signature: Signature
    score: float
    structural: bool
    rules: list[RuleResult]
    causal: bool = False
    """It rests on a *causal* fact (the first divergence): it explains the others' symptoms."""

    @property
    def named(self) -> bool:
        return self.structural and self.score >= self.signature.threshold - 1e-9

    @property
    def matched(self) -> list[RuleResult]:
        return [r for r in self.rules if r.matched]

    def because(self) -> str:
        """Why it scored what it did, in one sentence (for near misses)."""
        pos = [r.recogniser for r in self.matched if r.weight > 0]
        neg = [r.recogniser for r in self.matched if r.weight < 0]
        missing = sorted((r for r in self.rules if not r.matched and r.weight > 0),
                         key=lambda r: -r.weight)[:2]
        parts = [("matched " + ", ".join(pos)) if pos else "nothing specific matched"]
        if neg:
            parts.append("but " + ", ".join(neg) + " point elsewhere")
        if not self.structural:
            parts.append("no structural evidence (a message alone never names a signature)")
        if missing:
            parts.append("missing " + "; ".join(r.recogniser for r in missing))
        return "; ".join(parts)


def score_all(catalog: Catalog, obs: Observation,
              causal: frozenset[Fact] = frozenset()) -> list[Score]:
    """Every signature's score, best first.

    Named signatures come first; among them, those resting on a ``causal`` fact (the earliest
    divergence between ranks) rank above those that only describe its consequences (a
    deadlock that a divergent eviction caused names the eviction first). Then score, amount
    of structure, catalog order.
    """
    scores = [score_one(sig, catalog, obs) for sig in catalog.signatures]
    labels = {f"fact '{f.value}'" for f in causal}
    for s in scores:
        s.causal = any(r.matched and r.weight > 0 and r.recogniser in labels for r in s.rules)
    order = {s.id: i for i, s in enumerate(catalog.signatures)}
    return sorted(scores, key=lambda s: (-s.named, -(s.named and s.causal),
                                         -round(s.score, 6),
                                         -sum(r.structural for r in s.matched),
                                         order[s.signature.id]))


def score_one(sig: Signature, catalog: Catalog, obs: Observation) -> Score:
    rec = sig.recognisers
    rules: list[RuleResult] = []
    matched_exc: list[ObservedException] = []
    for er in rec.exceptions:
        rules.append(_exception_rule(sig.id, er.type, er.message, er.weight, obs, matched_exc))
    if rec.frames is not None:
        rules.append(_frames_rule(sig, obs, matched_exc))
    for lr in rec.logs:
        pattern = catalog.pattern(lr.pattern)
        count, wits = obs.log_hits.get(lr.pattern, (0, []))
        ok = count >= lr.min_count
        why = f"{count} hit(s)" + (f" (needs {lr.min_count})" if lr.min_count > 1 else "")
        rules.append(RuleResult(sig.id, f"log '{lr.pattern}'", ok, lr.weight,
                                pattern.specific and lr.weight > 0, why, wits[:3] if ok else []))
    for fr in rec.facts:
        wits = obs.facts.get(fr.fact, [])
        rules.append(RuleResult(sig.id, f"fact '{fr.fact.value}'", bool(wits), fr.weight,
                                fr.fact not in _NOT_STRUCTURAL and fr.weight > 0,
                                fr.fact.describe() if wits else "not observed", wits[:3]))
    for leg in rec.legacy:
        w = obs.legacy.get(leg.switch)
        rules.append(RuleResult(sig.id, f"legacy '{leg.switch}'", w is not None, leg.weight,
                                True, "the run had this legacy switch on" if w else "not on",
                                [w] if w else []))
    total = sum(r.weight for r in rules if r.matched)
    structural = any(r.matched and r.structural and r.weight > 0 for r in rules)
    return Score(sig, max(0.0, min(1.0, total)), structural, rules)


def _exception_rule(sig_id: str, type_rx: str, msg_rx: str, weight: float, obs: Observation,
                    matched: list[ObservedException]) -> RuleResult:
    t, m = re.compile(type_rx), re.compile(msg_rx)
    hits = [e for e in obs.exceptions
            if (t.fullmatch(e.type) or t.fullmatch(e.type.rsplit(".", 1)[-1]))
            and m.search(e.message)]
    matched.extend(hits)
    label = f"exception {type_rx} /{msg_rx}/"
    why = f"{len(hits)} exception(s) match" if hits else "no such exception"
    return RuleResult(sig_id, label, bool(hits), weight, False, why,
                      [e.witness for e in hits[:3]])


def _frames_rule(sig: Signature, obs: Observation,
                 matched_exc: list[ObservedException]) -> RuleResult:
    fr = sig.recognisers.frames
    assert fr is not None  # only called when the signature has a frame recogniser
    rxs = [re.compile(x) for x in fr.any]
    candidates: list[tuple[list[str], Witness]] = []
    if fr.where in ("exception", "any"):
        excs = matched_exc or [e for e in obs.exceptions if not e.secondary]
        candidates += [(e.in_app, e.witness) for e in excs]
    if fr.where in ("blocked", "any"):
        candidates += [(s.in_app, s.witness) for s in obs.stacks if s.kind == "blocked"]
    if fr.where == "any":
        candidates += [(s.in_app, s.witness) for s in obs.stacks if s.kind == "exception"]
    for funcs, wit in candidates:
        for func in funcs:
            if any(rx.search(func) for rx in rxs):
                w = Witness(f"{func} on the {fr.where if fr.where != 'any' else 'failing'} "
                            f"stack: {wit.text}", wit.file, wit.line, wit.rank)
                return RuleResult(sig.id, f"in-app frame ({fr.where})", True, fr.weight, True,
                                  f"{func} is on the stack", [w])
    return RuleResult(sig.id, f"in-app frame ({fr.where})", False, fr.weight, True,
                      "none of " + ", ".join(x.strip("^$()|.\\") for x in fr.any[:4])
                      + (" ..." if len(fr.any) > 4 else "") + " on a relevant stack")
