"""The fault injector of one rank: decides, deterministically, whether a fault point fires.

Determinism: a decision is a keyed hash of (run seed, spec index, global rank, point, the
occurrence number of that point on the calling thread), so the same seed and specs replay the
same firing pattern whatever the interleaving of threads (each thread's own sequence of visits
is deterministic). A point that acts on a named object (``storage.page``: one page of a read)
passes its ``key`` instead, and the decision is a hash of the key: the same pages are hit
whatever the batching of calls and their timing. ``count`` limits are per rank.

Cost when off: components ask :meth:`FaultInjector.armed` once at construction and skip the
point entirely when nothing targets it on this rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from faults.kinds import KINDS
from faults.points import FaultPoint
from faults.spec import FaultSpec
from hicache_runtime.contracts.events import Ev, EventSink

if TYPE_CHECKING:
    from hicache_runtime.contracts.topology import RankInfo


@dataclass(frozen=True)
class FiredFault:
    """One firing, as listed in traces and bundle manifests."""

    spec: str
    kind: str
    point: str
    rank: int
    step: int
    rid: str | None
    thread: str
    fatal: bool = False
    """Its kind is the failure itself (``Kind.survivable`` is False)."""
    effect: str | None = None
    """What it did (``FaultEffect``; the kind's ``effect``): how the doctor reads it."""

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def points_of(spec: FaultSpec) -> frozenset[FaultPoint]:
    """The fault points a spec can act at (its kind's entry in ``KINDS``, narrowed by the
    spec's ``mode`` or ``point``)."""
    return KINDS[spec.kind].acts_at(mode=spec.mode, point=spec.point)


class FaultInjector:
    """Fault decisions for one rank. Thread-safe."""

    def __init__(self, specs: tuple[FaultSpec, ...] | list[FaultSpec], seed: int,
                 rank: RankInfo, tracer: EventSink | None = None) -> None:
        self.seed = seed
        self.rank = rank
        self.tracer = tracer
        self._specs = [(i, s) for i, s in enumerate(specs)
                       if s.matches_rank(rank.rank, rank.tp_rank, rank.pp_rank)]
        self._by_point: dict[FaultPoint, list[tuple[int, FaultSpec]]] = defaultdict(list)
        for i, s in self._specs:
            for p in points_of(s):
                self._by_point[p].append((i, s))
        self._fired_count: dict[int, int] = defaultdict(int)
        self._visits: dict[tuple[int, str, str], int] = defaultdict(int)
        self._lock = threading.Lock()
        self.fired: list[FiredFault] = []
        self.journal: Path | None = None
        """Where :meth:`write_journal` puts the firings before a fault ends the process with
        no chance to report them (a rank kill): the launcher reads it for the bundle."""

    def armed(self, point: FaultPoint) -> bool:
        """Whether any spec can fire at ``point`` on this rank (checked once, at start-up)."""
        return point in self._by_point

    def fire(self, point: FaultPoint, *, step: int, rid: str | None = None,
             pool: str | None = None,
             chunk: int | None = None, key: str | None = None,
             only: Callable[[FaultSpec], bool] | None = None) -> list[FaultSpec]:
        """The specs that fire at this visit of ``point`` (usually zero or one). ``pool``
        names the storage objects a storage call touches ("kv" or a sidecar pool); ``chunk``
        is the 0-based chunk of a chunked prefill that has just run (a spec with ``chunk=``
        fires only after that one); ``key`` names the object this visit acts on, and a
        probability is then drawn for that key, not for the thread's n-th visit. ``only``
        admits the specs this visit is for, where one point is visited from two places
        (``copy.complete``: a lag in the copy thread, a hold at submission) or a spec names
        one visit of several (``prefetch.batch``: the batch a ``mid-prefetch-abort`` names);
        the others are neither fired nor counted."""
        candidates = self._by_point.get(point)
        if not candidates:
            return []
        thread = threading.current_thread().name
        out: list[FaultSpec] = []
        made: list[FiredFault] = []
        with self._lock:
            for idx, spec in candidates:
                if only is not None and not only(spec):
                    continue
                if not spec.matches_step(step) or not spec.matches_request(rid):
                    continue
                if not spec.matches_pool(pool):
                    continue
                if spec.chunk is not None and spec.chunk != chunk:
                    continue
                if spec.count is not None and self._fired_count[idx] >= spec.count:
                    continue
                if spec.p < 1.0 and self._draw_for(idx, point, thread, key) >= spec.p:
                    continue
                self._fired_count[idx] += 1
                out.append(spec)
                kind = KINDS[spec.kind]
                made.append(FiredFault(spec.compact(), spec.kind, point.value, self.rank.rank,
                                       step, rid, thread, fatal=not kind.survivable,
                                       effect=kind.effect(spec).value))
            self.fired.extend(made)
        if self.tracer is not None:  # the records made above, emitted outside the lock
            for f in made:
                self.tracer.emit_durable(Ev.FAULT, kind=f.kind, point=f.point, spec=f.spec,
                                         rid=rid, fatal=f.fatal, effect=f.effect)
        return out

    def write_journal(self) -> None:
        """Write every firing so far to :attr:`journal` (when set), atomically; never raises,
        the fault about to act matters more than its record."""
        if self.journal is None:
            return
        with self._lock:
            text = json.dumps([f.as_dict() for f in self.fired])
        tmp = self.journal.with_name(self.journal.name + ".tmp")
        try:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.journal)
        except OSError:
            pass

    def draw(self, label: str, visit: int) -> float:
        """A seeded uniform number in [0, 1) for value choices inside a fault (e.g. jitter)."""
        return _uniform(f"{self.seed}/{self.rank.rank}/{label}/{visit}")

    def _draw_for(self, idx: int, point: FaultPoint, thread: str, key: str | None) -> float:
        """The draw of this visit (called under the lock): by ``key`` when the visit names
        its object, else by the thread's own count of visits."""
        if key is not None:
            return _uniform(f"{self.seed}/{idx}/{self.rank.rank}/{point.value}/key/{key}")
        counter = (idx, point.value, thread)
        visit = self._visits[counter]
        self._visits[counter] = visit + 1
        return _uniform(f"{self.seed}/{idx}/{self.rank.rank}/{point.value}/{thread}/{visit}")


def _uniform(text: str) -> float:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64
