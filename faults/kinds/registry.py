"""The fault kinds by name: the built-ins (``builtin.py``) and any registered at run time.

A kind registered here is a kind everywhere: fault specs accept it (``faults.spec``), the
injector arms its points, ``hicache faults list`` prints it, and the fault points act on it
through its hooks. Registration is per process: a kind used in a multi-rank run must be
registered where each rank process imports its module too.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from types import MappingProxyType

from faults.kinds.base import Kind
from faults.points import FaultPoint

_KINDS: dict[str, Kind] = {}
_lock = threading.Lock()

KINDS: Mapping[str, Kind] = MappingProxyType(_KINDS)
"""Every kind by name, in registration order (a live, read-only view)."""

_NAME_RE = re.compile(r"[a-z][a-z0-9-]{0,39}")


def register_kind(kind: Kind, *, replace: bool = False) -> Kind:
    """Add ``kind`` under its name and return it. Raises ``ValueError`` for a malformed name
    (lowercase letters, digits and '-', at most 40), a name taken (unless ``replace``), a
    kind without points, or one that states no effect."""
    if not _NAME_RE.fullmatch(kind.name):
        raise ValueError(f"a fault kind's name is lowercase letters, digits and '-' (at most "
                         f"40, starting with a letter), got {kind.name!r}")
    if not kind.points:
        raise ValueError(f"fault kind {kind.name} acts at no point")
    if type(kind).effect is Kind.effect:
        raise ValueError(f"fault kind {kind.name} states no effect (Kind.effect): the doctor "
                         "reads a fault by what it did")
    with _lock:
        if kind.name in _KINDS and not replace:
            raise ValueError(f"fault kind {kind.name} is already registered")
        _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    """Remove a kind registered at run time (tests, embedding code); a built-in stays."""
    from faults.kinds.builtin import FaultKind

    if name in set(FaultKind):
        raise ValueError(f"{name} is a built-in fault kind")
    with _lock:
        _KINDS.pop(name, None)


def survivable() -> frozenset[str]:
    """Kinds the fixed protocols must survive (every property campaign covers them)."""
    return frozenset(name for name, k in KINDS.items() if k.survivable)


def crashable_points() -> frozenset[FaultPoint]:
    """Points a kind that names its point (``point=``: ``crash``, ``hang``) may name."""
    return frozenset(p for k in KINDS.values() if k.point_param for p in k.points)
