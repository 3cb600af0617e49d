"""``hicache faults list``: the fault kinds, their parameters and selectors, and the fault
points, described from the code that defines them (the one-line docstrings of
:class:`~faults.spec.FaultKind` and :class:`~faults.points.FaultPoint` members, the
``FaultSpec`` field descriptions and the per-kind parameter table), so the listing cannot drift
from what ``--fault`` accepts.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from enum import Enum
from functools import cache

from pydantic import BaseModel

from faults import points, spec
from faults.points import CRASHABLE_POINTS, FaultPoint
from faults.spec import KIND_POINT, FaultKind, FaultSpec

SYNTAX = "kind[:key=value,...]  (several: repeat --fault, or join specs with ';')"
SELECTORS = ("rank", "tp", "pp", "rid", "steps", "p", "count")

#: Selectors whose command-line form the field description does not show.
SELECTOR_FORM = {"steps": "inclusive scheduler-step range: steps=10-20, or step=12",
                 "p": "probability per opportunity (default 1)"}

#: What each kind-specific parameter means (the spec's fields carry no description).
PARAM_HELP = {
    "ms": "milliseconds (default 20)",
    "mode": "short | holes (storage-shortfall); fail | raise (storage-error)",
    "pages": "pages that miss",
    "at": "first page that fails (holes)",
    "batch": "prefetch batch, 0-based",
    "point": "|".join(sorted(p.value for p in CRASHABLE_POINTS)),
    "pool": "kv | sidecar | any",
}


class ParamInfo(BaseModel):
    name: str
    description: str


class KindInfo(BaseModel):
    kind: str
    summary: str
    params: list[ParamInfo]
    point: str | None
    """The fault point it acts at; None when it is chosen by a parameter or spans several."""


class PointInfo(BaseModel):
    point: str
    summary: str
    crashable: bool
    """A ``crash`` or ``hang`` fault may name it with ``point=``."""


class FaultListing(BaseModel):
    """``hicache faults list --json``."""

    syntax: str
    kinds: list[KindInfo]
    selectors: list[ParamInfo]
    points: list[PointInfo]


def describe_faults() -> FaultListing:
    kind_doc = _member_docs(spec, FaultKind)
    point_doc = _member_docs(points, FaultPoint)
    kinds = [KindInfo(kind=k.value, summary=kind_doc.get(k.name, ""),
                      params=[ParamInfo(name=p, description=PARAM_HELP.get(p, ""))
                              for p in sorted(spec._KIND_PARAMS[k])],
                      point=KIND_POINT[k].value if KIND_POINT.get(k) else None)
             for k in FaultKind]
    fields = FaultSpec.model_fields
    selectors = [ParamInfo(name=s, description=SELECTOR_FORM.get(s, fields[s].description or ""))
                 for s in SELECTORS]
    pts = [PointInfo(point=p.value, summary=point_doc.get(p.name, ""),
                     crashable=p in CRASHABLE_POINTS) for p in FaultPoint]
    return FaultListing(syntax=SYNTAX, kinds=kinds, selectors=selectors, points=pts)


@cache
def _member_docs(module: object, enum: type[Enum]) -> dict[str, str]:
    """The docstring under each member of ``enum`` (a string statement right after its
    assignment), whitespace folded; read from the module's source."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    docs: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == enum.__name__:
            body = node.body
            for stmt, nxt in itertools.pairwise(body):
                if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                        and isinstance(stmt.targets[0], ast.Name)
                        and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str)):
                    text = " ".join(nxt.value.value.split()).replace("``", "`")
                    docs[stmt.targets[0].id] = text
    return docs
