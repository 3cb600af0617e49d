"""Scoring an observation against every signature, with a rule log (Socorro-style).

The doctor reduces its evidence to an :class:`Observation`: exceptions (type, message, in-app
functions), stacks of failing and blocked threads, log-pattern hit counts, derived facts and the
bundle's legacy switches, each with witnesses (file:line). :func:`score_all` evaluates every
recogniser of every signature against it:

* a matched recogniser adds its weight (negative weights subtract); the score is clamped to
  [0, 1] and is the verdict's confidence;
* a signature's upstream markers (functions, files, log texts, error codes, exceptions of the
  real code, read from a named upstream version) add their weights up to the entry's cap, and
  its markers *against* subtract;
* a look-alike failure class (``lookalikes.yaml``: a PD transfer error, a collective timeout
  after a slow start, a GPU OOM) that fits subtracts its penalty from the signatures it
  explains away;
* a signature is **named** only if its score reaches its threshold *and* at least one positive
  *structural* recogniser matched (frames, a fact, a legacy switch, upstream markers, or a log
  pattern marked ``specific``): a message alone never names a signature;
* its **confidence** is the score, held below the certain bands when the evidence is of one
  kind only or a look-alike competes (see :meth:`Score.confidence`);
* everything else that scored at least ``NEAR_MISS`` is a near miss, with the reason.

Every decision is a :class:`RuleResult` line, kept for the report's rule log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from signatures.fact_names import Fact
from signatures.index import load_index
from signatures.linear import linear
from signatures.models import (
    Catalog,
    FactRecogniser,
    Lookalike,
    Marker,
    MarkerKind,
    MechanismRecogniser,
    Signature,
)

NEAR_MISS = 0.25
#: Confidence ceilings (see Score.confidence): one kind of evidence never reaches the band in
#: which a verdict must be right 97 times in 100; nor does a verdict a look-alike contests.
ONE_KIND_CEILING = 0.7
CONTESTED_CEILING = 0.65
#: Partial evidence (a traceback cut before its exception line, frames or a path alone) and a
#: report that holds a single failure line never reach the certain bands either.
PARTIAL_CEILING = 0.6
SINGLE_LINE_CEILING = 0.7
#: A mechanism seen only in code (frames, a log line's source site) weighs this much of what
#: it weighs in upstream's own text; both together at most MECHANISM_BOTH of its weight.
CODE_SHARE = 1.0
MECHANISM_BOTH = 1.4
#: Outcome facts say *that* something failed, not *how*: they are not structure.
_NOT_STRUCTURAL = {Fact.HANG, Fact.CRASH, Fact.WRONG_OUTPUT, Fact.OOM_KILLED}


@dataclass(frozen=True)
class Witness:
    """A piece of evidence: what was seen, where, on which rank (-1: unknown)."""

    text: str
    file: str | None = None
    line: int | None = None
    rank: int = -1


class StackKind(StrEnum):
    """Why a stack is in the observation."""

    EXCEPTION = "exception"
    """A failing stack: an exception's, or a thread's that died of a fatal signal."""
    BLOCKED = "blocked"
    """A thread stuck in a collective."""


class EvidenceKind(StrEnum):
    """What sort of evidence a rule rests on (a StrEnum: the rule log prints the value)."""

    MESSAGE = "message"
    """An exception or generic log text."""
    CODE = "code"
    """Frames, upstream functions and files."""
    TEXT = "text"
    """Texts only the component prints."""
    STRUCTURE = "structure"
    """Facts across ranks and traces."""
    LEGACY = "legacy"
    """A legacy switch the run had on."""
    CONTEST = "contest"
    """Evidence against: a look-alike, or an upstream marker that points elsewhere."""


@dataclass
class ObservedException:
    type: str
    message: str
    in_app: list[str]
    """In-app function names of its stack, innermost first."""
    witness: Witness
    secondary: bool = False
    """It reports a peer's failure (a timeout, a lost connection), not this rank's own."""
    files: list[str] = field(default_factory=list)
    """The files of those frames, aligned with ``in_app``."""
    truncated: bool = False
    """Frames of a traceback cut before its exception line: where, but not what, failed."""


@dataclass
class MechanismHit:
    """A component that failed in a given way, as the upstream index reads the evidence."""

    role: str
    component: str
    kind: str
    """A :class:`signatures.index.failures.FailureKind` value."""
    strength: float
    """How sure the reading is (a template's similarity, lower for a caller's frame or a
    release that lacks the template)."""
    evidence: EvidenceKind
    """TEXT: a line or message matched to upstream's template; CODE: a frame or a source site
    in the component's code."""
    witness: Witness
    count: int = 1
    partial: bool = False
    """Read from partial evidence (a cut-off traceback's frames, a path alone)."""
    context: str = ""
    """What the component's failures need the input to show to count (``kv-cache``: a
    general-purpose store or file system that a KV cache may use, or may not)."""


