"""L3 backend names: which values ``storage.backend`` may take, and the class each one names.

Three sources, by precedence: names registered at run time (:func:`register`: tests, embedding
code), the built-in backends (:data:`BUILTIN`), and plug-ins that installed distributions declare
as entry points in the group :data:`ENTRY_POINT_GROUP` (value ``package.module:Class``), e.g.
in the plug-in's ``pyproject.toml``::

    [project.entry-points."hicache.l3_backends"]
    dictstore = "dictstore_plugin:DictBackend"

Only names and ``module:Class`` strings live here, torch-free, and entry points are read only
when a name is neither registered nor built in. :func:`load` imports the class a name stands
for: the config does so to check ``storage.url`` with the backend's own rule
(:func:`url_problem`), cheap since backend modules import their client libraries lazily; a
plug-in's module is imported when a config names it. ``hicache_runtime.l3.registry`` builds a
rank's backend from the class.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

from hicache_runtime.contracts.errors import ConfigError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "hicache.l3_backends"


class StorageFormat(str, Enum):
    """``storage.format``: how pages are stored (``l3/formats.py``)."""

    ENVELOPE = "envelope"
    """A checksummed envelope around a self-describing page payload (the default)."""
    UPSTREAM = "upstream"
    """The raw page bytes SGLang's file backend writes."""


NO_BACKEND = "none"
"""``storage.backend`` for no L3; never a backend's name."""

BUILTIN: Mapping[str, str] = MappingProxyType({
    "file": "hicache_runtime.l3.backends.file:FileBackend",
    "redis": "hicache_runtime.l3.backends.redis:RedisBackend",
    "mooncake": "hicache_runtime.l3.backends.mooncake:MooncakeBackend",
})

#: A backend name: what a config file, a command line or a plug-in may spell. Bounded, since
#: names come from files and bundles and end up in messages.
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_TARGET_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

_registered: dict[str, str] = {}
_lock = threading.Lock()


def register(name: str, target: str) -> None:
    """Register ``"package.module:ClassName"`` under ``name``; it replaces a built-in or plug-in
    of that name. Raises ``ValueError`` for a malformed name or target."""
    if not _NAME_RE.fullmatch(name) or name == NO_BACKEND:
        raise ValueError(f"a backend name is lowercase letters, digits, '.', '_' or '-' (at "
                         f"most 64) and not {NO_BACKEND!r}, got {name!r}")
    if not _TARGET_RE.fullmatch(target):
        raise ValueError(f"backend target must look like 'module:Class', got {target!r}")
    with _lock:
        _registered[name] = target


def known() -> list[str]:
    """Every backend name, sorted (plug-ins included)."""
    return sorted(_table(with_plugins=True))


def problem(name: str) -> str | None:
    """Why ``name`` is not a backend (unknown, listing the known ones; or a plug-in whose entry
    point does not name a class), or None. Imports nothing."""
    return _problem(name, _lookup(name))


def target(name: str) -> str:
    """The ``module:Class`` that ``name`` stands for.

    Raises :class:`ConfigError` (field ``storage.backend``) when :func:`problem` finds one.
    """
    found = _lookup(name)
    message = _problem(name, found)
    if message is not None or found is None:
        raise ConfigError("storage.backend", message or f"unknown L3 backend {name!r}")
    return found


def load(name: str) -> Any:
    """The backend class ``name`` stands for, imported now (a backend module imports its
    client library lazily, so this is cheap and torch-free).

    Raises :class:`ConfigError` (field ``storage.backend``) for an unknown name and for a
    backend whose module or class cannot be loaded.
    """
    found = target(name)
    module, _, attr = found.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("storage.backend", f"L3 backend {name!r} ({found}) cannot be "
                          f"loaded: {exc}") from exc


def url_problem(name: str, url: str | None) -> str | None:
    """What is wrong with ``storage.url`` for backend ``name`` (the backend's own check:
    ``StorageBackend.url_problem``), or None. A missing URL is a problem only for a backend
    whose server only the user may name (``url_required``)."""
    cls = load(name)
    if url is None:
        if getattr(cls, "url_required", False):
            example = getattr(cls, "url_example", "") or "a URL"
            return f"the {name} backend needs its server's URL ({example})"
        return None
    problem: str | None = cls.url_problem(url)
    return problem


def _lookup(name: str) -> str | None:
    """The target of ``name``; entry points are read only for a name not found otherwise."""
    found = _table(with_plugins=False).get(name)
    if found is None and _NAME_RE.fullmatch(name):
        found = _table(with_plugins=True).get(name)
    return found


def _problem(name: str, found: str | None) -> str | None:
    if found is None:
        shown = name if len(name) <= 64 else name[:61] + "..."
        return (f"unknown L3 backend {shown!r} (known: {', '.join(known())}; "
                f"{NO_BACKEND} for no L3)")
    if not _TARGET_RE.fullmatch(found):
        return (f"the plug-in L3 backend {name!r} names {found!r}, not 'module:Class' (entry "
                f"point group {ENTRY_POINT_GROUP})")
    return None


def _table(*, with_plugins: bool) -> dict[str, str]:
    table = _plugins() if with_plugins else {}
    table.update(BUILTIN)
    with _lock:
        table.update(_registered)
    return table


def _plugins() -> dict[str, str]:
    """Entry points of installed distributions, read now: a distribution installed while the
    process runs (or a directory put on ``sys.path``) is seen at the next lookup."""
    from importlib.metadata import entry_points

    found: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if not _NAME_RE.fullmatch(ep.name) or ep.name == NO_BACKEND:
            log.warning("ignoring L3 backend entry point %r (%s): not a backend name",
                        ep.name[:80], ep.value[:120])
        elif ep.name in BUILTIN:
            log.warning("ignoring L3 backend entry point %r (%s): a built-in backend has "
                        "that name", ep.name, ep.value[:120])
        else:  # a value may end in "[extras]"; the target is what precedes it
            found.setdefault(ep.name, ep.value.partition("[")[0].strip())
    return found
