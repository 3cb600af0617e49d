"""The diagnosis: the doctor's one output, a versioned pydantic model.

``hicache doctor --json`` prints :class:`Diagnosis` with ``model_dump_json``; the rich report,
the Markdown report and incident runbooks are all drawn from it and nothing else. The schema is
stable within a major ``schema_version``: fields are only added. The top verdict is
``verdicts[0]`` (``signature``, ``confidence``, ``evidence`` with input file and line).

Exit codes (``Diagnosis.exit_code``): 0 a known signature was named; 1 the inputs were read but
no known signature fits (an empty file or directory included: nothing in it is a failure); 2 bad
usage or no readable input (every input missing or unreadable).

Every text is at most ``bounds.MAX_TEXT`` characters (cut with a marker) and rank lists are
bounded (:mod:`doctor.report.bounds`): the report is drawn from untrusted inputs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from doctor.model.evidence import InputStatus
from doctor.model.findings import (
    BlockedSite,
    CollectiveFinding,
    Divergence,
    EvidenceItem,
    RankRow,
)

DIAGNOSIS_SCHEMA_VERSION = "1.6"
DIAGNOSIS_KIND = "hicache-diagnosis"
EXIT_DIAGNOSED, EXIT_NO_SIGNATURE, EXIT_UNREADABLE = 0, 1, 2


# StrEnums, as in doctor.model.evidence: the JSON and every text report carry the plain value.


class DiagnosisStatus(StrEnum):
    """The diagnosis as a whole; each goes with its exit code."""

    DIAGNOSED = "diagnosed"
    """A known signature was named (exit 0)."""
    NO_KNOWN_SIGNATURE = "no-known-signature"
    """The inputs were read, but no known signature fits (exit 1)."""
    UNREADABLE = "unreadable"
    """No input could be read (exit 2)."""


class Mitigation(BaseModel):
    text: str
    flags: list[str] = []
    env: list[str] = []


class Verdict(BaseModel):
    """A named signature with its confidence and the evidence that supports it."""

    signature: str
    title: str
    severity: str
    confidence: float = Field(ge=0, le=1)
    evidence: list[EvidenceItem]
    root_cause: str
    upstream_fix: list[str]
    mitigations: list[Mitigation]
    campaign_cell: str | None = None
    runbook: str = Field(description="the command that prints this signature's runbook")
    release_note: str = ""
    """Why the confidence was lowered for the release the input states (added in 1.5)."""
    tie_note: str = ""
    """Why the confidence was capped: another signature fits as well (added in 1.11)."""


class NearMiss(BaseModel):
    signature: str
    score: float
    because: str


class Fingerprint(BaseModel):
    """What the failure is, with everything that varies between occurrences taken out (ranks,
    paths, line numbers, numbers, ids); ``id`` hashes it. Equal ids: the same failure."""

    id: str
    exception: str | None = None
    functions: list[str] = []
    blocked: list[str] = []
    logs: list[str] = []
    facts: list[str] = []
    lookalikes: list[str] = []
    upstream: list[str] = []
    """The upstream messages the failure lines were printed from (``system file function:
    template``): the same message whatever numbers a line carried; added in 1.3."""


class LookalikeFinding(BaseModel):
    """A failure class outside the catalog that fits what the inputs show (``lookalikes.yaml``):
    what the doctor *does* see when no signature fits, or what competes with one that does."""

    id: str
    title: str
    score: float
    meaning: str
    advice: str
    evidence: list[EvidenceItem] = []


class TimelineSpan(BaseModel):
    """A stretch of one rank's run: a collective from entry to exit (``end_ms`` None: the rank
    was still inside it when its evidence ends), or the window a fault acted in."""

    kind: str
    start_ms: float
    end_ms: float | None = None
    label: str
    state: str = ""
    """How a collective ended (``completed``, ``failed``, ``timeout``; empty: never did)."""


class TimelineMark(BaseModel):
    """A moment on one rank: a fault fired, a step began, a transfer, an abort, a check."""

    kind: str
    at_ms: float
    label: str


class TimelineLane(BaseModel):
    """One rank's traced run: its spans and marks, where its evidence ends (``end_ms``) and
    in what state it stopped, and when it took the first divergent decision."""

    rank: int
    role: str = ""
    state: str = ""
    end_ms: float
    spans: list[TimelineSpan] = []
    marks: list[TimelineMark] = []
    divergence_ms: float | None = None


class Timeline(BaseModel):
    """The ranks' traced events on one clock: milliseconds since the earliest event of any
    rank, on the runtime's monotonic clock (shared by the ranks of one machine). Added in
    1.4; what the incident page draws."""

    end_ms: float
    lanes: list[TimelineLane]
    divergence: str = ""
    """The first divergent decision's label, when there is one."""


class MissingItem(BaseModel):
    rank: int | None
    what: str
    command: str


class InputSummary(BaseModel):
    path: str
    kind: str
    status: InputStatus
    message: str = ""
    rank: int | None = None


class Diagnosis(BaseModel):
    """Everything ``hicache doctor`` concluded, in one stable, versioned record."""

    schema_version: str = DIAGNOSIS_SCHEMA_VERSION
    kind: str = DIAGNOSIS_KIND
    catalog_version: str
    status: DiagnosisStatus
    exit_code: int
    summary: str
    verdicts: list[Verdict] = []
    near_misses: list[NearMiss] = []
    lookalikes: list[LookalikeFinding] = []
    fingerprint: Fingerprint | None = None
    observations: list[str] = []
    ranks: list[RankRow] = []
    blocked_sites: list[BlockedSite] = []
    collectives: list[CollectiveFinding] = []
    first_divergence: Divergence | None = None
    timeline: Timeline | None = None
    """The ranks' traced runs on one clock (bundles with traces; added in 1.4)."""
    missing: list[MissingItem] = []
    missing_ranks: list[int] = []
    """The first ``MAX_LISTED_RANKS`` missing ranks (all of them: ``missing_rank_count``)."""
    missing_rank_count: int = 0
    missing_rank_ranges: str = ""
    """The missing ranks as ranges (``0-3, 7``); added in 1.2."""
    topology: dict[str, Any] = {}
    inputs: list[InputSummary] = []
    problems: list[str] = []
    rule_log: list[str] = []


INCIDENTS_KIND = "hicache-incidents"


class Incident(BaseModel):
    """One incident among several: its bundle (``None`` for the loose inputs), when the bundle
    was written, and its own diagnosis."""

    bundle: str | None = None
    created_at: str = ""
    diagnosis: Diagnosis


class Incidents(BaseModel):
    """What ``hicache doctor`` reports for inputs that hold several bundles: one diagnosis per
    incident, newest first (added in 1.3). Exit code: 0 when any incident was diagnosed, else 1,
    2 when nothing could be read at all."""

    schema_version: str = DIAGNOSIS_SCHEMA_VERSION
    kind: str = INCIDENTS_KIND
    incidents: list[Incident]

    @property
    def exit_code(self) -> int:
        codes = {i.diagnosis.exit_code for i in self.incidents}
        if EXIT_DIAGNOSED in codes:
            return EXIT_DIAGNOSED
        return EXIT_NO_SIGNATURE if EXIT_NO_SIGNATURE in codes else EXIT_UNREADABLE