@dataclass
class ObservedStack:
    kind: StackKind
    in_app: list[str]
    witness: Witness
    files: list[str] = field(default_factory=list)
    """The files of those frames, aligned with ``in_app``."""


@dataclass
class Observation:
    exceptions: list[ObservedException] = field(default_factory=list)
    stacks: list[ObservedStack] = field(default_factory=list)
    log_hits: dict[str, tuple[int, list[Witness]]] = field(default_factory=dict)
    facts: dict[Fact, list[Witness]] = field(default_factory=dict)
    legacy: dict[str, Witness] = field(default_factory=dict)
    functions: dict[str, Witness] = field(default_factory=dict)
    """Every function name on any stack (in-app or not, native included), first witness."""
    files: dict[str, Witness] = field(default_factory=dict)
    """Every frame file and log source location, first witness."""
    mechanisms: list[MechanismHit] = field(default_factory=list)
    single_line: bool = False
    """The inputs hold one failure statement and nothing else (no stack, no second line)."""
    names_matching: dict[tuple[MarkerKind, str, int], list[str]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    """Memo of :func:`marker_hits`: the function or file names a code marker's pattern finds
    (keyed by the table's size too, so a table that grew is searched again). Scoring asks
    the same few hundred patterns of one observation once per signature."""


@dataclass
class RuleResult:
    signature: str
    recogniser: str
    matched: bool
    weight: float
    structural: bool
    why: str
    witnesses: list[Witness] = field(default_factory=list)
    kind: EvidenceKind = EvidenceKind.MESSAGE
    partial: bool = False
    """It rests on partial evidence only (see :class:`MechanismHit`)."""
    said: str = ""
    """The recogniser in words, for reports (the ``recogniser`` label may be a regex, which
    the rule log shows and a "similar to" sentence should not)."""

    @property
    def plain(self) -> str:
        return self.said or self.recogniser

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
    single_line: bool = False
    """The observation it was scored on holds one failure statement and nothing else."""

    @property
    def named(self) -> bool:
        return self.structural and self.score >= self.signature.threshold - 1e-9

    @property
    def kinds(self) -> set[EvidenceKind]:
        """The kinds of evidence that speak for it."""
        return {r.kind for r in self.rules if r.matched and r.weight > 0}

    @property
    def lines(self) -> int:
        """Independent lines of evidence: its kinds, with two or more structural facts
        counting twice (two cross-rank findings are separate observations)."""
        structure = sum(1 for r in self.rules
                        if r.matched and r.weight > 0 and r.kind == EvidenceKind.STRUCTURE)
        return len(self.kinds) + (1 if structure >= 2 else 0)

    @property
    def contested(self) -> bool:
        return any(r.matched and r.kind == EvidenceKind.CONTEST for r in self.rules)

    @property
    def partial(self) -> bool:
        """Everything that speaks for it is partial evidence (a cut-off traceback's frames, a
        path alone)."""
        pos = [r for r in self.rules if r.matched and r.weight > 0]
        return bool(pos) and all(r.partial for r in pos)

    @property
    def confidence(self) -> float:
        """The score, calibrated: a verdict resting on one kind of evidence (a message and
        nothing else, or frames and nothing else) stays below ``ONE_KIND_CEILING``, one a
        look-alike contests below ``CONTESTED_CEILING``, one on partial evidence below
        ``PARTIAL_CEILING`` and one on a single line below ``SINGLE_LINE_CEILING``. Only
        independent kinds that agree reach the band where a verdict must almost never be
        wrong."""
        conf = self.score
        if self.lines <= 1:
            conf = min(conf, ONE_KIND_CEILING)
        if self.contested:
            conf = min(conf, CONTESTED_CEILING)
        if self.partial:
            conf = min(conf, PARTIAL_CEILING)
        if self.single_line:
            conf = min(conf, SINGLE_LINE_CEILING)
        return round(conf, 2)

    @property
    def matched(self) -> list[RuleResult]:
        return [r for r in self.rules if r.matched]

    def because(self) -> str:
        """Why it scored what it did, in one sentence (for near misses)."""
        pos = [r.plain for r in self.matched if r.weight > 0]
        neg = [r.plain for r in self.matched if r.weight < 0]
        missing = sorted((r for r in self.rules if not r.matched and r.weight > 0),
                         key=lambda r: -r.weight)[:2]
        parts = [("matched " + ", ".join(pos)) if pos else "nothing specific matched"]
        if neg:
            parts.append("but " + ", ".join(neg) + " point elsewhere")
        if not self.structural:
            parts.append("no structural evidence (a message alone never names a signature)")
        if missing:
            parts.append("missing " + "; ".join(r.plain for r in missing))
        return "; ".join(parts)


def score_all(catalog: Catalog, obs: Observation,
              causal: frozenset[Fact] = frozenset()) -> list[Score]:
    """Every signature's score, best first.

    Named signatures come first; among them, those resting on a ``causal`` fact (the earliest
    divergence between ranks) rank above those that only describe its consequences (a
    deadlock that a divergent eviction caused names the eviction first). Then score, amount
    of structure, catalog order.
    """
    looks = match_lookalikes(catalog, obs)
    scores = [score_one(sig, catalog, obs, looks) for sig in catalog.signatures]
    for sc in scores:
        sc.single_line = obs.single_line
    labels = {f"fact '{f.value}'" for f in causal}
    for s in scores:
        s.causal = any(r.matched and r.weight > 0 and r.recogniser in labels for r in s.rules)
    order = {s.id: i for i, s in enumerate(catalog.signatures)}
    return sorted(scores, key=lambda s: (-s.named, -(s.named and s.causal),
                                         -round(s.score, 6),
                                         -sum(r.structural for r in s.matched),
                                         order[s.signature.id]))


@dataclass
class LookalikeMatch:
    """A look-alike failure class that fits, with what it saw."""

    lookalike: Lookalike
    score: float
    witnesses: list[Witness]


def match_lookalikes(catalog: Catalog, obs: Observation) -> list[LookalikeMatch]:
    """The look-alikes whose markers and facts reach their threshold, best first."""
    out = []
    for look in catalog.lookalikes:
        total, wits = 0.0, []
        for i, marker in enumerate(look.markers):
            hits = marker_hits(f"{look.id}~{i}", marker, obs)
            if hits:
                total += marker.value
                wits += hits[:1]
        for fr in look.facts:
            fw = obs.facts.get(fr.fact, [])
            if fw:
                total += fr.weight
                wits += fw[:1] if fr.weight > 0 else []
        for mr in look.mechanisms:
            for r in _mechanism_rules(look.id, mr, obs):
                if r.matched:
                    total += r.weight
                    wits += r.witnesses[:1]
        if total >= look.threshold - 1e-9 and wits:
            out.append(LookalikeMatch(look, min(1.0, total), wits[:4]))
    return sorted(out, key=lambda m: -m.score)


def marker_hits(key: str, marker: Marker, obs: Observation,
                sig: Signature | None = None) -> list[Witness]:
    """Where ``marker`` shows in the observation (``key`` names its scanned log pattern).
    With ``sig``, a file marker says nothing for a file the component map puts elsewhere
    (:func:`elsewhere`)."""
    kind = marker.kind
    if kind in (MarkerKind.LOG, MarkerKind.ERROR):
        return obs.log_hits.get(key, (0, []))[1][:3]
    rx = _rx(marker.text)
    if kind is MarkerKind.EXCEPTION:
        return [e.witness for e in obs.exceptions if rx.search(f"{e.type}: {e.message}")][:3]
    table = obs.functions if kind is MarkerKind.FUNCTION else obs.files
    memo = (kind, marker.text, len(table))
    names = obs.names_matching.get(memo)
    if names is None:
        names = obs.names_matching[memo] = [name for name in table if rx.search(name)]
    hits: list[Witness] = []
    for name in names:
        if sig is not None and kind is MarkerKind.FILE and elsewhere(sig, name):
            continue
        w = table[name]
        hits.append(Witness(f"{name} ({w.text})", w.file, w.line, w.rank))
        if len(hits) == 3:
            break
    return hits


def elsewhere(sig: Signature, path: str) -> bool:
    """Whether the component map puts ``path`` in a component whose role none of ``sig``'s
    mechanisms names. A path pattern of the signature's (a frame rule ``@FILE``, an upstream
    file marker) then says nothing: LMCache's ``storage_backend/local_cpu_backend.py`` is the
    host memory pool, not a storage tier, whatever its folder's name says."""
    roles = {r for m in sig.recognisers.mechanisms for r in m.roles}
    if not roles or not path:
        return False
    # the map as the doctor's mechanisms read it (paths qualified against the index's files)
    comp = load_index().component(path)
    return comp is not None and comp.role not in roles and not comp.catch_all


def _rx(text: str) -> Any:
    """A catalog pattern, compiled for linear-time matching (cached by :func:`linear`)."""
    return linear(text)


def score_one(sig: Signature, catalog: Catalog, obs: Observation,
              looks: list[LookalikeMatch] | None = None) -> Score:
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
                                pattern.specific and lr.weight > 0, why, wits[:3] if ok else [],
                                kind=EvidenceKind.TEXT if pattern.specific
                                else EvidenceKind.MESSAGE))
    for fr in rec.facts:
        rules.append(_fact_rule(sig.id, fr, obs))
    for leg in rec.legacy:
        w = obs.legacy.get(leg.switch)
        rules.append(RuleResult(sig.id, f"legacy '{leg.switch}'", w is not None, leg.weight,
                                True, "the run had this legacy switch on" if w else "not on",
                                [w] if w else [], kind=EvidenceKind.LEGACY))
    if sig.upstream is not None:
        rules += _upstream_rules(sig, obs)
    for mr in rec.mechanisms:
        rules += _mechanism_rules(sig.id, mr, obs)
    for m in looks or []:
        # a look-alike of penalty 0 takes nothing away but still contests: the verdict stays
        # below the certain bands
        if m.lookalike.excludes_signature(sig.id) and m.lookalike.excludes:
            rules.append(RuleResult(
                sig.id, f"look-alike '{m.lookalike.id}'", True, -m.lookalike.penalty, False,
                f"{m.lookalike.title} fits ({m.score:.2f})", m.witnesses[:2],
                kind=EvidenceKind.CONTEST))
    total = sum(r.weight for r in rules if r.matched)
    structural = any(r.matched and r.structural and r.weight > 0 for r in rules)
    return Score(sig, max(0.0, min(1.0, total)), structural, rules)


