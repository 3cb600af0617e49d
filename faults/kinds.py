"""Every fault kind, stated once.

``KINDS`` holds, per kind, what it does (one sentence), the parameters it takes (type, default,
meaning, accepted values) and the fault points where it acts. Everything else reads it:
``faults.spec`` validates specs against it, ``faults.injector`` arms fault points from it,
``hicache faults list`` (``faults.describe``) prints it, and ``tests/test_single_source.py``
holds the README's fault table to it. Adding a kind means one entry here plus the runtime code
that acts on it at its points.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from faults.points import FaultPoint


class FaultKind(str, Enum):
    """The faults we know how to inject; ``KINDS`` says what each one does."""

    STAGE_LAG = "stage-lag"
    DMA_LAG = "dma-lag"
    COMPUTE_LAG = "compute-lag"
    STORAGE_SHORTFALL = "storage-shortfall"
    STORAGE_LATENCY = "storage-latency"
    STORAGE_ERROR = "storage-error"
    STORAGE_CORRUPT = "storage-corrupt"
    MID_PREFETCH_ABORT = "mid-prefetch-abort"
    CHUNKED_ABORT = "chunked-abort"
    HOST_ALLOC_FAIL = "host-alloc-fail"
    RANK_KILL = "rank-kill"
    CRASH = "crash"
    HANG = "hang"


@dataclass(frozen=True)
class Param:
    """One kind-specific parameter of a fault spec (the ``ms`` of ``dma-lag:ms=30``)."""

    name: str
    """The key in the compact form; also the ``FaultSpec`` field that holds it."""
    type: type
    meaning: str
    default: str | None = None
    """What an unset parameter means, as shown to users; None when it must be given."""
    choices: tuple[str, ...] = ()
    """The only values it accepts; empty when any value of its type (within the field's
    bounds) is accepted."""

    def describe(self) -> str:
        """One line: type or accepted values, default or "required", meaning."""
        if self.choices:
            accepts = "one of " + ", ".join(self.choices)
        else:
            accepts = "point" if self.type is FaultPoint else self.type.__name__
        default = "required" if self.default is None else f"default {self.default}"
        return f"{accepts}, {default}: {self.meaning}"


@dataclass(frozen=True)
class KindEntry:
    """Everything the project states about one fault kind."""

    kind: FaultKind
    does: str
    """What it does, in one sentence."""
    points: tuple[FaultPoint, ...]
    """Every fault point where it may act."""
    params: tuple[Param, ...] = ()
    by_mode: Mapping[str, tuple[FaultPoint, ...]] = field(default_factory=dict)
    """When set, ``mode`` narrows ``points``: a spec acts only at its mode's points."""
    point_param: bool = False
    """A spec names one of ``points`` with ``point=`` and acts only there."""
    survivable: bool = True
    """False for the faults that are the failure itself (a crash, a hang, a dead rank): the
    fixed protocols cannot stay healthy under them, so no campaign expects them to."""

    def param(self, name: str) -> Param:
        """The parameter called ``name``; KeyError when this kind takes none."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.kind.value} takes no {name}")

    def acts_at(self, mode: str | None = None,
                point: FaultPoint | None = None) -> frozenset[FaultPoint]:
        """The points a spec of this kind with this ``mode`` and ``point`` acts at."""
        if self.point_param:
            return frozenset({point} if point in self.points else ())
        if self.by_mode:
            return frozenset(self.by_mode[mode or self.param("mode").default or ""])
        return frozenset(self.points)

    @property
    def fixed_point(self) -> FaultPoint | None:
        """The one point every spec of this kind acts at; None when parameters choose it or
        it spans several."""
        if self.point_param or self.by_mode or len(self.points) != 1:
            return None
        return self.points[0]


DEFAULT_LAG_MS = 20.0
"""The lag of a lag-type fault without ``ms=``."""
COMPUTE_LAG_TOKENS = 1024
"""``compute-lag``'s ``ms`` is per this many tokens a forward computes."""

_P = FaultPoint
_MS = Param("ms", float, "milliseconds", f"{DEFAULT_LAG_MS:g}")
#: crash and hang act on the scheduler thread only: a fault there is seen by the step loop
#: (a bundle with the injected traceback, or a stalled step the watchdog catches).
_SCHEDULER_THREAD = (_P.SCHEDULER_STEP, _P.CACHE_EVENTS, _P.FORWARD)


def _kinds(*entries: KindEntry) -> Mapping[FaultKind, KindEntry]:
    table = {e.kind: e for e in entries}
    missing = set(FaultKind) - set(table)
    if missing:  # an import-time failure: a kind without an entry is a bug here, not input
        raise RuntimeError(f"fault kinds without an entry: {sorted(k.value for k in missing)}")
    return MappingProxyType(table)


