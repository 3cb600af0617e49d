"""The typed evidence model: what the inputs say, normalised per rank and thread.

Every parser turns its artifact into these records and hands them to an
:class:`~doctor.model.builder.EvidenceBuilder`; the analysis never looks at raw text again.
Stacks are always stored innermost frame first, whatever order the artifact printed them in.
Every record
carries a :class:`SourceRef` (input file and line) so the report can cite it.

Collections that grow with input size are bounded (``Bounded``: the first and the last items are
kept, plus a count), so memory stays flat on multi-GB inputs.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Caps per rank. Beyond them only counts grow.
MAX_EXCEPTIONS = 32
MAX_THREADS = 256
MAX_HITS_KEPT = 4
MAX_COLLECTIVES_PER_GROUP = 4096
MAX_DECISIONS_PER_KEY = 20000
MAX_EVENTS = 20000
MAX_TIMELINE = 4000
"""Timed trace events kept per rank for the incident page (the first and the last halves)."""
MAX_SAMPLES = 512
MAX_ARRIVALS = 200_000
MAX_SITES = 256
MAX_ERROR_LINES = 8
MAX_EXITS = 64
MAX_FAILURE_LINES = 256
"""Distinct failure lines (by upstream template, or by source site) kept per rank."""
MAX_NAME = 1024
"""Characters kept of a frame's function or file name (a hostile dump may hold 16 MB ones)."""
MAX_MESSAGE = 4096
"""Characters kept of an exception message."""


# The doctor's closed vocabularies are StrEnums: a member is its value as a string, so it
# compares equal to the string, serialises to it in JSON, and prints as it in every text report
# (a plain ``(str, Enum)`` would print ``ThreadState.IDLE`` in an f-string).


class InputStatus(StrEnum):
    """What became of one input."""

    READ = "read"
    """Read (an empty input, and a doctor report passed over as output, count as read)."""
    ERROR = "error"
    """Not read: missing, not a file, malformed, over a size cap; its message says why."""


class ThreadState(StrEnum):
    """What a dumped thread was doing (:meth:`doctor.model.frames.FrameClassifier.state`)."""

    CRASHED = "crashed"
    """It died of a fatal signal."""
    BLOCKED = "blocked"
    """It is inside a collective (and was not seen elsewhere a moment later)."""
    IDLE = "idle"
    """It waits for work."""
    ACTIVE = "active"
    """Anything else: it runs."""


class KvLineKind(StrEnum):
    """What a line of a KV storage or transfer layer reports
    (:func:`doctor.read.text.kvstore.classify`)."""

    STORE_FAILURE = "store-failure"
    """A storage component failed to store, retrieve, connect, read or write."""
    POOL_PRESSURE = "pool-pressure"
    """A KV cache's host (CPU) pool had no room."""
    PD_FAILURE = "pd-failure"
    """The prefill/decode disaggregation transfer failed."""
    TRANSFER_FAILURE = "transfer-failure"
    """A transfer engine that stores and disaggregation both use failed (whose failure it is
    depends on what else the inputs show)."""


def clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


@dataclass(frozen=True)
class SourceRef:
    """Where a record came from: an input file (as given, or ``tar!member``) and a line."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


@dataclass(frozen=True)
class RankHint:
    """What an artifact says about which rank wrote it (any part may be unknown)."""

    rank: int | None = None
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None

    @property
    def empty(self) -> bool:
        return self.rank is None and self.tp is None and self.pp is None and self.dp is None

    def merged(self, other: RankHint) -> RankHint:
        """Fill the unknown parts of ``self`` from ``other``."""
        if other.empty:  # the usual case (no default from the file's name): nothing to fill
            return self
        return RankHint(*(a if a is not None else b for a, b in zip(
            (self.rank, self.tp, self.pp, self.dp), (other.rank, other.tp, other.pp, other.dp))))


@dataclass(frozen=True)
class Frame:
    """One stack frame. ``line`` is None for native frames and unknown lines; ``code`` is the
    source line a traceback printed under it (``assert cd.lock_ref == 0``), when it did."""

    func: str
    file: str
    line: int | None = None
    code: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if len(self.func) > MAX_NAME or len(self.file) > MAX_NAME or len(self.code) > MAX_NAME:
            object.__setattr__(self, "func", clip(self.func, MAX_NAME))
            object.__setattr__(self, "file", clip(self.file, MAX_NAME))
            object.__setattr__(self, "code", clip(self.code, MAX_NAME))

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{self.func} ({where})"


@dataclass
class ThreadStack:
    """One thread of a stack dump (py-spy, faulthandler). ``idle`` is py-spy's verdict;
    ``fatal`` is faulthandler's ``Fatal Python error`` text for the thread that crashed."""

    name: str
    tid: str
    frames: list[Frame]
    source: SourceRef
    origin: str
    idle: bool | None = None
    current: bool = False
    fatal: str | None = None
    pid: int | None = None
    moved: bool = False
    """Seen at another stack a moment later (``hicache capture`` samples twice): the thread
    is running, so a collective it was caught in is no evidence of a hang."""