def _mechanism_rules(owner: str, mr: MechanismRecogniser, obs: Observation) -> list[RuleResult]:
    """Two rules from one mechanism recogniser: its failures read in upstream's own text
    (lines and messages matched to the component's templates), and in code (frames and source
    sites in the component). Each weighs the recogniser's weight times the strongest reading
    (code a share of it), half when fewer than ``min_count`` failures were seen; together at
    most ``MECHANISM_BOTH`` times the weight."""
    hits = [h for h in obs.mechanisms if h.role in mr.roles and h.kind in mr.kinds]
    label = f"mechanism {'/'.join(mr.roles)} {'/'.join(mr.kinds)}"
    out = []
    room = mr.weight * MECHANISM_BOTH
    for kind, share, name in ((EvidenceKind.TEXT, 1.0, "upstream text"),
                              (EvidenceKind.CODE, CODE_SHARE, "code")):
        mine = sorted((h for h in hits if h.evidence == kind), key=lambda h: -h.strength)
        if not mine:
            out.append(RuleResult(owner, f"{label} ({name})", False, round(mr.weight * share, 4),
                                  True, f"no {'/'.join(mr.roles)} failure of these kinds in "
                                  f"{name}", kind=kind))
            continue
        count = sum(h.count for h in mine)
        weight = mr.weight * share * mine[0].strength * (1.0 if count >= mr.min_count else 0.5)
        weight = round(min(weight, room), 4)
        room -= weight
        comps = sorted({h.component for h in mine})
        kinds = ", ".join(sorted({h.kind for h in mine}))
        why = (f"{count} failure(s) of {', '.join(comps)} ({kinds})"
               + (f"; fewer than {mr.min_count}" if count < mr.min_count else ""))
        out.append(RuleResult(owner, f"{label} ({name})", True, weight, True, why,
                              [h.witness for h in mine[:3]], kind=kind,
                              partial=all(h.partial for h in mine)))
    return out


