"""Fault specs: what to inject, where, to whom, how often.

A spec is a pydantic model and also has a compact string form that fits on a command line::

    stage-lag:pp=1,ms=30
    host-alloc-fail:tp=1,steps=20-60,p=0.5
    storage-shortfall:rank=1,mode=holes,pages=2,at=1
    mid-prefetch-abort:rid=req-0*,batch=1
    crash:point=scheduler.step,step=12

Selectors (``rank``, ``tp``, ``pp``, ``rid``, ``steps``) narrow where a fault may act; ``p`` and
``count`` say how often. Every random draw comes from the run seed (see ``faults.injector``), so a
run with the same seed and specs replays exactly.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from faults.points import CRASHABLE_POINTS, FaultPoint
from hicache_runtime.contracts.errors import InvalidFaultSpec


class FaultKind(str, Enum):
    """The faults we know how to inject. One line per member says what it does."""

    STAGE_LAG = "stage-lag"
    """Sleep ``ms`` at the top of each scheduler step on the selected ranks (a slow PP stage)."""
    DMA_LAG = "dma-lag"
    """Delay completion of each L1<->L2 copy job by ``ms`` on the selected ranks."""
    STORAGE_SHORTFALL = "storage-shortfall"
    """L3 misses ``pages`` pages: ``mode=short`` cuts the tail of an existence answer,
    ``mode=holes`` fails reads of pages starting at page ``at`` while later pages still load.
    ``pool`` picks which objects miss: ``kv`` (default), ``sidecar`` (hybrid sidecar pools),
    or ``any``."""
    STORAGE_LATENCY = "storage-latency"
    """Add ``ms`` to every L3 call on the selected ranks."""
    STORAGE_ERROR = "storage-error"
    """Make L3 calls fail (reads return nothing, writes report failure); ``mode=raise`` makes
    them raise instead, as a client library that throws would."""
    STORAGE_CORRUPT = "storage-corrupt"
    """Flip bytes in pages as they are read from L3 (the checksum must catch it)."""
    MID_PREFETCH_ABORT = "mid-prefetch-abort"
    """Abort the request while its prefetch IO reads batch ``batch`` (0-based). Like any client
    abort it enters through rank 0 (timed by rank 0's IO thread) and reaches the other ranks
    with the next requests, wherever their own prefetch IO is by then."""
    HOST_ALLOC_FAIL = "host-alloc-fail"
    """Make host (L2) page allocation fail on the selected ranks."""
    RANK_KILL = "rank-kill"
    """Kill the selected rank's process with SIGKILL at the selected step."""
    CRASH = "crash"
    """Raise ``InjectedFault`` at ``point`` (a scheduler-thread point)."""
    HANG = "hang"
    """Block forever at ``point`` (a scheduler-thread point); the watchdog must catch it."""


#: The fault point each kind acts at (``crash``/``hang`` take it from ``point=``).
KIND_POINT: dict[FaultKind, FaultPoint | None] = {
    FaultKind.STAGE_LAG: FaultPoint.SCHEDULER_STEP,
    FaultKind.DMA_LAG: FaultPoint.COPY_COMPLETE,
    FaultKind.STORAGE_SHORTFALL: None,  # exists (short) or get (holes), decided by mode
    FaultKind.STORAGE_LATENCY: None,  # every storage point
    FaultKind.STORAGE_ERROR: None,  # get and set
    FaultKind.STORAGE_CORRUPT: FaultPoint.STORAGE_GET,
    FaultKind.MID_PREFETCH_ABORT: FaultPoint.PREFETCH_BATCH,
    FaultKind.HOST_ALLOC_FAIL: FaultPoint.HOST_ALLOC,
    FaultKind.RANK_KILL: FaultPoint.SCHEDULER_STEP,
    FaultKind.CRASH: None,
    FaultKind.HANG: None,
}

#: Kind-specific parameters each kind accepts.
_KIND_PARAMS: dict[FaultKind, frozenset[str]] = {
    FaultKind.STAGE_LAG: frozenset({"ms"}),
    FaultKind.DMA_LAG: frozenset({"ms"}),
    FaultKind.STORAGE_SHORTFALL: frozenset({"mode", "pages", "at", "pool"}),
    FaultKind.STORAGE_LATENCY: frozenset({"ms"}),
    FaultKind.STORAGE_ERROR: frozenset({"mode"}),
    FaultKind.STORAGE_CORRUPT: frozenset(),
    FaultKind.MID_PREFETCH_ABORT: frozenset({"batch"}),
    FaultKind.HOST_ALLOC_FAIL: frozenset(),
    FaultKind.RANK_KILL: frozenset(),
    FaultKind.CRASH: frozenset({"point"}),
    FaultKind.HANG: frozenset({"point"}),
}
_PARAM_FIELDS = frozenset({"ms", "mode", "pages", "at", "batch", "point", "pool"})
_DEFAULT_LAG_MS = 20.0


class FaultSpec(BaseModel):
    """One fault to inject. Unset selectors match everything."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    kind: FaultKind
    rank: int | None = Field(None, ge=0, description="global rank")
    tp: int | None = Field(None, ge=0, description="tensor-parallel rank")
    pp: int | None = Field(None, ge=0, description="pipeline stage")
    rid: str | None = Field(None, description="request id glob, e.g. 'req-1*'")
    steps: tuple[int, int] | None = Field(None, description="inclusive scheduler-step range")
    p: float = Field(1.0, ge=0.0, le=1.0, description="probability per opportunity")
    count: int | None = Field(None, ge=1, description="fire at most this many times per rank")
    ms: float | None = Field(None, ge=0.0)
    mode: str | None = None
    pages: int | None = Field(None, ge=1)
    at: int | None = Field(None, ge=0)
    batch: int | None = Field(None, ge=0)
    point: FaultPoint | None = None
    pool: str | None = None

    @field_validator("steps")
    @classmethod
    def _steps_ordered(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and (v[0] < 0 or v[1] < v[0]):
            raise ValueError(f"step range {v[0]}-{v[1]} is empty or negative")
        return v

    @model_validator(mode="after")
    def _params_fit_kind(self) -> FaultSpec:
        allowed = _KIND_PARAMS[self.kind]
        given = {f for f in _PARAM_FIELDS if getattr(self, f) is not None}
        extra = given - allowed
        if extra:
            names = ", ".join(sorted(allowed)) or "none"
            raise ValueError(
                f"{self.kind.value} takes no {', '.join(sorted(extra))} (it takes: {names})"
            )
        if self.kind is FaultKind.STORAGE_SHORTFALL and self.mode not in (None, "short", "holes"):
            raise ValueError(f"storage-shortfall mode must be short or holes, not {self.mode!r}")
        if self.kind is FaultKind.STORAGE_ERROR and self.mode not in (None, "fail", "raise"):
            raise ValueError(f"storage-error mode must be fail or raise, not {self.mode!r}")
        if self.pool not in (None, "kv", "sidecar", "any"):
            raise ValueError(f"pool must be kv, sidecar or any, not {self.pool!r}")
        if self.kind in (FaultKind.CRASH, FaultKind.HANG):
            if self.point is None:
                raise ValueError(f"{self.kind.value} needs point=<one of {_crashable()}>")
            if self.point not in CRASHABLE_POINTS:
                raise ValueError(f"{self.kind.value} cannot act at {self.point.value}")
        return self

    # --- derived values ---------------------------------------------------------------------

    @property
    def lag_s(self) -> float:
        """The lag in seconds for lag-type faults (default 20 ms)."""
        return (self.ms if self.ms is not None else _DEFAULT_LAG_MS) / 1000.0

    @property
    def shortfall_mode(self) -> str:
        return self.mode or "short"

    def matches_rank(self, rank: int, tp: int, pp: int) -> bool:
        """True when the rank selectors admit this rank."""
        return (
            (self.rank is None or self.rank == rank)
            and (self.tp is None or self.tp == tp)
            and (self.pp is None or self.pp == pp)
        )

    def matches_request(self, rid: str | None) -> bool:
        if self.rid is None:
            return True
        return rid is not None and fnmatch.fnmatchcase(rid, self.rid)

    def matches_pool(self, pool: str | None) -> bool:
        """Storage faults: whether this spec targets objects of ``pool`` ("kv" or a sidecar
        pool's name); None (not a storage call) always matches."""
        if pool is None or self.pool == "any":
            return True
        return (pool == "kv") == (self.pool in (None, "kv"))

    def matches_step(self, step: int) -> bool:
        return self.steps is None or self.steps[0] <= step <= self.steps[1]

    def compact(self) -> str:
        """The compact string form; ``parse_fault(spec.compact()) == spec``."""
        parts: list[str] = []
        for name in ("rank", "tp", "pp", "rid"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value}")
        if self.steps is not None:
            parts.append(f"steps={self.steps[0]}-{self.steps[1]}")
        if self.p != 1.0:
            parts.append(f"p={self.p:g}")
        if self.count is not None:
            parts.append(f"count={self.count}")
        for name in ("ms", "mode", "pages", "at", "batch", "pool"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
        if self.point is not None:
            parts.append(f"point={self.point.value}")
        return self.kind.value + (":" + ",".join(parts) if parts else "")


_PAIR_RE = re.compile(r"^\s*([a-z_]+)\s*=\s*(.*?)\s*$")


MAX_SPEC_CHARS = 1024
"""Longest compact spec: a real one is a few dozen characters; specs come from files too."""


def parse_fault(text: str) -> FaultSpec:
    """Parse the compact form ``kind[:key=value,...]`` into a :class:`FaultSpec`.

    Raises :class:`InvalidFaultSpec` with the offending part named (quoted, bounded).
    """
    if not isinstance(text, str):
        raise InvalidFaultSpec(f"a fault spec is a string like 'dma-lag:ms=20', not "
                               f"{type(text).__name__}")
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidFaultSpec(f"{_quote(text)}: a fault spec is at most {MAX_SPEC_CHARS} "
                               "characters")
    head, _, tail = text.strip().partition(":")
    try:
        kind = FaultKind(head.strip())
    except ValueError:
        known = ", ".join(k.value for k in FaultKind)
        raise InvalidFaultSpec(
            f"unknown fault kind {_quote(head.strip())}", hint=f"known kinds: {known}"
        ) from None
    fields: dict[str, Any] = {"kind": kind}
    for part in filter(None, (p.strip() for p in tail.split(","))):
        m = _PAIR_RE.match(part)
        if not m:
            raise InvalidFaultSpec(f"{_quote(text)}: expected key=value, got {_quote(part)}")
        key, value = m.group(1), m.group(2)
        if key == "step":
            key, value = "steps", f"{value}-{value}"
        if key == "steps":
            lo, sep, hi = value.partition("-")
            if not sep or not lo.isdigit() or not hi.isdigit() or len(lo) > 18 or len(hi) > 18:
                raise InvalidFaultSpec(f"{_quote(text)}: steps must look like 10-20, got "
                                       f"{_quote(value)}")
            fields["steps"] = (int(lo), int(hi))
        else:
            fields[key] = value
    return _validate(fields, text)


def parse_faults(texts: list[str]) -> list[FaultSpec]:
    """Parse several compact specs; each may also hold several separated by ``;``."""
    out: list[FaultSpec] = []
    for text in texts:
        if not isinstance(text, str):
            raise InvalidFaultSpec(f"a fault spec is a string like 'dma-lag:ms=20', not "
                                   f"{type(text).__name__}")
        out.extend(parse_fault(t) for t in text.split(";") if t.strip())
    return out


def check_topology(specs: Iterable[FaultSpec], tp: int, pp: int) -> str | None:
    """What makes a spec unable to fire in a ``tp`` x ``pp`` run (a rank, TP rank or stage
    it does not have), or None. A fault that can never fire would leave a run "healthy"
    while testing nothing."""
    world = tp * pp
    for spec in specs:
        for name, value, size, what in (("rank", spec.rank, world, "rank"),
                                        ("tp", spec.tp, tp, "TP rank"),
                                        ("pp", spec.pp, pp, "pipeline stage")):
            if value is not None and value >= size:
                return (f"{spec.compact()}: {name}={value}, but the run has {size} {what}"
                        f"{'s' if size > 1 else ''} ({_span(size)})")
    return None


def _span(size: int) -> str:
    return "only 0" if size == 1 else f"0-{size - 1}"


def _quote(text: str, limit: int = 80) -> str:
    """A spec quoted in an error: bounded, one line (specs come from files too)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return repr(text)


def _validate(fields: dict[str, Any], text: str) -> FaultSpec:
    try:
        return FaultSpec.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "spec"
        raise InvalidFaultSpec(f"{_quote(text)}: {where}: {err['msg']}") from None


def _crashable() -> str:
    return "|".join(sorted(p.value for p in CRASHABLE_POINTS))
