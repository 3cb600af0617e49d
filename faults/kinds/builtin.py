"""The built-in fault kinds, each one object: its parameters, its points and what it does
there (the hooks of :class:`~faults.kinds.base.Kind`). Registered on import."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from faults.kinds.base import DEFAULT_LAG_MS, Kind, Param, StepVisit, StorageOp
from faults.kinds.registry import register_kind
from faults.points import FaultPoint
from hicache_runtime.contracts.errors import InjectedFault
from hicache_runtime.contracts.fault_effects import FaultEffect

if TYPE_CHECKING:
    from faults.spec import FaultSpec


class FaultKind(StrEnum):
    """The names of the built-in kinds (a spec's ``kind`` is any registered kind's name)."""

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


COMPUTE_LAG_TOKENS = 1024
"""``compute-lag``'s ``ms`` is per this many tokens a forward computes."""

_P = FaultPoint
_MS = Param("ms", float, "milliseconds", f"{DEFAULT_LAG_MS:g}")
#: crash and hang act on the scheduler thread only: a fault there is seen by the step loop
#: (a bundle with the injected traceback, or a stalled step the watchdog catches).
_SCHEDULER_THREAD = (_P.SCHEDULER_STEP, _P.CACHE_EVENTS, _P.FORWARD)
_POINT = Param("point", FaultPoint, "where it acts",
               choices=tuple(p.value for p in _SCHEDULER_THREAD))


@dataclass(frozen=True)
class StepLag(Kind):
    """Sleeps ``ms`` at a scheduler-thread point; with ``per_tokens``, ``ms`` per that many
    tokens the forward about to run computes."""

    per_tokens: int = 0

    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.LAG

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        scale = visit.tokens / self.per_tokens if self.per_tokens else 1.0
        time.sleep(spec.lag_s * scale)


@dataclass(frozen=True)
class CopyLag(Kind):
    """A slow copy engine: each copy finishes ``ms`` late, or (``hold``) its rank's scheduler
    sees it finished only ``hold`` steps after submitting it. A lag in time hides inside one
    step once steps take longer than it (a loaded machine); a hold in steps reorders the same
    operations however fast the machine runs."""

    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.LAG

    def copy_delay_s(self, spec: FaultSpec) -> float:
        return spec.lag_s

    def copy_hold_steps(self, spec: FaultSpec) -> int:
        return spec.hold or 0