@dataclass
class ExceptionRecord:
    """One exception of a traceback. ``chain`` says how it relates to the one printed before
    it (``cause``/``context``) or that it is a member of an exception group (``group``)."""

    type: str
    message: str
    frames: list[Frame]
    source: SourceRef
    chain: str = ""
    truncated: bool = False
    """Frames of a traceback whose exception line is missing (a paste cut short): no type."""

    def __post_init__(self) -> None:
        if len(self.message) > MAX_MESSAGE or len(self.type) > MAX_NAME:
            self.message = clip(self.message, MAX_MESSAGE)
            self.type = clip(self.type, MAX_NAME)

    @property
    def short_type(self) -> str:
        return self.type.rsplit(".", 1)[-1] if self.type else "(cut off)"

    @property
    def text(self) -> str:
        """``Type: message``, or what a cut-off traceback is."""
        if self.truncated:
            return "a traceback cut off before its exception line"
        return f"{self.short_type}: {self.message}" if self.message else self.short_type


@dataclass
class FailureLine:
    """A line that reports a failure or a warning, and the upstream template it was printed
    from: ``template`` is the index's id (-1: none matched, or not matched yet: lines are
    matched after the scan; ``site`` may still say whose it is). Lines of one shape (numbers
    folded) count together while scanning, lines of one template (or one site) after."""

    template: int
    similarity: float
    site: str
    level: str
    """What the logger's prefix said: ``error``, ``warning`` or ``""``."""
    text: str
    source: SourceRef
    count: int = 1


_SHAPE = re.compile(r"0[xX][0-9a-fA-F]+|\d+")


def line_shape(text: str) -> str:
    """A line with its numbers folded: the key lines of one message share."""
    return _SHAPE.sub("0", text[:200])


@dataclass
class LogHit:
    """A line that matched a catalog log pattern, with the regex's named groups."""

    pattern: str
    groups: dict[str, str]
    text: str
    source: SourceRef


@dataclass
class Collective:
    """A collective or p2p op from a flight recorder (PyTorch's or the runtime's own)."""

    group: str
    seq: int
    op: str
    state: str
    sizes: str
    site: Frame | None
    source: SourceRef
    peer: int | None = None
    """For point-to-point ops: the global rank sent to or received from."""
    order: int = -1
    """Position in the rank's recorder across all groups (torch's ``record_id``): the rank's
    last entry is where it stopped."""


@dataclass
class Decision:
    """A decision event of a trace, reduced to what must agree across ranks."""

    kind: str
    key: str
    value: str
    step: int
    source: SourceRef


@dataclass(frozen=True)
class TimedEvent:
    """A traced event placed in time, for the incident page's timeline: ``t_ns`` on the
    runtime's monotonic clock (shared by the ranks of one machine), the scheduler step, the
    event kind (``hicache_runtime.contracts.events.Ev``), a short label, and ``key`` pairing
    a collective's enter with its exit (``group#seq``)."""

    t_ns: int
    step: int
    kind: str
    label: str
    key: str = ""


@dataclass
class ExitRecord:
    """How a rank's process ended (torchrun failure block, bundle entry, capture)."""

    exit_code: int | None
    pid: int | None
    signal: str | None
    root_cause: bool
    source: SourceRef
    dumped: bool | None = None
    """Whether the rank wrote its own dump before it ended (None: unknown)."""
    launcher: str | None = None
    """Which launcher's exit-code conventions apply (``hicache`` for the runtime's bundles)."""


