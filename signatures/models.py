"""Pydantic models of the signature catalog (the YAML files under ``signatures/catalog/``).

A catalog has a version; each signature has a stable id, its meaning, its recognisers (what the
doctor must see), its root cause, fix, mitigations, the campaign cell that reproduces it and its
runbook text. Log patterns and frame rules are shared by all signatures and live beside them.

Recogniser weights add up to a score in [0, 1]. Which recognisers are *structural* (frames,
facts, a bundle's legacy switch, a log pattern marked ``specific``) matters: a signature is never
named on a message alone.
"""

from __future__ import annotations

import re
from enum import Enum

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hicache_runtime.contracts.legacy import REGISTRY, LegacySwitch, parse_cell_id
from signatures.fact_names import Fact
from signatures.linear import UnsafePattern, linear


def cell_not_a_release(cell: str) -> dict[str, str]:
    """The legacy switches of a campaign cell (``<topology>/<switches>/<faults>``) that no
    release ran as this runtime does, each with its fidelity and why (``contracts/legacy.py``):
    the cell is then a reproduction of the hazard, not evidence about a release."""
    parts = parse_cell_id(cell)
    out: dict[str, str] = {}
    for name in parts.switches if parts is not None else ():
        try:
            entry = REGISTRY[LegacySwitch(name)]
        except ValueError:
            continue
        if not entry.in_profiles:
            out[entry.switch.value] = f"{entry.fidelity.value}: {entry.fidelity_note}"
    return out


class Severity(str, Enum):
    """How bad the failure is for a serving deployment."""

    CRITICAL = "critical"
    """The server dies or hangs; every request fails until it is restarted."""
    HIGH = "high"
    """Silent wrong output, or a failure that will kill the server within hours."""
    MEDIUM = "medium"
    """Degraded service (cache disabled, lower hit rate, slow) without data loss."""
    LOW = "low"
    """A symptom worth knowing about; no user impact on its own."""


class FailureKind(str, Enum):
    """The production shape the signature shows."""

    CRASH = "crash"
    HANG = "hang"
    WRONG_OUTPUT = "wrong-output"
    LEAK = "leak"
    DEGRADATION = "degradation"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_regex(value: str) -> str:
    """``value`` if it compiles for linear-time matching (:func:`signatures.linear.linear`);
    ``ValueError`` naming it otherwise (a catalog pattern runs on untrusted text)."""
    try:
        linear(value)
    except UnsafePattern as exc:
        raise ValueError(f"bad regex: {exc}") from None
    return value


class ExceptionRecogniser(_Strict):
    """An exception type (regex on the class name, dotted or short) and a message template."""

    type: str = Field(description="regex, full match on the short or dotted class name")
    message: str = Field(".*", description="regex searched in the exception message")
    weight: float = Field(ge=0, le=1)

    @field_validator("type", "message")
    @classmethod
    def _regex(cls, v: str) -> str:
        return check_regex(v)


class FrameRecogniser(_Strict):
    """In-app functions that must be on the failing (``exception``) or blocked (``blocked``)
    stack. Each entry is a regex searched in the frame's function name (py-spy qualifies it
    with the class: ``HiCache._writing_check``), ``FUNC@FILE`` (both must match), or
    ``@FILE`` (any function in such a file: the storage backends' modules)."""

    any: list[str] = Field(min_length=1)
    where: str = Field("any", pattern="^(exception|blocked|any)$")
    weight: float = Field(ge=0, le=1)
    innermost: int | None = Field(None, ge=1, description=(
        "only the innermost N in-app frames count: the function that raised, not one of its "
        "callers (a crash inside dec_lock_ref called from writing_check is not the drain's)"))

    @field_validator("any")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for x in v:
            func, _, file = x.partition("@")
            check_regex(func)
            check_regex(file)
            for part in (func, file):
                # A part that matches the empty name matches every frame: a '@' meant as a
                # character split the pattern there (escape it as \x40)
                if part and re.search(part, "") is not None:
                    raise ValueError(f"frame pattern {x!r}: {part!r} matches every name")
        return v


class LogRecogniser(_Strict):
    """A shared log pattern (by id, see ``patterns.yaml``) seen in the inputs."""

    pattern: str
    weight: float = Field(ge=-1, le=1)
    min_count: int = Field(1, ge=1, description="how many hits are needed")


MECHANISM_ROLES = ("storage", "transfer", "pd", "host-pool", "tree", "pool", "controller",
                   "comm", "scheduler", "model", "startup")
MECHANISM_KINDS = ("shape", "capacity", "index", "invariant", "bookkeeping", "timeout",
                   "config", "io", "crash", "unknown")


