"""The slow path of log scanning: everything that happens to one selected line.

:class:`LineHandler` undoes the page's wrapping (:mod:`doctor.read.text.pages`), strips writer
prefixes (:mod:`doctor.read.text.prefixes`), keeps one set of block parsers (tracebacks,
faulthandler, py-spy text, gdb / c10 backtraces, torchrun failures, C++ terminate records) per
writer stream so interleaved ``[rank3]:`` or ``(VllmWorker pid=7)`` lines never mix, turns call
chains into stacks, runs the catalog's log patterns on the line (trigger substrings first, then
the regex), reads the job's topology from server arguments, and files every record into the
:class:`~doctor.model.builder.EvidenceBuilder` slot of the rank that wrote it.

Unprefixed lines continue the record of the last prefixed line (SGLang prints a traceback as
one multi-line log record); a new prefixed record ends an exception message that ran over
several lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from doctor.model.builder import EvidenceBuilder
from doctor.model.evidence import (
    MAX_EXITS,
    MAX_SITES,
    ExceptionRecord,
    ExitRecord,
    FailureLine,
    HitStats,
    LogHit,
    RankEvidence,
    RankHint,
    SourceRef,
    ThreadStack,
    line_shape,
)
from doctor.read.text.backtraces import TRIGGERS as BACKTRACE_TRIGGERS
from doctor.read.text.backtraces import NativeStackParser, chain_stack
from doctor.read.text.kvstore import GATE_PATTERN, classify
from doctor.read.text.native import TRIGGERS as NATIVE_TRIGGERS
from doctor.read.text.native import CppTerminateParser
from doctor.read.text.nccl_coll import TRIGGER as NCCL_COLL_TRIGGER
from doctor.read.text.nccl_coll import NcclCollectives
from doctor.read.text.pages import clean_line
from doctor.read.text.prefixes import strip_prefixes
from doctor.read.text.threaddumps import FaulthandlerParser, PySpyTextParser
from doctor.read.text.torchrun import TorchrunParser
from doctor.read.text.tracebacks import TRIGGERS as TRACEBACK_TRIGGERS
from doctor.read.text.tracebacks import TracebackParser
from doctor.read.text.versions import NAMED_PATTERN as VERSION_NAMED
from doctor.read.text.versions import NUMBER_PATTERN as VERSION_NUMBER
from doctor.read.text.versions import TRIGGERS as VERSION_TRIGGERS
from doctor.read.text.versions import stated_versions
from signatures.linear import PatternSet, any_of, linear
from signatures.models import Catalog

#: A logger's source file kept for the KV context is cut to this many characters.
MAX_SITE_CHARS = 120

#: Lines that may report a failure or a warning (matched against upstream's templates): the
#: level words of loggers and the usual failure words, and C/C++ source sites (glog lines).
FAILURE_TRIGGERS = ["rror", "RROR", "ailed", "AILED", "ARN", "arning", "atal", "ATAL",
                    "xception", "imed out", "imeout", "nable to", "annot ", "ould not",
                    "efused", "heck failed", "nvalid", ".cc:", ".cu:", ".h:", "ssert"]
#: Literal triggers of the block parsers and topology lines (besides the catalog's patterns).
BLOCK_TRIGGERS = ["Traceback (most recent call last)", "(most recent call first)",
                  "Fatal Python error", "ChildFailedError", "Root Cause (first observed",
                  "Python v3.", "tp_size=", "pp_size=", "dp_size=", "world_size=",
                  "WORLD_SIZE", "--tp-size", "--pp-size", "Failures:", "Timeout (0:",
                  "Thread ", ".py:", "Error: ", "Exception: ", "EnforceNotMet",
                  "LMCache ERROR", "LMCache WARN", "[infini] [error]", "cannot store",
                  "under pressure", "CQ error", "Mooncake store", NCCL_COLL_TRIGGER,
                  *NATIVE_TRIGGERS, *BACKTRACE_TRIGGERS, *TRACEBACK_TRIGGERS,
                  *VERSION_TRIGGERS, *FAILURE_TRIGGERS]
#: What opens a record of its own: a bare line holding one never continues a log message.
BLOCK_OPENERS = ["Traceback (most recent call last)", "(most recent call first)", "File \"",
                 "Fatal Python error", "Thread ", *NATIVE_TRIGGERS, *BACKTRACE_TRIGGERS,
                 *TRACEBACK_TRIGGERS]
_TOPO = re.compile(r"\b(?P<k>tp|pp|dp|world)_size=(?P<v>\d{1,6})\b|--(?P<k2>tp|pp|dp)-size[ =]"
                   r"(?P<v2>\d{1,6})\b|\bWORLD_SIZE[=:]\s*(?P<v3>\d{1,6})\b")
#: Searched in every line (RE2: a backtracking engine tries the whole alternation at every
#: position, about 40 times slower on a long line).
_FAILURES = ("error", "failed", "failure", "exception", "timed out", "timeout", "abort",
             "aborted", "refused", "fatal", "killed", "segmentation fault")
_FAILURE_WORDS = linear(rf"\b(?:{any_of(_FAILURES)})\b", re.I)
#: A logger's level word anywhere in the line (a prefix the readers do not know still says it).
_LEVELS = ("WARN", "WARNING", "ERROR", "CRITICAL", "FATAL")
_LEVEL_WORDS = re.compile(rf"\b(?:{any_of(_LEVELS)})\b")
_UNITS = {"k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024}
MAX_LINE_CHARS = 8192
_TOPOLOGY_TRIGGERS = ("_size=", "-size", "WORLD_SIZE")
_ARROWS = ("->", "<-", "→", "←")

#: What each line may hold, found in one automaton pass over it: each entry is a condition
#: every match of a later, exact check needs (its words without their boundaries, its
#: literals), so a line without it skips that check. A long line otherwise costs one scan
#: per check; a log made of such lines (the adversarial set of bench/doctor_throughput.py)
#: ran five times slower per byte than an ordinary one.
(_GATE_FAILURE, _GATE_LEVEL, _GATE_KV, _GATE_VERSION, _GATE_TOPOLOGY, _GATE_NCCL, _GATE_ARROW,
 _GATE_VNAME, _GATE_VNUMBER) = range(9)
#: The block parsers in the order they may claim a line that opens a block (``_Stream.parsers``).
BLOCK_PARSERS = (TorchrunParser, CppTerminateParser, FaulthandlerParser, PySpyTextParser,
                 NativeStackParser, TracebackParser)
_GATE_PATTERNS = [
    "(?i)" + any_of(_FAILURES),  # _FAILURE_WORDS without their word boundaries
    any_of(_LEVELS),  # _LEVEL_WORDS likewise
    GATE_PATTERN,  # the KV store line classifier's
    any_of(VERSION_TRIGGERS), any_of(_TOPOLOGY_TRIGGERS), any_of([NCCL_COLL_TRIGGER]),
    any_of(_ARROWS),
    VERSION_NAMED, VERSION_NUMBER,  # what every version statement holds besides a trigger
    # then one per block parser, in BLOCK_PARSERS order: what its starts() needs
    *(any_of(p.START_LITERALS) for p in BLOCK_PARSERS),
]
_GATE_PARSERS = _GATE_VNUMBER + 1
MAX_MATCHED_CHARS = 1000
"""Only the head of a long line is matched against upstream's templates."""
MAX_BLOCK_LINES = 20000
MAX_CONTINUATION_LINES = 2
"""Unprefixed lines joined to a failure or warning line before it is matched: a logged message
that holds newlines (LMCache's double-unpin warning is three sentences on three lines) prints
its first line with the writer's prefix and the rest bare."""


