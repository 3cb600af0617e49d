"""Fault specs: what to inject, where, to whom, how often.

A spec is a pydantic model and also has a compact string form that fits on a command line::

    stage-lag:pp=1,ms=30
    host-alloc-fail:tp=1,steps=20-60,p=0.5
    storage-shortfall:rank=1,mode=holes,pages=2,at=1
    mid-prefetch-abort:rid=req-0*,batch=1
    crash:point=scheduler.step,step=12

Selectors (``rank``, ``tp``, ``pp``, ``rid``, ``steps``) narrow where a fault may act; ``p`` and
``count`` say how often. Every random draw comes from the run seed (see ``faults.injector``), so a
run with the same seed and specs replays exactly. The kinds, and the parameters each one takes,
are ``faults.kinds.KINDS``; validation here reads them from there.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from faults.kinds import DEFAULT_LAG_MS, KINDS, FaultKind
from faults.points import FaultPoint
from hicache_runtime.contracts.errors import InvalidFaultSpec, nearest, validation_problem


class FaultSpec(BaseModel):
    """One fault to inject. Unset selectors match everything."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    kind: str
    """A registered kind's name (``faults.kinds.KINDS``; the built-ins: ``FaultKind``)."""
    rank: int | None = Field(None, ge=0, description="global rank")
    tp: int | None = Field(None, ge=0, description="tensor-parallel rank")
    pp: int | None = Field(None, ge=0, description="pipeline stage")
    rid: str | None = Field(None, description="request id glob, e.g. 'req-1*'")
    steps: tuple[int, int] | None = Field(None, description="inclusive scheduler-step range")
    p: float = Field(1.0, ge=0.0, le=1.0, description="probability per opportunity")
    count: int | None = Field(None, ge=1, description="fire at most this many times per rank")
    # Kind-specific parameters: which kinds take which, their defaults and what they mean are
    # stated in ``faults.kinds.KINDS``; the fields only bound the values.
    ms: float | None = Field(None, ge=0.0)
    mode: str | None = None
    pages: int | None = Field(None, ge=1)
    at: int | None = Field(None, ge=0)
    batch: int | None = Field(None, ge=0)
    chunk: int | None = Field(None, ge=0)
    point: FaultPoint | None = None
    pool: str | None = None
    hold: int | None = Field(None, ge=1, le=1_000_000)

    @field_validator("kind")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in KINDS:
            raise ValueError(_unknown_kind(name))
        return str(name)

    @field_validator("steps")
    @classmethod
    def _steps_ordered(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and (v[0] < 0 or v[1] < v[0]):
            raise ValueError(f"step range {v[0]}-{v[1]} is empty or negative")
        return v

    @model_validator(mode="after")
    def _params_fit_kind(self) -> FaultSpec:
        problem = _param_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    # --- derived values ---------------------------------------------------------------------

    @property
    def lag_s(self) -> float:
        """The lag in seconds for lag-type faults (default 20 ms)."""
        return (self.ms if self.ms is not None else DEFAULT_LAG_MS) / 1000.0

    @property
    def shortfall_mode(self) -> str:
        """``storage-shortfall``'s mode, its default when unset."""
        return self.mode or KINDS[FaultKind.STORAGE_SHORTFALL].param("mode").default or ""

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
        for name in ("ms", "hold", "mode", "pages", "at", "batch", "chunk", "pool"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}")
        if self.point is not None:
            parts.append(f"point={self.point.value}")
        return self.kind + (":" + ",".join(parts) if parts else "")


PARAM_FIELDS = ("ms", "hold", "mode", "pages", "at", "batch", "chunk", "point", "pool")
"""The kind-specific parameter fields: a kind's ``Param`` names one of them, and says what it
means for that kind."""

_PAIR_RE = re.compile(r"^\s*([a-z_]+)\s*=\s*(.*?)\s*$")


MAX_SPEC_CHARS = 1024
"""Longest compact spec: a real one is a few dozen characters; specs come from files too."""


SELECTORS = ("rank", "tp", "pp", "rid", "step", "steps", "p", "count")
"""The keys every kind takes (``step=N`` is short for ``steps=N-N``)."""


def parse_fault(text: str) -> FaultSpec:
    """Parse the compact form ``kind[:key=value,...]`` into a :class:`FaultSpec`.

    Raises :class:`InvalidFaultSpec` naming every problem at once, each with the part as the
    user wrote it (quoted, bounded): an unknown key or value with the nearest valid one, a key
    given twice, a key with no value; the hint lists the keys the kind takes.
    """
    if not isinstance(text, str):
        raise InvalidFaultSpec(f"a fault spec is a string like 'dma-lag:ms=20', not "
                               f"{type(text).__name__}")
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidFaultSpec(f"{_quote(text)}: a fault spec is at most {MAX_SPEC_CHARS} "
                               "characters")
    head, _, tail = text.strip().partition(":")
    kind = _kind(head.strip())
    keys = (*SELECTORS, *(p.name for p in KINDS[kind].params))
    fields: dict[str, Any] = {"kind": kind}
    problems: list[str] = []
    seen: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in tail.split(","))):
        m = _PAIR_RE.match(part)
        if not m:
            problems.append(f"expected key=value, got {_quote(part)}")
            continue
        key, value = m.group(1), m.group(2)
        field = "steps" if key == "step" else key
        if field in seen:
            problems.append(f"{_quote(seen[field])} and {_quote(part)} set {field} twice")
            continue
        seen[field] = part
        problem = _pair_problem(kind, keys, key, value)
        if problem:
            problems.append(problem)
        elif key == "step":
            fields["steps"] = (int(value), int(value))
        elif key == "steps":
            lo, _, hi = value.partition("-")
            fields["steps"] = (int(lo), int(hi))
        else:
            fields[key] = value
    if problems:
        raise InvalidFaultSpec(f"{_quote(text)}: " + "; ".join(problems),
                               hint=f"{kind} takes {', '.join(keys)} "
                                    "(hicache faults list says what each means)")
    return _validate(fields, text)


