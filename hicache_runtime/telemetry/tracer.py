"""Event tracing: an always-on per-rank ring of structured events and JSONL (Perfetto export:
:mod:`hicache_runtime.telemetry.perfetto`).

Every state transition in the runtime (request, tree, tier transfer, vote, fault, collective) is
one event: monotonic time, rank coordinates, thread, scheduler step, kind and attributes. The ring
is a bounded deque, cheap enough to leave on in production-like runs (``bench/tracing_overhead``
measures it); the full stream goes to JSONL only when ``--trace PATH`` asks for it. Crash bundles
carry the ring.

Event kinds are dotted strings named in :mod:`hicache_runtime.contracts.events` (the doctor reads
them from there without importing the runtime); event files are read back by
:func:`hicache_runtime.contracts.jsonl.read_jsonl`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from hicache_runtime.contracts.event_payloads import check_event, strict_events
from hicache_runtime.contracts.events import EventRecord
from hicache_runtime.contracts.topology import RankInfo


class Tracer:
    """Records events for one rank. Thread-safe; ``emit`` never blocks on I/O except with a sink.

    ``step`` is the scheduler step, set by the scheduler thread and read by every thread when it
    emits, so background-thread events line up with the step during which they happened.
    """

    def __init__(
        self,
        rank: RankInfo,
        *,
        ring_size: int = 65536,
        enabled: bool = True,
        jsonl_path: Path | None = None,
    ) -> None:
        self.rank = rank
        self.enabled = enabled
        self.step = 0
        self._ring: deque[EventRecord] = deque(maxlen=ring_size)
        self._sink: IO[str] | None = None
        self._sink_lock = threading.Lock()
        self.total = 0
        self.observer: Callable[[str, dict[str, Any]], None] | None = None
        """Sees every event, also with the ring off (the consensus checker uses it)."""
        self._strict = strict_events()
        """Check every event against its payload model (the test suite turns it on)."""
        self.journal: Path | None = None
        """Where :meth:`emit_durable` appends (a run's rank sets it; none: ring only)."""
        if jsonl_path is not None and enabled:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = jsonl_path.open("w", encoding="utf-8")

    def emit(self, kind: str, /, **attrs: Any) -> EventRecord | None:
        """Record one event. Attributes must be JSON-friendly scalars or short lists."""
        if self._strict:
            check_event(kind, attrs)
        if self.observer is not None:
            self.observer(kind, attrs)
        if not self.enabled:
            return None
        self.total += 1
        rec = (self.total, time.monotonic_ns(), kind, threading.current_thread().name,
               self.step, attrs)
        self._ring.append(rec)
        if self._sink is not None:
            line = json.dumps(self._as_dict(rec), default=str)
            with self._sink_lock:
                self._sink.write(line + "\n")
        return rec

    def emit_durable(self, kind: str, /, **attrs: Any) -> None:
        """Record one event and append it to the rank's journal at once (flushed, one line
        marked ``durable``). For the rare events that tell a failure's cause from its
        consequences (a fault firing, a legacy path taken): a rank that dies in native code
        (gloo's abort on a size mismatch) or is killed never dumps its ring, and without
        them its peers' evidence shows only the consequences."""
        rec = self.emit(kind, **attrs)
        if rec is None or self.journal is None:
            return
        line = json.dumps({**self._as_dict(rec), "durable": True}, default=str)
        with self._sink_lock:
            try:
                self.journal.parent.mkdir(parents=True, exist_ok=True)
                with self.journal.open("a", encoding="utf-8") as fh:
                    fh.write(line + "\n")
            except OSError:
                self.journal = None  # a full or read-only disk: the ring still has it

    @contextmanager
    def span(self, kind: str, /, **attrs: Any) -> Iterator[dict[str, Any]]:
        """Emit ``kind`` at exit with ``dur_ns``; the yielded dict can add attributes."""
        start = time.monotonic_ns()
        try:
            yield attrs
        finally:
            if self.enabled:
                self.emit(kind, t0_ns=start, dur_ns=time.monotonic_ns() - start, **attrs)

    def events(self) -> list[dict[str, Any]]:
        """A snapshot of the ring, oldest first, as JSON-ready dicts."""
        return [self._as_dict(rec) for rec in list(self._ring)]

    def write_jsonl(self, path: Path) -> int:
        """Write the ring to ``path`` (one event per line); returns the count."""
        events = self.events()
        with path.open("w", encoding="utf-8") as fh:
            for ev in events:
                fh.write(json.dumps(ev, default=str) + "\n")
        return len(events)

    def close(self) -> None:
        with self._sink_lock:
            if self._sink is not None:
                self._sink.close()
                self._sink = None

    def _as_dict(self, rec: EventRecord) -> dict[str, Any]:
        seq, t, kind, thread, step, attrs = rec
        r = self.rank
        return {
            "seq": seq, "t_ns": t, "rank": r.rank, "tp": r.tp_rank, "pp": r.pp_rank,
            "thread": thread, "step": step, "kind": kind, "attrs": attrs,
        }
