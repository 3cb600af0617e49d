"""Event tracing: an always-on per-rank ring of structured events and JSONL (Perfetto export:
:mod:`hicache_runtime.perfetto`).

Every state transition in the runtime (request, tree, tier transfer, vote, fault, collective) is
one event: monotonic time, rank coordinates, thread, scheduler step, kind and attributes. The ring
is a bounded deque, cheap enough to leave on in production-like runs (``bench/tracing_overhead``
measures it); the full stream goes to JSONL only when ``--trace PATH`` asks for it. Crash bundles
carry the ring.

Event kinds are dotted strings; :class:`Ev` lists the ones the runtime emits so the doctor and
tests refer to them by name.
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

from hicache_runtime.jsonl import iter_lines, open_regular
from hicache_runtime.topology import RankInfo


class Ev:
    """Event kinds. Attributes are documented where each is emitted."""

    REQ_ARRIVE = "req.arrive"
    REQ_ADMIT = "req.admit"
    REQ_FINISH = "req.finish"
    REQ_ABORT = "req.abort"
    REQ_RETRACT = "req.retract"
    REQ_REJECT = "req.reject"
    BATCH = "sched.batch"
    STEP = "sched.step"
    MATCH = "tree.match"
    INSERT = "tree.insert"
    SPLIT = "tree.split"
    EVICT = "tree.evict"
    EVICT_HOST = "tree.evict_host"
    LOCK = "tree.lock"
    WRITE_SUBMIT = "l2.write.submit"
    WRITE_SKIP = "l2.write.skip"
    WRITE_ACK = "l2.write.ack"
    WRITE_DRAIN = "l2.write.drain"
    LOAD_SUBMIT = "l2.load.submit"
    LOAD_SKIP = "l2.load.skip"
    LOAD_ACK = "l2.load.ack"
    LOAD_DRAIN = "l2.load.drain"
    COPY = "copy.job"
    LAYER_WAIT = "copy.layer_wait"
    BACKUP_SUBMIT = "l3.backup.submit"
    BACKUP_ACK = "l3.backup.ack"
    PREFETCH_SUBMIT = "l3.prefetch.submit"
    PREFETCH_HIT = "l3.prefetch.hit"
    PREFETCH_ACK = "l3.prefetch.ack"
    PREFETCH_SETTLE = "l3.prefetch.settle"
    PREFETCH_REVOKE = "l3.prefetch.revoke"
    PREFETCH_TERMINATE = "l3.prefetch.terminate"
    PREFETCH_DISCARD = "l3.prefetch.discard"
    PREFETCH_LATE_WRITE = "l3.prefetch.late_write"
    STORAGE = "l3.storage"
    VOTE = "sync.vote"
    COLLECTIVE_ENTER = "comm.enter"
    COLLECTIVE_EXIT = "comm.exit"
    FAULT = "fault.fired"
    WORKER_DIED = "thread.died"
    INTEGRITY = "check.integrity"
    WATCHDOG = "watchdog.stall"
    CONSENSUS = "consensus.check"
    PP_PENDING = "sync.pp_pending"
    HOST_CAPACITY = "sync.host_capacity"
    PP_RECV = "pp.recv"
    PP_SEND = "pp.send"


EventRecord = tuple[int, int, str, str, int, dict[str, Any]]
"""(per-rank sequence number, monotonic ns, kind, thread name, step, attributes): the ring's
storage form. The sequence number survives ring truncation, so rings cut at different points
can still be lined up."""


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
        if jsonl_path is not None and enabled:
            jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = jsonl_path.open("w", encoding="utf-8")

    def emit(self, kind: str, /, **attrs: Any) -> None:
        """Record one event. Attributes must be JSON-friendly scalars or short lists."""
        if self.observer is not None:
            self.observer(kind, attrs)
        if not self.enabled:
            return
        self.total += 1
        rec = (self.total, time.monotonic_ns(), kind, threading.current_thread().name,
               self.step, attrs)
        self._ring.append(rec)
        if self._sink is not None:
            line = json.dumps(self._as_dict(rec), default=str)
            with self._sink_lock:
                self._sink.write(line + "\n")

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


# --- reading and exporting ------------------------------------------------------------------


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield events from a JSONL trace, skipping (not failing on) malformed and over-long
    lines; only a regular file is read (see :mod:`hicache_runtime.jsonl`). ``hicache trace
    export`` lives in :mod:`hicache_runtime.perfetto`."""
    with open_regular(path) as fh:
        for _lineno, line in iter_lines(fh):
            if not line or not line.strip():
                continue
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(ev, dict) and "kind" in ev and "t_ns" in ev:
                yield ev