class Bounded(Generic[T]):
    """Keeps the first ``head`` and the last ``tail`` items appended, and a total count."""

    def __init__(self, head: int, tail: int) -> None:
        self._head: list[T] = []
        self._tail: deque[T] = deque(maxlen=tail)
        self._cap = head
        self.count = 0

    def append(self, item: T) -> None:
        self.count += 1
        if len(self._head) < self._cap:
            self._head.append(item)
        else:
            self._tail.append(item)

    def __iter__(self) -> Iterator[T]:
        yield from self._head
        yield from self._tail

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)


@dataclass
class HitStats:
    """All hits of one pattern on one rank: count, first and last few."""

    count: int = 0
    kept: Bounded[LogHit] = field(default_factory=lambda: Bounded(MAX_HITS_KEPT, MAX_HITS_KEPT))

    def add(self, hit: LogHit) -> None:
        self.count += 1
        self.kept.append(hit)


@dataclass
class RankEvidence:
    """Everything known about one rank (``rank`` is -1 for evidence of unknown origin)."""

    rank: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    pid: int | None = None
    exits: list[ExitRecord] = field(default_factory=list)
    threads: Bounded[ThreadStack] = field(default_factory=lambda: Bounded(MAX_THREADS, 0))
    exceptions: Bounded[ExceptionRecord] = field(
        default_factory=lambda: Bounded(MAX_EXCEPTIONS // 2, MAX_EXCEPTIONS // 2))
    hits: dict[str, HitStats] = field(default_factory=dict)
    collectives: dict[str, deque[Collective]] = field(default_factory=dict)
    last_seq: dict[str, dict[str, int]] = field(default_factory=dict)
    decisions: dict[tuple[str, str], list[Decision]] = field(default_factory=dict)
    events: Bounded[tuple[str, dict[str, Any], SourceRef, int]] = field(
        default_factory=lambda: Bounded(MAX_EVENTS // 2, MAX_EVENTS // 2))
    timeline: Bounded[TimedEvent] = field(
        default_factory=lambda: Bounded(MAX_TIMELINE // 2, MAX_TIMELINE // 2))
    samples: dict[str, deque[tuple[float, SourceRef]]] = field(default_factory=dict)
    state: dict[str, Any] | None = None
    state_source: SourceRef | None = None
    kinds: set[str] = field(default_factory=set)
    """Which kinds of artifact covered this rank (log, pyspy, faulthandler, fr, trace...)."""
    trace_start: int | None = None
    """The step of the earliest traced event: above 1, the event ring lost the run's start."""
    trace_end: int | None = None
    """The step of the latest traced event."""
    arrived: set[str] = field(default_factory=set)
    """Requests whose arrival is in the trace (their later decisions are all there too)."""
    errors: Bounded[tuple[str, SourceRef]] = field(
        default_factory=lambda: Bounded(MAX_ERROR_LINES, MAX_ERROR_LINES))
    """Lines the logger marked as errors (first and last few), for the fingerprint."""
    kv_lines: Bounded[tuple[KvLineKind, str, SourceRef]] = field(
        default_factory=lambda: Bounded(MAX_ERROR_LINES, MAX_ERROR_LINES))
    """Lines of KV storage or transfer layers that report a failure or memory pressure:
    ``(kind, text, source)``."""
    sites: dict[str, SourceRef] = field(default_factory=dict)
    """Source files that log lines name (``[engine.py:135]``, ``client.cpp:406]``), first
    line of each; at most ``MAX_SITES``."""
    failure_lines: dict[tuple[int, str], FailureLine] = field(default_factory=dict)
    """Failure and warning lines: by ``(-1, shape)`` while scanning, by ``(template, "")`` or
    ``(-1, site)`` once matched (:meth:`resolve_failure_lines`); at most
    ``MAX_FAILURE_LINES``."""

    def add_site(self, site: str, source: SourceRef) -> None:
        if site not in self.sites and len(self.sites) < MAX_SITES:
            self.sites[site] = source

    def add_failure_line(self, fl: FailureLine, key: tuple[int, str] | None = None) -> None:
        key = key or (fl.template, fl.site if fl.template < 0 else "")
        seen = self.failure_lines.get(key)
        if seen is not None:
            seen.count += fl.count
            seen.similarity = max(seen.similarity, fl.similarity)
        elif len(self.failure_lines) < MAX_FAILURE_LINES:
            self.failure_lines[key] = fl

    def resolve_failure_lines(self, match: Callable[[FailureLine], FailureLine | None]) -> None:
        """Re-key the scanned lines by what ``match`` makes of them (a template, or the site
        their logger named); lines it drops (``None``) go."""
        scanned, self.failure_lines = self.failure_lines, {}
        for fl in scanned.values():
            done = match(fl)
            if done is not None:
                self.add_failure_line(done)

    @property
    def role(self) -> str:
        parts = [f"TP{self.tp}" if self.tp is not None else "",
                 f"PP{self.pp}" if self.pp is not None else "",
                 f"DP{self.dp}" if self.dp is not None else ""]
        return " ".join(p for p in parts if p) or "-"

    def add_collective(self, c: Collective) -> None:
        ring = self.collectives.setdefault(c.group, deque(maxlen=MAX_COLLECTIVES_PER_GROUP))
        ring.append(c)

    def add_decision(self, d: Decision) -> None:
        seq = self.decisions.setdefault((d.kind, d.key), [])
        if len(seq) < MAX_DECISIONS_PER_KEY:
            seq.append(d)

    def add_sample(self, name: str, value: float, source: SourceRef) -> None:
        self.samples.setdefault(name, deque(maxlen=MAX_SAMPLES)).append((value, source))

    def merge(self, other: RankEvidence) -> None:
        """Fold ``other`` (the same rank seen under another identity) into this one."""
        self.tp = self.tp if self.tp is not None else other.tp
        self.pp = self.pp if self.pp is not None else other.pp
        self.dp = self.dp if self.dp is not None else other.dp
        self.pid = self.pid if self.pid is not None else other.pid
        self.exits.extend(other.exits)
        for t in other.threads:
            self.threads.append(t)
        for e in other.exceptions:
            self.exceptions.append(e)
        for pid, stats in other.hits.items():
            mine = self.hits.setdefault(pid, HitStats())
            mine.count += stats.count - len(stats.kept)
            for h in stats.kept:
                mine.add(h)
        for ring in other.collectives.values():
            for c in ring:
                self.add_collective(c)
        for g, v in other.last_seq.items():
            self.last_seq.setdefault(g, {}).update(v)
        for seq in other.decisions.values():
            for d in seq:
                self.add_decision(d)
        for ev in other.events:
            self.events.append(ev)
        for name, ring2 in other.samples.items():
            for value, src in ring2:
                self.add_sample(name, value, src)
        if self.state is None:
            self.state, self.state_source = other.state, other.state_source
        self.kinds |= other.kinds
        if other.trace_start is not None:
            self.trace_start = min(self.trace_start if self.trace_start is not None
                                   else other.trace_start, other.trace_start)
        if other.trace_end is not None:
            self.trace_end = max(self.trace_end if self.trace_end is not None
                                 else other.trace_end, other.trace_end)
        self.arrived |= other.arrived
        for site, src in other.sites.items():
            self.add_site(site, src)
        for item in other.errors:
            self.errors.append(item)
        for kv in other.kv_lines:
            self.kv_lines.append(kv)
        for key, fl in other.failure_lines.items():
            self.add_failure_line(FailureLine(fl.template, fl.similarity, fl.site, fl.level,
                                              fl.text, fl.source, fl.count), key)


@dataclass
class InputRecord:
    """One input artifact and what became of it."""

    path: str
    kind: str
    status: InputStatus
    message: str = ""
    rank: int | None = None


@dataclass
class KvContext:
    """What the whole input says about which KV layers are in use (all ranks together): the
    store components seen anywhere (even on healthy lines) and whether prefill/decode
    disaggregation is in the picture (``doctor.read.text.kvstore`` notes both), and the
    source files loggers named on any line (``vineyard_llm_cache.py:296]``: a KV store module
    at work, healthy lines included; :data:`MAX_SITES` of them)."""

    store: set[str] = field(default_factory=set)
    pd: bool = False
    sites: set[str] = field(default_factory=set)


#: Distinct logger source files a :class:`KvContext` keeps (a log names a few dozen).
MAX_SITES = 64