class MechanismRecogniser(_Strict):
    """A mechanism: a component (by its role in the component map) that failed in a given way
    (the failure kind its upstream message states). Fed by the upstream index: a report's line
    matched to the template that printed it, an exception raised in that component's code, a
    fatal signal on its stack. ``unknown``: a failure whose kind the evidence does not show (a
    traceback cut before its exception line)."""

    roles: list[str] = Field(min_length=1)
    kinds: list[str] = Field(min_length=1)
    weight: float = Field(gt=0, le=1)
    min_count: int = Field(1, ge=1, description=(
        "failures of the mechanism needed for the full weight (lines of one template count "
        "each time they were printed); fewer give half"))

    @field_validator("roles", "kinds")
    @classmethod
    def _known(cls, v: list[str], info: ValidationInfo) -> list[str]:
        known = MECHANISM_ROLES if info.field_name == "roles" else MECHANISM_KINDS
        bad = set(v) - set(known)
        if bad:
            raise ValueError(f"unknown {info.field_name} {sorted(bad)} (known: "
                             f"{', '.join(known)})")
        return v


class FactRecogniser(_Strict):
    """A structural fact the doctor derived. Negative weights mark facts that point elsewhere."""

    fact: Fact
    weight: float = Field(ge=-1, le=1)


class LegacyRecogniser(_Strict):
    """A crash bundle written by a run with this legacy switch on."""

    switch: str
    weight: float = Field(ge=0, le=1)


class MarkerKind(str, Enum):
    """Where a marker is looked for in the evidence."""

    FUNCTION = "function"
    """A frame's function name, on any stack the inputs hold (native frames included)."""
    FILE = "file"
    """A frame's file path, or the source location a log line names (``[engine.py:135]``,
    glog's ``client.cpp:406]``, LMCache's ``(file.py:360:module)``)."""
    LOG = "log"
    """A log text: ``text`` is a regex searched in every line holding ``trigger``."""
    ERROR = "error"
    """An error code or status name the component prints (``RPC_FAIL``): a whole word."""
    EXCEPTION = "exception"
    """An exception: ``text`` is a regex searched in ``Type: message``."""


#: What a marker of each kind is worth when its entry gives no weight.
MARKER_WEIGHTS = {MarkerKind.FUNCTION: 0.3, MarkerKind.FILE: 0.2, MarkerKind.LOG: 0.35,
                  MarkerKind.ERROR: 0.3, MarkerKind.EXCEPTION: 0.35}
_REGEX_META = set("^$*+?{}[]\\|()")


class Marker(_Strict):
    """One piece of upstream knowledge: a function, file, log text, error code or exception
    that a component really has, and where it was read (``sglang 0.5.23
    srt/mem_cache/hicache_storage.py``), so that a reader can check it against that version."""

    kind: MarkerKind
    text: str = Field(min_length=2)
    trigger: str | None = Field(None, description="log/error: a literal every match holds")
    where: str = Field(min_length=3, description="component, version and file it was read from")
    note: str = ""
    weight: float | None = Field(None, gt=0, le=1)

    @field_validator("text")
    @classmethod
    def _regex(cls, v: str) -> str:
        return check_regex(v)

    @model_validator(mode="after")
    def _trigger(self) -> Marker:
        if self.kind in (MarkerKind.LOG, MarkerKind.ERROR) and self.trigger is None \
                and _REGEX_META & set(self.text):
            raise ValueError(f"{self.kind.value} marker {self.text!r} is a regex: give the "
                             "literal `trigger` every matching line holds")
        if self.trigger is not None and len(self.trigger) < 2:
            raise ValueError("a trigger needs at least two characters")
        return self

    @property
    def value(self) -> float:
        return self.weight if self.weight is not None else MARKER_WEIGHTS[self.kind]

    @property
    def literal(self) -> str:
        """The literal the scanner's prefilter looks for (log and error markers)."""
        return self.trigger if self.trigger is not None else self.text

    @property
    def regex(self) -> str:
        """The regex a line is matched with (error codes match as whole words; written without
        lookaround, which linear-time matching does not have)."""
        if self.kind is MarkerKind.ERROR:
            return rf"(?:^|\W){self.text}(?:\W|$)"
        return self.text


