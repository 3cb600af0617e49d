"""``hicache trace export``: runtime traces (JSONL) to Chrome/Perfetto trace JSON, streaming.

Traces come from crash bundles, which travel between people: a trace file may be huge, hold
one endless line, be a device (``/dev/zero``) or hold anything but events. The export therefore
streams in two passes over regular files only (:func:`~contracts.jsonl.open_regular`),
with lines bounded (:func:`~contracts.jsonl.iter_lines`): the first finds the earliest
time, the second writes one record per event as it reads it. Memory is one chunk plus the
per-track table (bounded), whatever the input. A line that is not an event (malformed JSON,
wrong types, over-long) is skipped and counted; an input without a single event is an error
(:class:`~hicache_runtime.contracts.errors.DumpFormatError`), not an empty trace.

Output: one process per rank (and one for the DP controller, whose events carry rank -1, as
process ``MAX_RANK``: it is no rank of the grid), one track per thread; events with ``dur_ns``
become complete
("X") slices starting at ``t0_ns``, the rest instant ("i") events; times are microseconds from
the earliest event. Records are in input order (trace viewers sort by time themselves).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from hicache_runtime.contracts.errors import DumpFormatError
from hicache_runtime.contracts.jsonl import iter_lines, open_regular

MAX_TRACKS = 4096
"""Distinct (rank, thread) tracks; events of further threads share one overflow track."""
MAX_NAME = 200
MAX_FILES = 4096
MAX_RANK = 1 << 16
CONTROLLER_RANK = -1
"""The rank the DP controller's events carry."""
_OVERFLOW_THREAD = "(other threads)"


@dataclass(frozen=True)
class TraceEvent:
    """One validated event: the fields the export uses, with their types checked."""

    kind: str
    t_ns: int
    rank: int
    tp: int | None
    pp: int | None
    thread: str
    step: int | None
    attrs: dict[str, Any]

    @property
    def start_ns(self) -> int:
        t0 = self.attrs.get("t0_ns")
        return t0 if _is_int(t0) and self.duration_ns is not None else self.t_ns

    @property
    def duration_ns(self) -> int | None:
        dur, t0 = self.attrs.get("dur_ns"), self.attrs.get("t0_ns")
        return dur if _is_int(dur) and _is_int(t0) and dur >= 0 else None


@dataclass
class ExportStats:
    """What the export read and wrote."""

    events: int = 0
    files: int = 0
    malformed: int = 0
    """Lines that are not events (bad JSON, missing or mistyped fields)."""
    long_lines: int = 0
    """Lines over the length limit, skipped without being read."""
    problems: list[str] = field(default_factory=list)
    """Inputs that could not be read at all, one line each."""

    @property
    def skipped_text(self) -> str:
        parts = ([f"{self.malformed} malformed line(s)"] if self.malformed else []) + (
            [f"{self.long_lines} over-long line(s)"] if self.long_lines else [])
        return ", ".join(parts)


