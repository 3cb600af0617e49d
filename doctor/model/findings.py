"""What the doctor's stages find across ranks, as typed records every later stage reads.

The rank table's rows and conditions, blocked call sites, collective and point-to-point
disagreements, and the first divergent decision are made by ``doctor.ranks``, weighed by
``doctor.facts`` and printed by ``doctor.report``; they live here, below all three, so that no
stage imports a later one for its types. The diagnosis (``doctor.report.model``) embeds them
as they are: their JSON is part of its schema.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

# StrEnums, as in doctor.model.evidence: the JSON and every text report carry the plain value.


class RankCondition(StrEnum):
    """How a rank stands in the rank table: the state of the thread that matters, or what
    its exit, its absence or an exception without a stack says."""

    CRASHED = "crashed"
    """A thread died of a fatal signal, or the rank raised an exception of its own."""
    BLOCKED = "blocked"
    """A thread is inside a collective."""
    IDLE = "idle"
    """Its main thread waits for work."""
    ACTIVE = "active"
    """Its main thread runs."""
    FAILED = "failed"
    """It raised a communication error (a peer's failure, as this rank saw it)."""
    EXITED = "exited"
    """Its process ended with a non-zero code and no stack says more."""
    FINISHED = "finished"
    """Its process returned normally."""
    MISSING = "missing"
    """The job has it, but no input covers it."""
    UNKNOWN = "unknown"
    """Inputs name it, but none says what it was doing."""


class FindingKind(StrEnum):
    """A cross-rank disagreement of collectives (:mod:`doctor.ranks.collectives`) or of
    point-to-point pairs (:mod:`doctor.ranks.p2p`); those modules say what each means."""

    MISSING_RANKS = "missing-ranks"
    OP_MISMATCH = "op-mismatch"
    SITE_MISMATCH = "site-mismatch"
    SIZE_MISMATCH = "size-mismatch"
    SEQ_BEHIND = "seq-behind"
    CROSSED = "crossed"
    UNRECEIVED_SEND = "unreceived-send"
    UNMATCHED_RECV = "unmatched-recv"


class EvidenceItem(BaseModel):
    """One cited piece of evidence: what, where (input file and line), which rank."""

    text: str
    file: str | None = None
    line: int | None = None
    rank: int | None = None
    rule: str = Field("", description="the recogniser it supports")


class RankRow(BaseModel):
    """One line of the per-rank table."""

    rank: int
    role: str
    state: RankCondition
    thread: str | None = None
    frame: str | None = None
    """Innermost in-app frame of the failing or blocked thread (``func (file:line)``)."""
    site: str | None = None
    """For a thread inside a collective: the in-app call site that entered it."""
    error: str | None = None
    last_seq: dict[str, str] = {}
    sources: list[str] = []


class BlockedSite(BaseModel):
    """Ranks whose thread of one role is blocked at the same collective call site."""

    role: str
    site: str
    op: str
    ranks: list[int]
    evidence: list[EvidenceItem] = []


class CollectiveFinding(BaseModel):
    """A cross-rank disagreement of the flight recorders (or watchdog sequence numbers)."""

    group: str
    seq: int
    kind: FindingKind
    detail: str
    ranks: list[int]
    evidence: list[EvidenceItem] = []
    peer: int | None = None
    """A point-to-point finding's other end: the receiver a send never reached, the sender a
    receive waits for."""
    func: str | None = Field(None, exclude=True)
    """missing-ranks: the function that called the collective the ranks ahead entered (read
    by the facts; not part of the report, whose ``detail`` names the call site)."""


class Divergence(BaseModel):
    """The first decision on which ranks that must agree did not."""

    kind: str
    key: str
    index: int
    steps: dict[int, int]
    values: dict[int, str]
    ranks: list[int]
    evidence: list[EvidenceItem] = []

    @property
    def label(self) -> str:
        """``kind key`` (``sched.batch`` has no key)."""
        return f"{self.kind} {self.key}" if self.key else self.kind
