"""What a fault kind is: one object holding its parameters, where it acts, and what it does
there.

The runtime's fault points ask the kinds of the specs that fired through the hooks below,
never by name: the scheduler thread calls :meth:`Kind.on_step`, the copy engine
:meth:`Kind.copy_delay_s`, the host pool :meth:`Kind.fails_alloc`, the storage wrapper the
``storage`` hooks, the prefetch IO thread :meth:`Kind.aborts`. A hook a kind does not override
does nothing, so a new kind overrides only what it changes. Its :meth:`Kind.effect` goes into
the fault event, which is how the doctor reads what it did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from faults.points import FaultPoint
from hicache_runtime.contracts.fault_effects import FaultEffect

if TYPE_CHECKING:
    from faults.spec import FaultSpec

DEFAULT_LAG_MS = 20.0
"""The lag of a lag-type fault without ``ms=``."""


@dataclass(frozen=True)
class Param:
    """One kind-specific parameter of a fault spec (the ``ms`` of ``dma-lag:ms=30``). Its
    name is one of the ``FaultSpec`` parameter fields (``faults.spec.PARAM_FIELDS``)."""

    name: str
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
class StepVisit:
    """A visit of a scheduler-thread fault point (``scheduler.step``, ``model.forward``,
    ``cache.events``)."""

    point: FaultPoint
    step: int
    tokens: int = 0
    """What the forward about to run computes (``model.forward``; 0 elsewhere)."""
    journal: Callable[[], None] = lambda: None
    """Writes this rank's firings to disk now: for a fault that ends the process with no
    chance to report them."""


StorageOp = str
"""``exists``, ``get`` or ``set``."""


@dataclass(frozen=True)
class Kind:
    """One fault kind. Subclasses override the hooks of the points it acts at."""

    name: str
    does: str
    """What it does, in one sentence."""
    points: tuple[FaultPoint, ...]
    """Every fault point where it may act."""
    params: tuple[Param, ...] = ()
    by_mode: Mapping[str, tuple[FaultPoint, ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    """When set, ``mode`` narrows ``points``: a spec acts only at its mode's points."""
    point_param: bool = False
    """A spec names one of ``points`` with ``point=`` and acts only there."""
    survivable: bool = True
    """False for the faults that are the failure itself (a crash, a hang, a dead rank): the
    fixed protocols cannot stay healthy under them, so no campaign expects them to."""
    stepped: bool = False
    """Its firings carry a meaningful scheduler step, so shrinking may pin it with
    ``steps=``."""
    prefetch_rendezvous: bool = False
    """It times itself on the peers' prefetch IO (``faults.rendezvous``)."""

    def __post_init__(self) -> None:
        # A built-in passes its FaultKind member: keep the plain name (messages, keys, JSON).
        object.__setattr__(self, "name", str(self.name))

    # --- what it is -----------------------------------------------------------------------

    def param(self, name: str) -> Param:
        """The parameter called ``name``; KeyError when this kind takes none."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} takes no {name}")

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

    def effect(self, spec: FaultSpec) -> FaultEffect:
        """What a firing of ``spec`` does, as the fault event says it to the doctor."""
        raise NotImplementedError(f"fault kind {self.name} states no effect")

    # --- what it does, per point (defaults: nothing) ---------------------------------------

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        """At a scheduler-thread point: sleep, raise, block or end the process."""

    def copy_delay_s(self, spec: FaultSpec) -> float:
        """At ``copy.complete``: seconds an L1<->L2 copy's completion is delayed."""
        return 0.0

    def copy_hold_steps(self, spec: FaultSpec) -> int:
        """At ``copy.complete``, asked at submission: scheduler steps before the rank's
        scheduler may see the copy finished."""
        return 0

    def fails_alloc(self, spec: FaultSpec) -> bool:
        """At ``host.alloc``: whether the host pool refuses the pages."""
        return False

    def before_storage(self, spec: FaultSpec, op: StorageOp) -> None:
        """At ``storage.*``, before the call: sleep, or raise as a client library would."""

    def fails_storage(self, spec: FaultSpec, op: StorageOp) -> bool:
        """At ``storage.get``/``storage.set``: whether the call fails soft without touching
        the medium (reads miss, writes report failure)."""
        return False

    def corrupts_reads(self, spec: FaultSpec) -> bool:
        """At ``storage.page``: whether one byte of the page just read is flipped before its
        checksum is checked."""
        return False

    def shortens_exists(self, spec: FaultSpec, found: int) -> int:
        """At ``storage.exists``: the leading count the caller sees, given what the store
        holds."""
        return found

    def blanks(self, spec: FaultSpec, pages: int) -> range:
        """At ``storage.get``: the offsets in a batch of ``pages`` that come back as misses
        while the others load."""
        return range(0)

    def aborts(self, spec: FaultSpec, *, batch: int | None = None) -> bool:
        """At ``prefetch.batch`` (``batch``: the 0-based batch about to be read) and
        ``prefill.chunk``: whether the request is aborted here."""
        return False
