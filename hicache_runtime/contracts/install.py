"""The import names this distribution installs, and whether another one shadows them.

The top-level folders are the design's (``hicache_runtime``, ``doctor``, ``faults``,
``signatures``, and the modules ``cli`` and ``render``), and the wheel installs them under those
names, not under one namespace: the layout a newcomer reads is the layout that is imported. The
price is that ``doctor``, ``faults``, ``signatures``, ``cli`` and ``render`` are generic names that
another distribution may also install. Python then imports whichever comes first on
``sys.path``, and a ``hicache`` built from two distributions fails far from the cause.

All six names are installed side by side (in site-packages, or the checkout for an editable
install), so each must resolve to the folder ``cli`` resolves to; :func:`shadowed` says which do
not, without importing them. ``hicache`` checks this once at start-up and stops with the paths.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

IMPORT_NAMES = ("hicache_runtime", "doctor", "faults", "signatures", "cli", "render")
"""Every top-level import name the wheel installs (``pyproject.toml``: packages and
py-modules)."""


def _home(name: str) -> Path | None:
    """The folder ``name`` is imported from (a package's parent), or None if it is not found."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        locations = list(spec.submodule_search_locations)
        return Path(locations[0]).resolve().parent if locations else None
    return Path(spec.origin).resolve().parent if spec.origin else None


def shadowed(anchor: str = "cli") -> dict[str, str]:
    """Import names of ours that resolve outside the folder ``anchor`` resolves to, each with
    where it resolves (or ``"not found"``); empty when the install is whole."""
    home = _home(anchor)
    if home is None:
        return {}
    out: dict[str, str] = {}
    for name in IMPORT_NAMES:
        where = _home(name)
        if where != home:
            out[name] = str(where) if where is not None else "not found"
    return out