def _kind(name: str) -> str:
    if name not in KINDS:
        raise InvalidFaultSpec(_unknown_kind(name), hint=f"known kinds: {', '.join(KINDS)}")
    return name


def _unknown_kind(name: str) -> str:
    return f"unknown fault kind {_quote(name)}{_nearest(name, list(KINDS))}"


def _pair_problem(kind: str, keys: tuple[str, ...], key: str, value: str) -> str | None:
    """What is wrong with one ``key=value`` of a ``kind`` spec, before the model sees it."""
    if key not in keys:
        return f"{kind} has no key {_quote(key)}{_nearest(key, keys)}"
    if not value:
        return f"{key}= has no value"
    if key == "step" and not (value.isdigit() and len(value) <= 18):
        return f"step= takes one step like 12 (a range is steps=10-20), got {_quote(value)}"
    if key == "steps":
        lo, sep, hi = value.partition("-")
        if not (sep and lo.isdigit() and hi.isdigit() and len(lo) <= 18 and len(hi) <= 18):
            return f"steps= takes a range like 10-20, got {_quote(value)}"
    if key == "point":
        acts = KINDS[kind].param("point").choices
        if value not in acts:
            return (f"{kind} cannot act at {_quote(value)}{_nearest(value, acts)} "
                    f"(it acts at {_either(acts)})")
    return None


def _nearest(word: str, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest valid word, or nothing."""
    close = nearest(word, valid)
    return f"; did you mean {close!r}?" if close else ""


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
        problems = []
        for err in exc.errors():
            where, msg = validation_problem(err)
            got = fields.get(str(err["loc"][0])) if err["loc"] else None
            shown = f"{where}={_quote(str(got), 40)[1:-1]}" if got is not None else where
            problems.append(f"{shown}: {msg}" if where else msg)
        raise InvalidFaultSpec(f"{_quote(text)}: " + "; ".join(problems)) from None


def _param_problem(spec: FaultSpec) -> str | None:
    """What makes a spec's kind-specific parameters wrong for its kind (per ``KINDS``)."""
    entry = KINDS[spec.kind]
    allowed = {p.name for p in entry.params}
    extra = {f for f in PARAM_FIELDS if getattr(spec, f) is not None} - allowed
    if extra:
        names = ", ".join(sorted(allowed)) or "none"
        return f"{spec.kind} takes no {', '.join(sorted(extra))} (it takes: {names})"
    if spec.hold is not None and spec.ms is not None:
        return f"{spec.kind} lags in time (ms) or in steps (hold), not both"
    for param in entry.params:
        value = getattr(spec, param.name)
        if value is None:
            if param.default is None:
                return f"{spec.kind} needs {param.name}=<one of {'|'.join(param.choices)}>"
            continue
        shown = value.value if isinstance(value, Enum) else value
        if param.choices and shown not in param.choices:
            if param.type is FaultPoint:
                return f"{spec.kind} cannot act at {shown}"
            return (f"{spec.kind} {param.name} must be {_either(param.choices)}, "
                    f"not {shown!r}")
    return None


def _either(choices: tuple[str, ...]) -> str:
    return " or ".join(choices) if len(choices) < 3 else (
        ", ".join(choices[:-1]) + f" or {choices[-1]}")