class Upstream(_Strict):
    """What upstream's code says about a signature: the functions, files, log texts, error
    codes and exceptions that are evidence for it, and those that point elsewhere."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    read_from: list[str] = Field(min_length=1, description="the upstream versions read")
    evidence_for: list[Marker] = Field(alias="for", min_length=1)
    evidence_against: list[Marker] = Field([], alias="against")
    cap: float = Field(0.45, gt=0, le=1, description="the most the markers for it add")


class Recognisers(_Strict):
    exceptions: list[ExceptionRecogniser] = []
    frames: FrameRecogniser | None = None
    logs: list[LogRecogniser] = []
    facts: list[FactRecogniser] = []
    legacy: list[LegacyRecogniser] = []
    mechanisms: list[MechanismRecogniser] = []
    stack_shape: str = Field("", description="the cross-rank stack shape, in words")
    trace_evidence: str = Field("", description="what the event trace shows, in words")


class Fix(_Strict):
    ref: str = Field(description="upstream PR or issue, e.g. sgl-project/sglang#26923")
    summary: str


class Mitigation(_Strict):
    """What an operator can do now. ``flags`` are what to type (server flags or whole
    commands: runbooks print them as a shell block), ``env`` environment variables; an
    instruction ("start without --x") belongs in ``text``."""

    text: str
    flags: list[str] = []
    env: list[str] = []

    @field_validator("flags")
    @classmethod
    def _typeable(cls, v: list[str]) -> list[str]:
        for flag in v:
            if re.match(r"(drop|remove|without|GET|POST|PUT|DELETE|PATCH)\b", flag):
                raise ValueError(f"{flag!r} is not something to type: say it in text, or give "
                                 "the command (curl -X ... for an HTTP endpoint)")
        return v


class CampaignCell(_Strict):
    """The cell of the built-in campaign (``faults/campaigns/default.yaml``) that reproduces the
    signature: ``<topology>/<legacy-switch|fixed>/<fault-spec|none>``. Its config lives in the
    campaign; its fixed twin (the same id with ``fixed``) verifies the fix."""

    cell: str
    expect: str = Field(description="the signature id the cell shows, or 'healthy'")
    note: str = ""

    @field_validator("cell")
    @classmethod
    def _shape(cls, v: str) -> str:
        if parse_cell_id(v) is None:
            raise ValueError(f"campaign cell {v!r} is not <topology>/<switches>/<faults>")
        return v

    @property
    def parts(self) -> tuple[str, str, str]:
        """(topology, mode, faults): the mode is the switches joined by ``+``, or ``fixed``."""
        cell = parse_cell_id(self.cell)
        assert cell is not None  # validated at construction
        return cell.topology, cell.mode, cell.faults

    @property
    def fixed_twin(self) -> str:
        cell = parse_cell_id(self.cell)
        assert cell is not None
        return str(cell.fixed_twin())

    @property
    def not_a_release(self) -> dict[str, str]:
        """:func:`cell_not_a_release` of this cell."""
        return cell_not_a_release(self.cell)

    def run_command(self, fixed: bool = False) -> str:
        """The command that runs this cell (``fixed``: its twin without the legacy switch)."""
        return f"hicache campaign --only '{self.fixed_twin if fixed else self.cell}'"


class Affected(_Strict):
    """Which release profiles a release matrix (``hicache campaign --profiles``) saw a signature
    on: verified data, generated into ``catalog/affected.yaml`` from a matrix run
    (``hicache signatures affected``), never written by hand. A profile is this
    runtime's rendering of a release's protocols, not the release."""

    campaign: str
    command: str
    run_at: str
    profiles: list[str] = Field(min_length=1, description="every profile the matrix ran")
    reproduces: list[str] = []
    """Profiles on which some cell of the matrix ended with the doctor naming it."""
    row: str | None = None
    """The matrix row of the signature's own campaign cell (its fault and topology)."""
    clean: list[str] = []
    """Profiles on which that row ran clean (healthy, outputs identical): the fault that
    exposes the signature does not expose it there."""
    cells: list[str] = []
    """``<profile>/<cell id>`` of every run that reproduced it."""

    def no_longer_from(self, order: list[str]) -> str | None:
        """The first profile of ``order`` (releases, oldest first) on which the signature's row
        runs clean after a release on which it reproduced; None when there is none."""
        seen = False
        for name in order:
            if name in self.reproduces:
                seen = True
            elif seen and name in self.clean:
                return name
        return None


class RunbookText(_Strict):
    confirm: list[str] = Field(min_length=1, description="how to confirm it is this signature")
    diagnosis_path: list[str] = Field(min_length=1, description="from the error back to the cause")
    escalation: str


class Signature(_Strict):
    """One known failure. ``id`` is stable forever; everything else may be improved."""

    id: str = Field(pattern=r"^[a-z][a-z0-9-]+$")
    title: str
    severity: Severity
    kind: FailureKind
    meaning: str
    recognisers: Recognisers
    threshold: float = Field(0.6, gt=0, le=1, description="score at which it is named")
    root_cause: str
    upstream_fix: list[Fix] = Field(min_length=1)
    mitigations: list[Mitigation] = Field(min_length=1)
    campaign: CampaignCell | None = None
    runbook: RunbookText
    related: list[str] = []
    upstream: Upstream | None = None
    affected: Affected | None = None
    """Filled by the loader from ``catalog/affected.yaml``; not written in a signature file."""