def trace_files(paths: list[Path]) -> list[Path]:
    """The JSONL files named: files as given, bundle directories' ``rank*/events.jsonl``."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("rank*/events.jsonl"))
            if not found:
                raise DumpFormatError(f"no rank*/events.jsonl under {path}")
            files += found
        elif path.exists() or path.is_symlink():
            files.append(path)
        else:
            raise DumpFormatError(f"{path}: not found")
    if len(files) > MAX_FILES:
        raise DumpFormatError(f"{len(files)} trace files; at most {MAX_FILES} per export")
    return files


def export_perfetto(paths: list[Path], out: Path) -> ExportStats:
    """Write the Perfetto trace of the traces at ``paths`` to ``out``; returns the counts.
    Raises :class:`DumpFormatError` when no input holds an event."""
    files = trace_files(paths)
    first = ExportStats(files=len(files))
    t_base: int | None = None
    for ev in _events(files, first):
        t_base = ev.start_ns if t_base is None else min(t_base, ev.start_ns)
        first.events += 1
    if t_base is None:
        bad = first.malformed + first.long_lines
        why = "; ".join(first.problems[:3]) or (
            f"{bad} line(s), none of them an event" if bad else "no lines")
        raise DumpFormatError(f"no trace events in {', '.join(str(p) for p in paths)}: {why} "
                              "(expected an events.jsonl of hicache run --trace, or a crash "
                              "bundle directory)")
    stats = ExportStats(files=len(files))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
            sep = ""
            for rec in _records(_events(files, stats), t_base):
                try:
                    text = json.dumps(rec, default=str)
                except (ValueError, RecursionError):  # attributes nested past the limit
                    rec["args"] = {"step": rec["args"].get("step"), "attrs": "(not exportable)"}
                    text = json.dumps(rec, default=str)
                fh.write(sep + text)
                sep = ",\n"
            fh.write("\n]}\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return stats


def _events(files: list[Path], stats: ExportStats) -> Iterator[TraceEvent]:
    for f in files:
        try:
            fh = open_regular(f)
        except DumpFormatError as exc:
            stats.problems.append(str(exc))
            continue
        except OSError as exc:
            stats.problems.append(f"{f}: {exc.strerror or exc}")
            continue
        with fh:
            for _lineno, line in iter_lines(fh):
                if line is None:
                    stats.long_lines += 1
                    continue
                if not line.strip():
                    continue
                ev = parse_event(line)
                if ev is None:
                    stats.malformed += 1
                    continue
                stats.events += 1
                yield ev


def parse_event(line: bytes) -> TraceEvent | None:
    """One JSONL line as a :class:`TraceEvent`, or ``None`` if it is not one."""
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict):
        return None
    kind, t_ns, attrs = raw.get("kind"), raw.get("t_ns"), raw.get("attrs", {})
    rank = raw.get("rank", 0)
    if not (isinstance(kind, str) and kind and _is_int(t_ns) and isinstance(attrs, dict)
            and _is_int(rank) and CONTROLLER_RANK <= rank < MAX_RANK):
        return None
    thread = raw.get("thread")
    return TraceEvent(kind=kind[:MAX_NAME], t_ns=t_ns, rank=rank, tp=_opt_int(raw.get("tp")),
                      pp=_opt_int(raw.get("pp")),
                      thread=thread[:MAX_NAME] if isinstance(thread, str) else "?",
                      step=_opt_int(raw.get("step")), attrs=attrs)


def _records(events: Iterator[TraceEvent], t_base: int) -> Iterator[dict[str, Any]]:
    tids: dict[tuple[int, str], int] = {}
    ranks: set[int] = set()
    for ev in events:
        pid = MAX_RANK if ev.rank == CONTROLLER_RANK else ev.rank  # viewers want pids >= 0
        key = (pid, ev.thread)
        if key not in tids and len(tids) >= MAX_TRACKS:
            key = (pid, _OVERFLOW_THREAD)
        if key not in tids:
            tids[key] = len(tids) + 1
            yield _meta("thread_name", pid, tids[key], key[1])
            if pid not in ranks:
                ranks.add(pid)
                label = "DP controller" if pid == MAX_RANK \
                    else f"rank {ev.rank} (TP{ev.tp or 0} PP{ev.pp or 0})"
                yield _meta("process_name", pid, 0, label)
        args = {k: v for k, v in ev.attrs.items() if k not in ("t0_ns", "dur_ns")}
        args["step"] = ev.step
        rec: dict[str, Any] = {"name": ev.kind, "cat": ev.kind.split(".")[0], "pid": pid,
                               "tid": tids[key], "args": args}
        dur = ev.duration_ns
        if dur is not None:
            rec.update(ph="X", ts=(ev.start_ns - t_base) / 1000.0, dur=dur / 1000.0)
        else:
            rec.update(ph="i", s="t", ts=(ev.t_ns - t_base) / 1000.0)
        yield rec


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {"name": value}}


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt_int(value: Any) -> int | None:
    return value if _is_int(value) else None