@dataclass(frozen=True)
class StorageShortfall(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.STORAGE_HOLES if spec.shortfall_mode == "holes" \
            else FaultEffect.STORAGE_SHORT

    def shortens_exists(self, spec: FaultSpec, found: int) -> int:
        return max(0, found - (spec.pages or 1))

    def blanks(self, spec: FaultSpec, pages: int) -> range:
        start = spec.at or 0
        return range(min(start, pages), min(pages, start + (spec.pages or 1)))


@dataclass(frozen=True)
class StorageLatency(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.LAG

    def before_storage(self, spec: FaultSpec, op: StorageOp) -> None:
        time.sleep(spec.lag_s)


@dataclass(frozen=True)
class StorageError(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.STORAGE_ERROR

    def before_storage(self, spec: FaultSpec, op: StorageOp) -> None:
        if spec.mode == "raise":
            raise InjectedFault(f"injected storage error: batch_{op} raised "
                                f"({spec.compact()})")

    def fails_storage(self, spec: FaultSpec, op: StorageOp) -> bool:
        return True


@dataclass(frozen=True)
class StorageCorrupt(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.STORAGE_CORRUPT

    def corrupts_reads(self, spec: FaultSpec) -> bool:
        return True


@dataclass(frozen=True)
class ClientAbort(Kind):
    """An abort a client sends, timed at a prefetch batch (``batch=``, any when unset) or
    after a prefill chunk (``chunk=``, matched by the injector)."""

    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.ABORT

    def aborts(self, spec: FaultSpec, *, batch: int | None = None) -> bool:
        return spec.batch is None or batch is None or spec.batch == batch


@dataclass(frozen=True)
class HostAllocFail(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.ALLOC_FAIL

    def fails_alloc(self, spec: FaultSpec) -> bool:
        return True


@dataclass(frozen=True)
class RankKill(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.KILL

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        visit.journal()  # a killed rank reports nothing else of what fired
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Crash(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.CRASH

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        raise InjectedFault(f"injected crash at {visit.point.value} (step {visit.step})")


@dataclass(frozen=True)
class Hang(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.HANG

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        threading.Event().wait()


BUILTIN: tuple[Kind, ...] = (
    StepLag(FaultKind.STAGE_LAG,
            "Sleeps `ms` at the top of each scheduler step on the selected ranks (a slow PP "
            "stage).",
            (_P.SCHEDULER_STEP,), (_MS,), stepped=True),
    CopyLag(FaultKind.DMA_LAG,
            "Delays the completion of each L1<->L2 copy job by `ms` on the selected ranks; "
            "with `hold`, their schedulers see each job finished `hold` steps after submitting "
            "it (the same reordering on a slow machine as on a fast one).",
            (_P.COPY_COMPLETE,),
            (_MS, Param("hold", int, "scheduler steps before a finished copy is seen (instead "
                                     "of ms)", "none")), stepped=True),
    StepLag(FaultKind.COMPUTE_LAG,
            "Slows each forward on the selected ranks by `ms` per 1024 tokens it computes (a "
            "slower accelerator); the dynamic-chunking latency profile's forwards, at "
            "start-up, are step 0.",
            (_P.FORWARD,), (Param("ms", float, "milliseconds per 1024 tokens",
                                  f"{DEFAULT_LAG_MS:g}"),),
            per_tokens=COMPUTE_LAG_TOKENS),
    StorageShortfall(
        FaultKind.STORAGE_SHORTFALL,
        "L3 misses `pages` pages: `mode=short` cuts the tail of an existence answer, "
        "`mode=holes` fails reads of pages from page `at` on while later pages still load.",
        (_P.STORAGE_EXISTS, _P.STORAGE_GET),
        (Param("mode", str, "where the pages miss", "short", ("short", "holes")),
         Param("pages", int, "pages that miss", "1"),
         Param("at", int, "first page that fails (holes), an offset in the batch", "0"),
         Param("pool", str, "which objects miss: K/V pages, hybrid sidecar pages, either",
               "kv", ("kv", "sidecar", "any"))),
        by_mode=MappingProxyType({"short": (_P.STORAGE_EXISTS,),
                                  "holes": (_P.STORAGE_GET,)})),
    StorageLatency(FaultKind.STORAGE_LATENCY,
                   "Adds `ms` to every L3 call on the selected ranks.",
                   (_P.STORAGE_EXISTS, _P.STORAGE_GET, _P.STORAGE_SET), (_MS,)),
    StorageError(FaultKind.STORAGE_ERROR,
                 "Makes L3 reads return nothing and writes report failure, or with "
                 "`mode=raise` makes the calls raise, as a client library that throws would.",
                 (_P.STORAGE_GET, _P.STORAGE_SET),
                 (Param("mode", str, "fail soft, or raise", "fail", ("fail", "raise")),)),
    StorageCorrupt(FaultKind.STORAGE_CORRUPT,
                   "Flips a byte of a page as it is read from L3 (the checksum must catch "
                   "it); `p` is per page read.",
                   (_P.STORAGE_PAGE,)),
    ClientAbort(FaultKind.MID_PREFETCH_ABORT,
                "Aborts the request while its prefetch IO reads batch `batch` (an op of fewer "
                "batches passes without it, the fault still armed); like any client "
                "abort it enters through rank 0 (timed by rank 0's IO thread) and reaches the "
                "other ranks with the next requests. Rank 0 asks for it once every other "
                "rank's IO has finished the op, as when rank 0's storage is the slow one.",
                (_P.PREFETCH_BATCH,),
                (Param("batch", int, "prefetch batch, 0-based", "any batch"),),
                prefetch_rendezvous=True),
    ClientAbort(FaultKind.CHUNKED_ABORT,
                "Aborts the request between two chunks of its chunked prefill, once chunk "
                "`chunk` has run; like any client abort it enters through rank 0 (in the "
                "middle of rank 0's step) and reaches the other ranks with the next step's "
                "requests.",
                (_P.PREFILL_CHUNK,),
                (Param("chunk", int, "the chunk it follows, 0-based (0: between the first and "
                       "the second)", "any chunk"),)),
    HostAllocFail(FaultKind.HOST_ALLOC_FAIL,
                  "Makes host (L2) page allocation fail on the selected ranks.",
                  (_P.HOST_ALLOC,), stepped=True),
    RankKill(FaultKind.RANK_KILL,
             "Kills the selected rank's process with SIGKILL at the selected step.",
             (_P.SCHEDULER_STEP,), survivable=False, stepped=True),
    Crash(FaultKind.CRASH,
          "Raises `InjectedFault` at `point` on the scheduler thread.",
          _SCHEDULER_THREAD, (_POINT,), point_param=True, survivable=False, stepped=True),
    Hang(FaultKind.HANG,
         "Blocks forever at `point` on the scheduler thread; the watchdog must catch it.",
         _SCHEDULER_THREAD, (_POINT,), point_param=True, survivable=False, stepped=True),
)

for _kind in BUILTIN:
    register_kind(_kind)
if {k.name for k in BUILTIN} != set(FaultKind):  # a bug here, not input
    raise RuntimeError("every built-in fault kind name has exactly one kind object")