class LogPattern(_Strict):
    """A named log pattern. ``triggers`` are literal substrings, one of which must occur in the
    line before ``regex`` runs (the scanner's cheap prefilter). ``specific`` patterns are
    texts only HiCache/SGLang emits, so a hit counts as structure; generic ones (``pop from empty
    list``, ``Connection closed by peer``) never name a signature on their own."""

    id: str
    triggers: list[str] = Field(min_length=1)
    regex: str
    specific: bool = False
    meaning: str
    examples: list[str] = Field(min_length=1, description="real-shaped lines it must match")

    @field_validator("regex")
    @classmethod
    def _regex(cls, v: str) -> str:
        return check_regex(v)


class FrameRules(_Strict):
    """Which frames are in-app (Sentry-style ``+app``/``-app`` path rules, first match wins),
    which functions are collective primitives, and which only wrap one."""

    in_app: list[str] = Field(min_length=1, description="'+app REGEX' or '-app REGEX'")
    collective: list[str] = Field(min_length=1)
    comm_wrappers: list[str] = []
    idle_waits: list[str] = []

    @field_validator("in_app")
    @classmethod
    def _rules(cls, v: list[str]) -> list[str]:
        for rule in v:
            action, _, rx = rule.partition(" ")
            if action not in ("+app", "-app"):
                raise ValueError(f"frame rule {rule!r} must start with +app or -app")
            check_regex(rx)
        return v


class Lookalike(_Strict):
    """A failure class that is *not* a known signature but looks like one (a PD transfer
    error naming Mooncake, a collective timeout after a slow weight load, a GPU OOM): when it
    fits, the report says what it sees, and the signatures it ``excludes`` lose ``penalty``."""

    id: str = Field(pattern=r"^[a-z][a-z0-9-]+$")
    title: str
    meaning: str
    advice: str
    markers: list[Marker] = []
    facts: list[FactRecogniser] = []
    mechanisms: list[MechanismRecogniser] = []
    threshold: float = Field(0.5, gt=0, le=1)
    excludes: list[str] = Field(["*"], description="signature ids it explains away, or '*'")
    penalty: float = Field(0.4, ge=0, le=1)

    def excludes_signature(self, sig_id: str) -> bool:
        return "*" in self.excludes or sig_id in self.excludes


class Catalog(_Strict):
    """The whole catalog: version, shared patterns and rules, every signature, and the
    look-alike failure classes that are not signatures."""

    version: str = Field(pattern=r"^\d+\.\d+\.\d+$")
    frames: FrameRules
    patterns: list[LogPattern]
    signatures: list[Signature]
    lookalikes: list[Lookalike] = []

    def get(self, sig_id: str) -> Signature:
        """The signature ``sig_id``; ``KeyError`` naming the known ids otherwise."""
        for sig in self.signatures:
            if sig.id == sig_id:
                return sig
        raise KeyError(f"unknown signature {sig_id!r}; known: "
                       + ", ".join(s.id for s in self.signatures))

    def pattern(self, pattern_id: str) -> LogPattern:
        for pat in self.patterns:
            if pat.id == pattern_id:
                return pat
        raise KeyError(f"unknown log pattern {pattern_id!r}")

    def markers(self) -> list[tuple[str, Marker]]:
        """Every marker with its key (``owner#index``): signatures' upstream evidence, both
        ways, and look-alikes'."""
        out: list[tuple[str, Marker]] = []
        for sig in self.signatures:
            if sig.upstream is not None:
                out += [(f"{sig.id}+{i}", m) for i, m in enumerate(sig.upstream.evidence_for)]
                out += [(f"{sig.id}-{i}", m)
                        for i, m in enumerate(sig.upstream.evidence_against)]
        for look in self.lookalikes:
            out += [(f"{look.id}~{i}", m) for i, m in enumerate(look.markers)]
        return out

    def scanned_patterns(self) -> list[LogPattern]:
        """The log patterns the scanner runs: the shared ones, plus one per log or error
        marker (its id is the marker's key)."""
        extra = [LogPattern(id=key, triggers=[m.literal], regex=m.regex, specific=True,
                            meaning=m.note or f"{m.kind.value} marker from {m.where}",
                            examples=[m.literal])
                 for key, m in self.markers() if m.kind in (MarkerKind.LOG, MarkerKind.ERROR)]
        return list(self.patterns) + extra