def _fact_rule(sig_id: str, fr: FactRecogniser, obs: Observation) -> RuleResult:
    wits = obs.facts.get(fr.fact, [])
    structural = fr.fact not in _NOT_STRUCTURAL and fr.weight > 0
    return RuleResult(sig_id, f"fact '{fr.fact.value}'", bool(wits), fr.weight, structural,
                      fr.fact.describe() if wits else "not observed", wits[:3],
                      kind=EvidenceKind.STRUCTURE if structural else EvidenceKind.MESSAGE)


_CODE_KINDS = (MarkerKind.FUNCTION, MarkerKind.FILE)


def _frame_rule(text: str) -> tuple[re.Pattern[str] | None, re.Pattern[str] | None]:
    """``FUNC_REGEX``, ``FUNC_REGEX@FILE_REGEX`` or ``@FILE_REGEX`` (any function in files
    matching FILE_REGEX)."""
    func, sep, file = text.partition("@")
    return (_rx(func) if func else None), (_rx(file) if sep and file else None)


def _upstream_rules(sig: Signature, obs: Observation) -> list[RuleResult]:
    """Two rules from the upstream markers for it (code: functions and files; texts: logs,
    error codes, exceptions). Every distinct marker seen adds its weight: each is a separate
    confirmation from upstream's own code. Together they add at most the entry's cap. One rule
    against, from the heaviest marker that points elsewhere."""
    up = sig.upstream
    assert up is not None  # only called for signatures with upstream knowledge
    source = "; ".join(up.read_from)
    found: dict[bool, tuple[float, list[Witness]]] = {True: (0.0, []), False: (0.0, [])}
    for i, m in enumerate(up.evidence_for):
        hits = marker_hits(f"{sig.id}+{i}", m, obs, sig)
        if hits:
            code = m.kind in _CODE_KINDS
            weight, wits = found[code]
            found[code] = (weight + m.value, wits + [Witness(
                f"{h.text} — upstream {m.kind.value} from {m.where}", h.file, h.line, h.rank)
                for h in hits[:1]])
    rules = []
    room = up.cap
    for code in (True, False):
        weight, wits = found[code]
        weight = round(min(weight, room), 4)
        room -= weight
        label = "upstream code" if code else "upstream texts"
        rules.append(RuleResult(sig.id, label, weight > 0, weight, True,
                                f"{len(wits)} marker(s) from {source}" if wits
                                else f"none of its {label} seen ({source})", wits[:3],
                                kind=EvidenceKind.CODE if code else EvidenceKind.TEXT))
    against: tuple[float, list[Witness]] = (0.0, [])
    for i, m in enumerate(up.evidence_against):
        hits = marker_hits(f"{sig.id}-{i}", m, obs)
        if hits and m.value > against[0]:
            against = (m.value, [Witness(f"{h.text} — points elsewhere: {m.note or m.where}",
                                         h.file, h.line, h.rank) for h in hits[:1]])
    if against[1]:
        rules.append(RuleResult(sig.id, "upstream: points elsewhere", True, -against[0], False,
                                against[1][0].text, against[1], kind=EvidenceKind.CONTEST))
    return rules