KINDS: Mapping[FaultKind, KindEntry] = _kinds(
    KindEntry(FaultKind.STAGE_LAG,
              "Sleeps `ms` at the top of each scheduler step on the selected ranks (a slow "
              "PP stage).",
              (_P.SCHEDULER_STEP,), (_MS,)),
    KindEntry(FaultKind.DMA_LAG,
              "Delays the completion of each L1<->L2 copy job by `ms` on the selected ranks.",
              (_P.COPY_COMPLETE,), (_MS,)),
    KindEntry(FaultKind.COMPUTE_LAG,
              "Slows each forward on the selected ranks by `ms` per 1024 tokens it computes "
              "(a slower accelerator); the dynamic-chunking latency profile's forwards, at "
              "start-up, are step 0.",
              (_P.FORWARD,), (Param("ms", float, "milliseconds per 1024 tokens",
                                    f"{DEFAULT_LAG_MS:g}"),)),
    KindEntry(FaultKind.STORAGE_SHORTFALL,
              "L3 misses `pages` pages: `mode=short` cuts the tail of an existence answer, "
              "`mode=holes` fails reads of pages from page `at` on while later pages still "
              "load.",
              (_P.STORAGE_EXISTS, _P.STORAGE_GET),
              (Param("mode", str, "where the pages miss", "short", ("short", "holes")),
               Param("pages", int, "pages that miss", "1"),
               Param("at", int, "first page that fails (holes), an offset in the batch", "0"),
               Param("pool", str, "which objects miss: K/V pages, hybrid sidecar pages, either",
                     "kv", ("kv", "sidecar", "any"))),
              by_mode={"short": (_P.STORAGE_EXISTS,), "holes": (_P.STORAGE_GET,)}),
    KindEntry(FaultKind.STORAGE_LATENCY,
              "Adds `ms` to every L3 call on the selected ranks.",
              (_P.STORAGE_EXISTS, _P.STORAGE_GET, _P.STORAGE_SET), (_MS,)),
    KindEntry(FaultKind.STORAGE_ERROR,
              "Makes L3 reads return nothing and writes report failure, or with `mode=raise` "
              "makes the calls raise, as a client library that throws would.",
              (_P.STORAGE_GET, _P.STORAGE_SET),
              (Param("mode", str, "fail soft, or raise", "fail", ("fail", "raise")),)),
    KindEntry(FaultKind.STORAGE_CORRUPT,
              "Flips bytes in pages as they are read from L3 (the checksum must catch it).",
              (_P.STORAGE_GET,)),
    KindEntry(FaultKind.MID_PREFETCH_ABORT,
              "Aborts the request while its prefetch IO reads batch `batch`; like any client "
              "abort it enters through rank 0 (timed by rank 0's IO thread) and reaches the "
              "other ranks with the next requests. Rank 0 asks for it once every other rank's "
              "IO has finished the op, as when rank 0's storage is the slow one.",
              (_P.PREFETCH_BATCH,),
              (Param("batch", int, "prefetch batch, 0-based", "any batch"),)),
    KindEntry(FaultKind.CHUNKED_ABORT,
              "Aborts the request between two chunks of its chunked prefill, once chunk "
              "`chunk` has run; like any client abort it enters through rank 0 (in the middle "
              "of rank 0's step) and reaches the other ranks with the next step's requests.",
              (_P.PREFILL_CHUNK,),
              (Param("chunk", int, "the chunk it follows, 0-based (0: between the first and "
                     "the second)", "any chunk"),)),
    KindEntry(FaultKind.HOST_ALLOC_FAIL,
              "Makes host (L2) page allocation fail on the selected ranks.",
              (_P.HOST_ALLOC,)),
    KindEntry(FaultKind.RANK_KILL,
              "Kills the selected rank's process with SIGKILL at the selected step.",
              (_P.SCHEDULER_STEP,), survivable=False),
    KindEntry(FaultKind.CRASH,
              "Raises `InjectedFault` at `point` on the scheduler thread.",
              _SCHEDULER_THREAD,
              (Param("point", FaultPoint, "where it acts",
                     choices=tuple(p.value for p in _SCHEDULER_THREAD)),),
              point_param=True, survivable=False),
    KindEntry(FaultKind.HANG,
              "Blocks forever at `point` on the scheduler thread; the watchdog must catch it.",
              _SCHEDULER_THREAD,
              (Param("point", FaultPoint, "where it acts",
                     choices=tuple(p.value for p in _SCHEDULER_THREAD)),),
              point_param=True, survivable=False),
)

PARAM_NAMES: frozenset[str] = frozenset(p.name for e in KINDS.values() for p in e.params)
"""Every kind-specific parameter name (each is a ``FaultSpec`` field)."""

CRASHABLE_POINTS: frozenset[FaultPoint] = frozenset(KINDS[FaultKind.CRASH].points)
"""Points a ``crash`` or ``hang`` fault may name with ``point=``."""

SURVIVABLE: frozenset[FaultKind] = frozenset(k for k, e in KINDS.items() if e.survivable)
"""Kinds the fixed protocols must survive (every property campaign covers them)."""
