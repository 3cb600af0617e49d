"""Which inputs belong to one incident.

A directory that holds several crash bundles (``hicache-bundles/``, where every run leaves
one) is several incidents: their ranks, faults and outcomes have nothing to do with each other
and must never be read as one job. :func:`split_incidents` finds the bundle roots (directories
whose ``manifest.json`` is a regular file) among the inputs; when there are two or more, each is
an incident of its own, newest first by the time its manifest records, and whatever else was
given (loose logs, dumps, archives) is one more incident. With at most one bundle, everything
given is one incident, as before.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hicache_runtime.contracts.run_files import MANIFEST

MAX_DEPTH = 4
"""How deep below an input directory bundle roots are looked for."""
MAX_BUNDLES = 1000
MAX_MANIFEST_HEAD = 1 << 16
"""Only the head of a manifest is read for its time (the whole one is read by the doctor)."""


@dataclass
class Incident:
    """The inputs of one incident: a bundle root, or the loose inputs."""

    paths: list[str]
    bundle: str | None = None
    created_at: str = ""
    others: list[str] = field(default_factory=list)


def _is_bundle(path: Path) -> bool:
    try:
        return stat.S_ISREG((path / MANIFEST).lstat().st_mode)
    except OSError:
        return False


def _created_at(root: Path) -> str:
    """The manifest's ``created_at`` (ISO time, sorts as text), or ``""``."""
    try:
        with open(root / MANIFEST, "rb") as fh:
            head = fh.read(MAX_MANIFEST_HEAD)
        value = json.loads(head).get("created_at", "") if len(head) < MAX_MANIFEST_HEAD else ""
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def _bundles_under(root: Path, depth: int, out: list[Path]) -> list[Path]:
    """Bundle roots under ``root``; the other files and directories found on the way."""
    loose: list[Path] = []
    if len(out) >= MAX_BUNDLES:
        return loose
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return [root]
    for p in entries:
        try:
            mode = p.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode):
            if _is_bundle(p):
                out.append(p)
            elif depth < MAX_DEPTH:
                loose += _bundles_under(p, depth + 1, out)
            else:
                loose.append(p)
        else:
            loose.append(p)
    return loose


def split_incidents(paths: list[str]) -> list[Incident]:
    """The incidents the inputs hold (see the module docstring); one when they hold at most
    one bundle."""
    bundles: list[Path] = []
    loose: list[str] = []
    for arg in paths:
        p = Path(arg)
        try:
            is_dir = arg != "-" and stat.S_ISDIR(p.stat().st_mode)
        except OSError:
            is_dir = False
        if not is_dir or _is_bundle(p):
            if is_dir:
                bundles.append(p)
            else:
                loose.append(arg)
            continue
        found: list[Path] = []
        rest = _bundles_under(p, 1, found)
        if not found:
            loose.append(arg)  # no bundle in it: read it whole, as any directory
            continue
        bundles += found
        loose += [str(x) for x in rest]
    if len(bundles) <= 1:
        return [Incident(list(paths))]
    incidents = [Incident([str(b)], bundle=str(b), created_at=_created_at(b)) for b in bundles]
    incidents.sort(key=lambda i: (i.created_at, i.bundle or ""), reverse=True)
    if loose:
        incidents.append(Incident(loose))
    return incidents