def _exception_rule(sig_id: str, type_rx: str, msg_rx: str, weight: float, obs: Observation,
                    matched: list[ObservedException]) -> RuleResult:
    t, m = linear(type_rx), linear(msg_rx)
    hits = [e for e in obs.exceptions
            if (t.fullmatch(e.type) or t.fullmatch(e.type.rsplit(".", 1)[-1]))
            and m.search(e.message)]
    matched.extend(hits)
    label = f"exception {type_rx} /{msg_rx}/"
    why = f"{len(hits)} exception(s) match" if hits else "no such exception"
    return RuleResult(sig_id, label, bool(hits), weight, False, why,
                      [e.witness for e in hits[:3]], kind=EvidenceKind.MESSAGE,
                      said=_exception_in_words(type_rx, msg_rx, hits))


def _exception_in_words(type_rx: str, msg_rx: str, hits: list[ObservedException]) -> str:
    """An exception recogniser as a reader says it: the exception that matched, else its
    class names and, when the template is plain text, its message."""
    if hits:
        return f"the exception {hits[0].type.rsplit('.', 1)[-1]}"
    names = list(dict.fromkeys(re.findall(r"[A-Z][A-Za-z0-9_]+", type_rx)))
    kind = " or ".join(names[:3]) + (" (or kin)" if len(names) > 3 else "") if names \
        else "an exception"
    literal = msg_rx if re.fullmatch(r"[\w ,:'-]+", msg_rx) else ""
    return f"an exception {kind}" + (f" saying '{literal}'" if literal else "")