MAX_WRAP_HEAD = 300
"""Only a line this short may be the head of a record wrapped over lines (a reporter's wrap
cuts a record into fragments; a long line that matches nothing is not one)."""
MAX_WRAPPED_LINES = 4
"""Lines one wrapped record may span: a watchdog record pasted as three lines (the message,
``WorkNCCL(SeqNum=..., OpType=...,``, ``NumelIn=..., Timeout(ms)=...)``) is one record."""


def _unfinished(text: str) -> bool:
    """The line stops inside a record: a parenthesis left open, or a trailing ``:`` or ``,``
    (a reporter's wrap, or a message whose details follow on the next line)."""
    s = text.rstrip()
    return s.endswith((":", ",")) or s.count("(") > s.count(")")


@dataclass
class _Wrapped:
    """A triggered line that stops inside its record: the catalog's patterns wait for the bare
    lines that finish it."""

    text: str
    hint: RankHint
    src: SourceRef
    gates: list[int]
    lines: int = 1


@dataclass
class _Pending:
    """The last failure line kept for the upstream index, while bare lines may continue it."""

    slot: RankEvidence
    key: tuple[int, str]
    line: FailureLine
    lineno: int
    joined: int = 0


@dataclass
class _Stream:
    """The block parsers of one writer stream."""

    tb: TracebackParser
    fh: FaulthandlerParser
    ps: PySpyTextParser
    tr: TorchrunParser
    cpp: CppTerminateParser
    nat: NativeStackParser
    opened_at: int = 0
    gates: list[int] = field(default_factory=list)
    """The gate scan of the line being fed (see :data:`_GATE_PATTERNS`)."""
    parsers: tuple[TorchrunParser | CppTerminateParser | FaulthandlerParser | PySpyTextParser
                   | NativeStackParser | TracebackParser, ...] = ()
    """In the order they may claim a line that opens a block: the most specific first (a
    torchrun ``ChildFailedError`` line is the torchrun block's, not a lone exception), the
    order of ``BLOCK_PARSERS`` (the gate set's parser entries follow it)."""

    def __post_init__(self) -> None:
        self.parsers = (self.tr, self.cpp, self.fh, self.ps, self.nat, self.tb)
        assert tuple(map(type, self.parsers)) == BLOCK_PARSERS

    @property
    def open(self) -> bool:
        # spelled out: this runs several times per line, and a generator costs more than
        # the six tests
        return (self.tr.open or self.cpp.open or self.fh.open or self.ps.open or self.nat.open
                or self.tb.open)

    def close(self) -> None:
        for p in self.parsers:
            p.close()

    def claimed(self, line: str) -> bool:
        """Whether a parser other than the traceback's starts a block on ``line`` (the line
        being fed: a parser whose literals its gate scan did not find cannot)."""
        gates = self.gates
        return any(_GATE_PARSERS + i in gates and p.starts(line)
                   for i, p in enumerate(self.parsers) if p is not self.tb)


