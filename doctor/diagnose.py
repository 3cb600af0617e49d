"""The doctor's pipeline: read inputs, resolve ranks, analyse, score, report.

``diagnose(paths)`` is the one entry point (the CLI and tests call it). Each analysis step runs
inside a guard: a step that fails on odd evidence is listed under ``problems`` and the report
is built from the other steps. Nothing here prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import BinaryIO, TypeVar

from doctor.facts.derive import derive_facts
from doctor.facts.factset import FactSet
from doctor.facts.observation import build_observation
from doctor.facts.trace import divergence_fact
from doctor.facts.upstream import mechanisms, resolve_lines
from doctor.model.builder import Evidence, EvidenceBuilder
from doctor.model.evidence import InputStatus
from doctor.model.findings import BlockedSite, CollectiveFinding, Divergence, EvidenceItem, RankRow
from doctor.model.frames import classifier_for
from doctor.ranks.collectives import align
from doctor.ranks.divergence import all_divergences
from doctor.ranks.table import blocked_sites, mark_progress, rank_rows
from doctor.read.ingest import EMPTY, Ingester
from doctor.report.bounds import MAX_LISTED_RANKS, clip_texts, rank_ranges
from doctor.report.fingerprint import fingerprint
from doctor.report.missing import missing_items
from doctor.report.model import (
    EXIT_DIAGNOSED,
    EXIT_NO_SIGNATURE,
    EXIT_UNREADABLE,
    Diagnosis,
    DiagnosisStatus,
    InputSummary,
    LookalikeFinding,
    Mitigation,
    NearMiss,
    Verdict,
)
from doctor.report.narrative import observations
from doctor.report.releases import weigh_by_release
from doctor.report.timeline import build_timeline
from hicache_runtime.contracts.bundle import RunOutcome
from signatures.fact_names import Fact
from signatures.index import load_index, warm_up
from signatures.loader import load_catalog
from signatures.matching import (
    NEAR_MISS,
    LookalikeMatch,
    MechanismHit,
    Score,
    match_lookalikes,
    score_all,
)
from signatures.models import Catalog

T = TypeVar("T")
MAX_EVIDENCE = 12
#: Two named signatures this close at the top: the evidence does not tell them apart, so the
#: first is not stated with high confidence (a wrong answer at high confidence costs more
#: than an uncertain right one). A causal first (the divergence that led to the other) is
#: told apart, and keeps its confidence.
TIE_MARGIN = 0.05
TIED_CAP = 0.75


def diagnose(paths: Iterable[str] = (), *, streams: Iterable[tuple[str, BinaryIO]] = (),
             catalog: Catalog | None = None) -> Diagnosis:
    """Diagnose the artifacts at ``paths`` (files, directories, archives, ``-`` for stdin)."""
    catalog = catalog or load_catalog()
    warm_up()  # the upstream index loads while the inputs are read
    sink = EvidenceBuilder()
    ingester = Ingester(catalog, sink)
    for p in paths:
        ingester.add_path(p)
    for name, stream in streams:
        ingester.add_stream(name, stream)
    return analyse(sink.finish(), catalog)


def analyse(ev: Evidence, catalog: Catalog) -> Diagnosis:
    """Everything after reading: tables, alignment, divergence, facts, scores, report."""
    frames = classifier_for(catalog.frames)
    problems = list(ev.problems)

    def guard(name: str, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except Exception as exc:  # report the failed step, keep the rest of the analysis
            problems.append(f"{name} failed ({type(exc).__name__}: {exc}); skipped")
            return default

    guard("progress between samples", lambda: mark_progress(ev, frames), None)
    rows: list[RankRow] = guard("rank table", lambda: rank_rows(ev, frames), [])
    sites: list[BlockedSite] = guard("blocked call sites", lambda: blocked_sites(ev, frames), [])
    findings: list[CollectiveFinding] = guard("collective alignment", lambda: align(ev), [])
    divs: list[Divergence] = guard("decision alignment", lambda: all_divergences(ev), [])
    guard("upstream templates", lambda: resolve_lines(ev, load_index()), None)
    mechs: list[MechanismHit] = guard("upstream mechanisms",
                                      lambda: mechanisms(ev, load_index()), [])
    facts = guard("facts", lambda: derive_facts(ev, frames, rows, sites, findings, divs,
                                                problems.append, mechs), FactSet())
    first = divs[0] if divs else None
    obs = guard("observation", lambda: build_observation(ev, frames, facts, mechs), None)
    scores: list[Score] = guard("scoring", lambda: score_all(catalog, obs, _causal(first, facts)),
                   []) if obs is not None else []
    looks: list[LookalikeMatch] = guard("look-alikes", lambda: match_lookalikes(catalog, obs),
                  []) if obs is not None else []
    diag = _report(ev, catalog, scores, facts, looks)
    diag.ranks, diag.blocked_sites, diag.collectives = rows, sites, findings
    diag.first_divergence = first
    diag.timeline = guard("timeline", lambda: build_timeline(ev, rows, first), None)
    diag.observations = guard("observations", lambda: observations(
        ev, facts, rows, sites, findings, first), [])
    diag.missing = guard("missing evidence", lambda: missing_items(
        ev, rows, Fact.HANG in facts, obs.single_line if obs is not None else False), [])
    diag.fingerprint = guard("fingerprint", lambda: fingerprint(
        ev, frames, sites, facts, [m.lookalike.id for m in looks]), None)
    diag.problems = problems
    clip_texts(diag)
    return diag


def _report(ev: Evidence, catalog: Catalog, scores: list[Score], facts: FactSet,
            looks: list[LookalikeMatch]) -> Diagnosis:
    """The verdict part of the report: status, verdicts, near misses, inputs, rule log."""
    verdicts = weigh_by_release(_capped_ties([s for s in scores if s.named]), ev, catalog)
    near = [NearMiss(signature=s.signature.id, score=round(s.score, 2), because=s.because())
            for s in scores if not s.named and s.score >= NEAR_MISS][:5]
    lookalikes = [_lookalike(m) for m in looks]
    status, code = _status(any(i.status == InputStatus.READ for i in ev.inputs), verdicts)
    missing = sorted(ev.expected_ranks - set(ev.ranks))
    return Diagnosis(
        catalog_version=catalog.version, status=status, exit_code=code,
        summary=_summary(status, verdicts, near, ev, lookalikes), verdicts=verdicts,
        near_misses=near, lookalikes=lookalikes,
        missing_ranks=missing[:MAX_LISTED_RANKS], missing_rank_count=len(missing),
        missing_rank_ranges=rank_ranges(missing) if missing else "",
        topology={"tp": ev.topology.tp, "pp": ev.topology.pp, "dp": ev.topology.dp,
                  "world_size": ev.topology.world_size, "sources": ev.topology.sources,
                  "legacy": sorted(ev.legacy), "faults": ev.faults, "outcome": ev.outcome},
        inputs=[InputSummary(path=i.path, kind=i.kind, status=i.status, message=i.message,
                             rank=i.rank) for i in ev.inputs],
        rule_log=_rule_log(scores, facts))


def _capped_ties(named: list[Score]) -> list[Verdict]:
    """The verdicts of the ``named`` scores (best first); when the second is as strong as the
    first (see ``TIE_MARGIN``), every one that strong is capped at ``TIED_CAP``."""
    verdicts = [_verdict(s) for s in named]
    if len(verdicts) < 2 or named[0].causal:
        return verdicts
    best = verdicts[0].confidence
    tied = [v for v in verdicts if v.confidence >= best - TIE_MARGIN]
    if len(tied) < 2 or best <= TIED_CAP:
        return verdicts
    before = [v.confidence for v in tied]
    for v, was in zip(tied, before, strict=True):
        others = ", ".join(f"{o.signature} ({c:.2f})" for o, c in zip(tied, before, strict=True)
                           if o is not v)
        v.tie_note = (f"{others} fit{'s' if len(tied) == 2 else ''} as well: confidence capped "
                      f"at {TIED_CAP:.2f} from {was:.2f}")
        v.confidence = min(was, TIED_CAP)
    return verdicts


def _causal(first: Divergence | None, facts: FactSet) -> frozenset[Fact]:
    """Facts that come first in time: the first divergent decision, a capacity that differs
    from start-up, and prefetch acks voted across ops (the ranks settle different lengths
    from then on, so whatever diverges later follows from it)."""
    out = {Fact.HOST_CAPACITY_DIFFERS, Fact.PREFETCH_ACKS_MISPAIRED} & set(facts)
    fact = divergence_fact(first) if first is not None else None
    if fact is not None:
        out.add(fact)
    return frozenset(out)


def _status(readable: bool, verdicts: list[Verdict]) -> tuple[DiagnosisStatus, int]:
    if not readable:
        return DiagnosisStatus.UNREADABLE, EXIT_UNREADABLE
    if verdicts:
        return DiagnosisStatus.DIAGNOSED, EXIT_DIAGNOSED
    return DiagnosisStatus.NO_KNOWN_SIGNATURE, EXIT_NO_SIGNATURE


def _verdict(s: Score) -> Verdict:
    sig = s.signature
    items: list[EvidenceItem] = []
    seen: set[tuple[str, int]] = set()
    for rule in sorted(s.matched, key=lambda r: -r.weight):
        if rule.weight <= 0:
            continue
        for w in rule.witnesses:
            # one line per finding and rank: the same exception read from a rank's log and
            # from its traceback file is cited once (the first source wins)
            if (w.text, w.rank) not in seen:
                seen.add((w.text, w.rank))
                items.append(EvidenceItem(text=w.text, file=w.file, line=w.line,
                                          rank=w.rank if w.rank >= 0 else None,
                                          rule=rule.recogniser))
    return Verdict(
        signature=sig.id, title=sig.title, severity=sig.severity.value,
        confidence=s.confidence, evidence=items[:MAX_EVIDENCE],
        root_cause=" ".join(sig.root_cause.split()),
        upstream_fix=[f"{f.ref}: {f.summary}" for f in sig.upstream_fix],
        mitigations=[Mitigation(text=m.text, flags=m.flags, env=m.env) for m in sig.mitigations],
        campaign_cell=sig.campaign.cell if sig.campaign else None,
        runbook=f"hicache runbook --signature {sig.id}")


def _lookalike(m: LookalikeMatch) -> LookalikeFinding:
    look = m.lookalike
    return LookalikeFinding(
        id=look.id, title=look.title, score=round(m.score, 2),
        meaning=" ".join(look.meaning.split()), advice=" ".join(look.advice.split()),
        evidence=[EvidenceItem(text=w.text, file=w.file, line=w.line,
                               rank=w.rank if w.rank >= 0 else None, rule=f"look-alike {look.id}")
                  for w in m.witnesses])


def _summary(status: DiagnosisStatus, verdicts: list[Verdict], near: list[NearMiss], ev: Evidence,
             looks: list[LookalikeFinding]) -> str:
    if status == DiagnosisStatus.UNREADABLE:
        errors = [f"{i.path}: {i.message}" for i in ev.inputs if i.status == InputStatus.ERROR]
        more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
        return "no input could be read" + (f" ({'; '.join(errors[:3])}{more})" if errors else "")
    if not verdicts and all(i.kind == EMPTY for i in ev.inputs if i.status == InputStatus.READ):
        return "no failure evidence: the inputs are empty"
    if not verdicts and not near and _running(ev):
        return ("no failure evidence: a live job, every captured rank moved between the "
                "capture's samples")
    if verdicts:
        v = verdicts[0]
        return f"{v.signature} ({v.confidence:.2f}): {v.title}"
    seen = _seen(ev) or (f" (it looks like {looks[0].title.lower()})" if looks else "")
    if near:
        return (f"no known signature fits{seen}; closest: {near[0].signature} "
                f"({near[0].score:.2f}), not enough evidence to name it")
    return f"no known signature fits{seen}"


def _running(ev: Evidence) -> bool:
    """Every rank with stacks had a thread that moved between a capture's samples, and
    nothing else (an exception, an exit) speaks of a failure."""
    with_stacks = [r for r in ev.ranks.values() if len(r.threads)]
    return bool(with_stacks) and all(any(t.moved for t in r.threads) for r in with_stacks) \
        and not any(len(r.exceptions) or r.exits for r in ev.all_ranks())


def _seen(ev: Evidence) -> str:
    """The run's recorded outcome, said in the summary when nothing is named."""
    if ev.outcome == RunOutcome.WRONG_OUTPUT or ev.mismatches:
        return f" (wrong output: {ev.mismatches} request(s) differ from the reference)"
    if ev.outcome == RunOutcome.HEALTHY:
        return " (the bundle records a healthy run)"
    return ""


def _rule_log(scores: list[Score], facts: FactSet) -> list[str]:
    lines = [f"fact {f.value}: {w[0].text}" for f, w in sorted(facts.items(),
                                                               key=lambda kv: kv[0].value)]
    for s in scores:
        if s.score <= 0 and not s.matched:
            continue
        state = "NAMED" if s.named else ("near miss" if s.score >= NEAR_MISS else "rejected")
        lines.append(f"{s.signature.id}: score {s.score:.2f} -> {state}")
        lines += ["  " + r.line() for r in s.rules if r.matched or r.weight >= 0.3]
    return lines