def _frames_rule(sig: Signature, obs: Observation,
                 matched_exc: list[ObservedException]) -> RuleResult:
    fr = sig.recognisers.frames
    assert fr is not None  # only called when the signature has a frame recogniser
    rules = [_frame_rule(x) for x in fr.any]
    candidates: list[tuple[list[str], list[str], Witness, bool]] = []
    if fr.where in ("exception", "any"):
        excs = matched_exc or [e for e in obs.exceptions if not e.secondary]
        candidates += [(e.in_app, e.files, e.witness, e.truncated) for e in excs]
    if fr.where in ("blocked", "any"):
        candidates += [(s.in_app, s.files, s.witness, False) for s in obs.stacks
                       if s.kind == StackKind.BLOCKED]
    if fr.where == "any":
        candidates += [(s.in_app, s.files, s.witness, False) for s in obs.stacks
                       if s.kind == StackKind.EXCEPTION]
    # a whole stack before a cut-off one: the cut-off one only says where, not what
    candidates.sort(key=lambda c: c[3])
    for funcs, files, wit, cut in candidates:
        files = files + [""] * (len(funcs) - len(files))
        pairs = list(zip(funcs, files))
        for func, file in pairs[:fr.innermost] if fr.innermost else pairs:
            if any((f is None or f.search(func))
                   and (p is None or (p.search(file) and not elsewhere(sig, file)))
                   for f, p in rules):
                name = f"{func} ({file.rsplit('/', 1)[-1]})" if file else func
                w = Witness(f"{name} on the {fr.where if fr.where != 'any' else 'failing'} "
                            f"stack: {wit.text}", wit.file, wit.line, wit.rank)
                return RuleResult(sig.id, f"in-app frame ({fr.where})", True, fr.weight, True,
                                  f"{name} is on the stack"
                                  + (" (a traceback cut before its exception line)" if cut
                                     else ""), [w], kind=EvidenceKind.CODE, partial=cut)
    return RuleResult(sig.id, f"in-app frame ({fr.where})", False, fr.weight, True,
                      "none of " + ", ".join(x.strip("^$()|.\\") for x in fr.any[:4])
                      + (" ..." if len(fr.any) > 4 else "") + " on a relevant stack",
                      kind=EvidenceKind.CODE)
