"""``hicache faults list``: the fault kinds, their parameters and selectors, and the fault
points, described from the code that defines them (the kind registry ``faults.kinds.KINDS``,
the one-line docstrings of :class:`~faults.points.FaultPoint` members and the ``FaultSpec``
field descriptions), so the listing cannot drift from what ``--fault`` accepts. The README's
fault table is :func:`markdown_table`, held to it by ``tests/test_single_source.py``.
"""

from __future__ import annotations

import ast
import inspect
import itertools
from enum import Enum
from functools import cache

from pydantic import BaseModel

from faults import points
from faults.kinds import KINDS, Kind, crashable_points
from faults.points import FaultPoint
from faults.spec import FaultSpec

SYNTAX = "kind[:key=value,...]  (several: repeat --fault, or join specs with ';')"
SELECTORS = ("rank", "tp", "pp", "rid", "steps", "p", "count")

#: Selectors whose command-line form the field description does not show.
SELECTOR_FORM = {"steps": "inclusive scheduler-step range: steps=10-20, or step=12",
                 "p": "probability per opportunity (default 1)"}


class ParamInfo(BaseModel):
    name: str
    description: str


class KindInfo(BaseModel):
    kind: str
    summary: str
    params: list[ParamInfo]
    point: str | None
    """The fault point it acts at; None when it is chosen by a parameter or spans several."""
    points: list[str]
    """Every fault point where it may act."""


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
    point_doc = _member_docs(points, FaultPoint)
    kinds = [KindInfo(kind=k, summary=e.does,
                      params=[ParamInfo(name=p.name, description=p.describe())
                              for p in sorted(e.params, key=lambda p: p.name)],
                      point=e.fixed_point.value if e.fixed_point else None,
                      points=[p.value for p in e.points])
             for k, e in KINDS.items()]
    fields = FaultSpec.model_fields
    selectors = [ParamInfo(name=s, description=SELECTOR_FORM.get(s, fields[s].description or ""))
                 for s in SELECTORS]
    pts = [PointInfo(point=p.value, summary=_point_summary(point_doc.get(p.name, ""), p),
                     crashable=p in crashable_points()) for p in FaultPoint]
    return FaultListing(syntax=SYNTAX, kinds=kinds, selectors=selectors, points=pts)


def markdown_table() -> str:
    """The README's fault table: one row per kind, from ``KINDS``."""
    rows = ["| kind | parameters | acts at | what it does |", "|---|---|---|---|"]
    for entry in KINDS.values():
        params = "<br>".join(f"`{p.name}` {p.describe()}" for p in entry.params) or "-"
        rows.append(f"| `{entry.name}` | {params} | {_acts_at(entry)} | {entry.does} |")
    return "\n".join(rows)


def _acts_at(entry: Kind) -> str:
    if entry.point_param:
        return "`point`: " + ", ".join(f"`{p.value}`" for p in entry.points)
    if entry.by_mode:
        return ", ".join(f"`{p.value}` ({mode})" for mode, pts in entry.by_mode.items()
                         for p in pts)
    return ", ".join(f"`{p.value}`" for p in entry.points)


def _point_summary(doc: str, point: FaultPoint) -> str:
    """A point's docstring and the kinds that act there."""
    kinds = [k for k, e in KINDS.items() if point in e.points]
    return f"{doc.rstrip('.')} ({', '.join(kinds)})." if kinds else doc


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