@dataclass
class _Compiled:
    id: str
    triggers: tuple[str, ...]
    regex: Any
    """An RE2 regexp (:func:`signatures.linear.linear`)."""


@dataclass
class _Patterns:
    """A catalog's scanned patterns, and which of them each trigger belongs to."""

    patterns: list[_Compiled]
    literals: list[str]
    """Every pattern's triggers, each once."""
    owners: list[list[int]]
    """Per trigger (an index of ``literals``), the patterns it triggers, in order."""
    scan: PatternSet
    """The gates (``_GATE_PATTERNS``), then the triggers: what a line holds, in one pass.
    Index ``len(_GATE_PATTERNS) + i`` is trigger ``i``."""

    def candidates(self, found: list[int]) -> list[_Compiled]:
        """The patterns whose trigger a :attr:`scan` of a line found, in catalog order."""
        first = len(_GATE_PATTERNS)
        which = sorted({i for t in found if t >= first for i in self.owners[t - first]})
        return [self.patterns[i] for i in which]


_COMPILED: dict[int, tuple[Catalog, _Patterns]] = {}


def _compiled(catalog: Catalog) -> _Patterns:
    """The catalog's scanned patterns, compiled once per catalog (catalogs are immutable)."""
    hit = _COMPILED.get(id(catalog))
    if hit is None or hit[0] is not catalog:
        patterns = [_Compiled(p.id, tuple(p.triggers), linear(p.regex))
                    for p in catalog.scanned_patterns()]
        literals = list(dict.fromkeys(t for p in patterns for t in p.triggers))
        index = {lit: i for i, lit in enumerate(literals)}
        owners: list[list[int]] = [[] for _ in literals]
        for i, p in enumerate(patterns):
            for t in p.triggers:
                owners[index[t]].append(i)
        scan = PatternSet(_GATE_PATTERNS + [re.escape(lit) for lit in literals])
        hit = _COMPILED[id(catalog)] = (catalog, _Patterns(patterns, literals, owners, scan))
    return hit[1]


