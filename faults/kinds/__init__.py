"""Every fault kind, each one object holding its parameters, its points and its behaviour.

``base.py`` says what a kind is (:class:`Kind`, its :class:`Param` and the hooks the runtime's
fault points call), ``registry.py`` keeps them by name (:data:`KINDS`, :func:`register_kind`),
``builtin.py`` holds the built-in ones (their names: :class:`FaultKind`). Everything else reads
the registry: ``faults.spec`` validates specs, ``faults.injector`` arms fault points and
records each firing's effect, the runtime acts through the hooks, ``hicache faults list``
(``faults.describe``) prints the kinds and ``tests/test_single_source.py`` holds the README's
fault table to them. Adding a kind is one object and one :func:`register_kind` call.
"""

from faults.kinds.base import DEFAULT_LAG_MS, Kind, Param, StepVisit, StorageOp
from faults.kinds.builtin import COMPUTE_LAG_TOKENS, FaultKind
from faults.kinds.registry import (
    KINDS,
    crashable_points,
    register_kind,
    survivable,
    unregister_kind,
)

__all__ = ["COMPUTE_LAG_TOKENS", "DEFAULT_LAG_MS", "KINDS", "FaultKind", "Kind", "Param",
           "StepVisit", "StorageOp", "crashable_points", "register_kind", "survivable",
           "unregister_kind"]