@dataclass
class LineHandler:
    """Processes selected lines of one input. ``default`` is what the file path says."""

    catalog: Catalog
    sink: EvidenceBuilder
    name: str
    default: RankHint = field(default_factory=RankHint)
    kind: str = "log"
    _streams: dict[tuple[RankHint, str], _Stream] = field(default_factory=dict)
    _current: RankHint = field(default_factory=RankHint)
    _current_key: str = ""
    _style: str = ""
    _by_rank: dict[int, RankHint] = field(default_factory=dict)
    _patterns: _Patterns | None = None
    _pending: _Pending | None = None
    _wrapped: _Wrapped | None = None
    _nccl: NcclCollectives = field(default_factory=NcclCollectives)

    def __post_init__(self) -> None:
        self._patterns = _compiled(self.catalog)

    @property
    def triggers(self) -> list[str]:
        assert self._patterns is not None
        return [t for p in self._patterns.patterns for t in p.triggers] + BLOCK_TRIGGERS

    @property
    def blocks_open(self) -> bool:
        """A block parser is inside a record, or a failure line may go on in the next line:
        the scanner then feeds the next line whether the prefilter selected it or not."""
        return self._pending is not None or self._wrapped is not None \
            or any(s.open for s in self._streams.values())

    def line(self, raw: bytes, lineno: int, triggered: bool = True) -> None:
        """Process one line (``raw`` without its newline). ``triggered``: the prefilter saw a
        trigger in it; patterns only run then (a line without any trigger cannot match)."""
        text = clean_line(raw[:MAX_LINE_CHARS].decode("utf-8", errors="replace"))
        assert self._patterns is not None
        # the gates and the catalog's triggers ``text`` holds; ``rest`` below is a suffix of
        # ``text``, so what it holds is among these
        gates = self._patterns.scan.found(text)
        pre = strip_prefixes(text)
        rest, hint, style, key = pre.rest, pre.hint, pre.style, pre.stream
        pending, self._pending = self._pending, None
        if pending is not None:
            self._continues(pending, rest, style, lineno)
        wrapped, self._wrapped = self._wrapped, None
        continued = wrapped is not None and self._wraps(wrapped, rest, style, pre.hint)
        if style == "torch" and hint.rank is not None:
            # torchrun prefixes every line of a rank; the SGLang tags are only on the record's
            # first line, so remember them per torch rank
            if hint.tp is not None or hint.pp is not None:
                self._by_rank[hint.rank] = hint
            hint = hint.merged(self._by_rank.get(hint.rank, RankHint()))
        new_record = style in ("sglang", "generic")
        if style:
            self._current, self._current_key = hint, key
        elif not hint.empty:
            pass  # no prefix, but the message names its rank ("[Rank 4] Watchdog caught...")
        elif self._style == "sglang":
            hint, key = self._current, self._current_key
        self._style = style or self._style
        hint = hint.merged(self.default)
        src = SourceRef(self.name, lineno)
        stream = self._stream(hint, key, lineno)
        if new_record:
            stream.tb.boundary()
        if pre.site:
            if pre.warning:
                self.sink.slot(hint).add_site(pre.site, src)
            sites = self.sink.kv.sites
            if len(sites) < MAX_SITES:
                sites.add(pre.site[:MAX_SITE_CHARS])
        failing = bool((pre.error or (_GATE_FAILURE in gates and _FAILURE_WORDS.search(rest)))
                       and rest.strip())
        if failing:
            self.sink.slot(hint).errors.append((rest.strip()[:300], src))
        kv = classify(text, self.sink.kv, gated=True) if _GATE_KV in gates else None
        if kv is not None:
            self.sink.slot(hint).kv_lines.append((kv, rest.strip()[:300], src))
        taken = self._blocks(stream, rest, src, lineno, hint, gates)
        levelled = _GATE_LEVEL in gates and _LEVEL_WORDS.search(text[:200]) is not None
        if (failing or pre.warning or levelled) and not taken:
            self._upstream(rest, pre.site, "error" if pre.error else
                           "warning" if pre.warning else "", hint, src)
        if triggered:
            matched = self._found(rest, gates)
            if not matched and not continued and len(rest) <= MAX_WRAP_HEAD \
                    and _unfinished(rest) and self._patterns.candidates(gates):
                # a short line that stops inside its record and matches none of the patterns
                # it triggers (a line that triggers none, a block parser's, is not held: it
                # would only make the scanner feed the next line for nothing)
                self._wrapped = _Wrapped(rest.strip(), hint, src, gates)
            else:
                self._record(matched, rest, hint, src)
            if _GATE_TOPOLOGY in gates and any(t in rest for t in _TOPOLOGY_TRIGGERS):
                self._topology(rest)
            if _GATE_VERSION in gates and _GATE_VNAME in gates and _GATE_VNUMBER in gates \
                    and any(t in rest for t in VERSION_TRIGGERS):
                for system, version in stated_versions(rest, gated=True):
                    self.sink.note_version(system, version, src)
            if _GATE_NCCL in gates and NCCL_COLL_TRIGGER in rest:
                found = self._nccl.read(rest, src)
                if found is not None:
                    dev, coll = found
                    # the line's own prefix names the rank, else its device does (a file
                    # name's rank is the file's, and one file may hold every rank's lines)
                    slot = self.sink.slot(pre.hint if pre.hint.rank is not None
                                          else RankHint(rank=dev))
                    slot.add_collective(coll)
                    slot.kinds.add("nccl-coll")

    def finish(self) -> None:
        self._pending = None
        if self._wrapped is not None:
            w, self._wrapped = self._wrapped, None
            self._match_patterns(w.text, w.hint, w.src, w.gates)
        for s in self._streams.values():
            s.close()

    def _wraps(self, w: _Wrapped, rest: str, style: str, own: RankHint) -> bool:
        """Continue the wrapped record ``w`` with ``rest`` when it is a bare line (no writer
        prefix, no rank of its own); match the record once it is finished, or alone when this
        line is not its continuation. True when ``rest`` was taken into the record. The
        patterns tried are the ones the record's first line triggered: the continuation's own
        triggers are matched on its own line."""
        body = rest.strip()
        if style or not body or not own.empty or len(w.text) >= MAX_MATCHED_CHARS:
            self._match_patterns(w.text, w.hint, w.src, w.gates)
            return False
        w.text, w.lines = f"{w.text} {body}"[:MAX_MATCHED_CHARS], w.lines + 1
        if w.lines < MAX_WRAPPED_LINES and _unfinished(w.text):
            self._wrapped = w
        else:
            self._match_patterns(w.text, w.hint, w.src, w.gates)
        return True

    def _continues(self, p: _Pending, rest: str, style: str, lineno: int) -> None:
        """Join ``rest`` to the pending failure line when it is the bare next line of that
        record: no writer prefix, nothing a block parser opens, and indented or free of level
        and failure words (glog indents a message's later lines; a flush-left line that says
        ``error`` is a message of its own)."""
        body = rest.strip()
        if style or not body or lineno != p.lineno + 1 or any(t in body for t in BLOCK_OPENERS):
            return
        if not rest[:1].isspace() and (_LEVEL_WORDS.search(body) or _FAILURE_WORDS.search(body)):
            return  # flush left and stating a failure of its own: a new message
        fl = p.line
        if p.slot.failure_lines.get(p.key) is not fl or fl.count != 1:
            return  # merged with an earlier line of its shape: that one stands
        del p.slot.failure_lines[p.key]
        fl.text = f"{fl.text} {body}"[:MAX_MATCHED_CHARS]
        key = (-1, line_shape(fl.text))
        p.slot.add_failure_line(fl, key=key)
        if p.joined + 1 < MAX_CONTINUATION_LINES and p.slot.failure_lines.get(key) is fl:
            self._pending = _Pending(p.slot, key, fl, lineno, p.joined + 1)

    def _stream(self, hint: RankHint, key: str, lineno: int) -> _Stream:
        s = self._streams.get((hint, key))
        if s is None:
            slot = self.sink.slot(hint)
            slot.kinds.add(self.kind)

            def on_exc(e: ExceptionRecord) -> None:
                slot.exceptions.append(e)
                slot.kinds.add("traceback")

            holder: list[PySpyTextParser] = []

            def on_thread(t: ThreadStack) -> None:
                if t.origin == "pyspy" and holder and holder[0].pid is not None:
                    t.pid = holder[0].pid  # "Process 6481: ..." names the pid
                elif t.origin == "pyspy" and t.name == "MainThread" and t.tid.isdigit():
                    t.pid = int(t.tid)  # on Linux the main thread's id is the pid
                slot.threads.append(t)
                slot.kinds.add(t.origin)

            def on_exit(rank: int, rec: ExitRecord) -> None:
                if self.sink.add_expected_rank(rank):
                    exits = self.sink.slot(RankHint(rank=rank)).exits
                    if len(exits) < MAX_EXITS:
                        exits.append(rec)

            holder.append(PySpyTextParser(on_thread))
            claimed: list[_Stream] = []
            s = _Stream(TracebackParser(on_exc, lambda line: claimed[0].claimed(line)),
                        FaulthandlerParser(on_thread), holder[0], TorchrunParser(on_exit),
                        CppTerminateParser(on_exc), NativeStackParser(on_thread))
            claimed.append(s)
            self._streams[(hint, key)] = s
        if s.open and lineno - s.opened_at > MAX_BLOCK_LINES:
            s.close()  # a block that never ends is not a block
        return s

    def _blocks(self, s: _Stream, rest: str, src: SourceRef, lineno: int,
                hint: RankHint, gates: list[int]) -> bool:
        """Feed the line to the stream's block parsers; True when one took it."""
        was_open = s.open
        s.gates = gates
        parsers = s.parsers
        for parser in parsers:
            if parser.open and parser.feed(rest, src):
                return True
        for i, parser in enumerate(parsers):
            if _GATE_PARSERS + i in gates and parser.starts(rest) and parser.feed(rest, src):
                if not was_open:
                    s.opened_at = lineno
                return True
        if _GATE_ARROW in gates and any(a in rest for a in _ARROWS):
            chain = chain_stack(rest, src)
            if chain is not None:
                slot = self.sink.slot(hint)
                slot.threads.append(chain)
                slot.kinds.add("chain")
        return False

    def _upstream(self, rest: str, site: str, level: str, hint: RankHint,
                  src: SourceRef) -> None:
        """Keep a failure or warning line for the upstream index, by its shape (one record
        per message, counted); :func:`doctor.facts.upstream.resolve_lines` matches them to
        templates once the scan is done."""
        text = rest.strip()
        if len(text) < 8:
            return
        slot = self.sink.slot(hint)
        fl = FailureLine(-1, 0.0, site, level, text[:MAX_MATCHED_CHARS], src)
        key = (-1, line_shape(fl.text))
        slot.add_failure_line(fl, key=key)
        if slot.failure_lines.get(key) is fl:
            self._pending = _Pending(slot, key, fl, src.line or 0)

    def _match_patterns(self, rest: str, hint: RankHint, src: SourceRef,
                        gates: list[int]) -> None:
        self._record(self._found(rest, gates), rest, hint, src)

    def _found(self, rest: str, gates: list[int]) -> list[tuple[_Compiled, Any]]:
        """The catalog patterns the line's triggers (``gates``) name that match it."""
        assert self._patterns is not None
        out = []
        for p in self._patterns.candidates(gates):
            m = p.regex.search(rest)
            if m is not None:
                out.append((p, m))
        return out

    def _record(self, found: list[tuple[_Compiled, Any]], rest: str, hint: RankHint,
                src: SourceRef) -> None:
        for p, m in found:
            groups = {k: v for k, v in m.groupdict().items() if v is not None}
            slot = self.sink.slot(hint)
            slot.hits.setdefault(p.id, HitStats()).add(
                LogHit(p.id, groups, rest.strip()[:300], src))
            if p.id == "memory-sample":
                unit = groups.get("unit", "MB")[:1].lower()
                slot.add_sample("rss_mb", float(groups["value"]) * _UNITS.get(unit, 1.0), src)

    def _topology(self, rest: str) -> None:
        for m in _TOPO.finditer(rest):
            key = m["k"] or m["k2"] or "world"
            value = m["v"] or m["v2"] or m["v3"]
            self.sink.topology.set(key, int(value), self.name)

