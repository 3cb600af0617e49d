"""The one error hierarchy of the project.

Every error we raise on purpose derives from :class:`HiCacheError`. The subclasses say whose
fault it is: the user's (bad configuration, bad input), the environment's (a backend that is
down, a missing tool), or ours (a broken invariant inside the runtime). User-facing errors also
derive from the matching builtin (``ValueError``...) so callers that only know the builtins still
catch them.

``cli.py`` catches :class:`HiCacheError` once, at the top, and prints a one-line message with the
``hint``; nothing below it formats errors for humans.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


class HiCacheError(Exception):
    """Root of every error this project raises on purpose.

    ``hint`` is one sentence telling the user what to try next; it is shown under the message.
    """

    hint: str = ""

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        if hint:
            self.hint = hint


# --- user errors: fix the input -------------------------------------------------------------


class ConfigError(HiCacheError, ValueError):
    """A configuration value is invalid. ``field`` names it (dotted path); ``shown`` is how the
    user named it, when that differs (the command-line flag that set it)."""

    def __init__(self, field: str, message: str, *, hint: str = "",
                 shown: str | None = None) -> None:
        super().__init__(f"{shown or field}: {message}", hint=hint)
        self.field = field


class InvalidFaultSpec(HiCacheError, ValueError):
    """A fault spec (model or compact string) cannot be parsed or names an unknown fault."""


class BundleNotWritten(HiCacheError):
    """A crash bundle could not be written (a full disk, a read-only directory): what was
    written of it is removed, so no folder without a manifest looks like a bundle."""


class DumpFormatError(HiCacheError, ValueError):
    """An input artifact (bundle, dump, log) is malformed; the doctor reports it and goes on."""


# --- environment errors: fix the surroundings ----------------------------------------------


class StorageUnavailable(HiCacheError, ConnectionError):
    """The L3 backend cannot be reached or used (server down, path unwritable)."""


class CorruptPage(HiCacheError, ValueError):
    """An L3 page failed its integrity check (checksum, length, magic) or does not fit the
    reader's KV layout. Storage code treats it as a miss and counts it; it is never served as KV.
    """


class ToolUnavailable(HiCacheError, RuntimeError):
    """An external tool we rely on (py-spy, redis-server) is missing or not permitted."""


# --- runtime failures: what the runtime itself detects --------------------------------------


class InvariantViolation(HiCacheError, RuntimeError):
    """A bookkeeping invariant of the tree or a pool broke (double free, lock underflow...).

    This is a bug in the runtime or an injected legacy behaviour, never a user error.
    """

    at_drain: bool = False
    """Raised by the end-of-run check (:func:`~hicache_runtime.cache.accounting.check_at_drain`):
    what the rank still holds is what leaked, not what a step in flight held."""


class DoubleAllocation(InvariantViolation):
    """A pool handed out a page that was already in use ("Double-alloc detected")."""


class DoubleFree(InvariantViolation):
    """A pool was asked to free a page that was already free ("Double-free detected")."""


class WorkerDied(InvariantViolation):
    """A background thread (prefetch, backup) raised; its exception is chained."""


class ResourceLeak(HiCacheError, MemoryError):
    """A resource the runtime should bound keeps growing (pending sends, reservations); raised
    by a guard before the process would be OOM-killed."""


class StepStalled(HiCacheError, RuntimeError):
    """The step watchdog saw no scheduler progress for longer than its timeout (a hang)."""


class RankDivergence(HiCacheError, RuntimeError):
    """The rank consensus check found ranks that took different decisions."""


class InjectedFault(HiCacheError, RuntimeError):
    """Raised at a fault point by an injected ``raise``/``rank-kill``-style fault."""


# --- one validation error, as a message says it ---------------------------------------------

_FIELD_LIMIT, _MSG_LIMIT = 80, 400


def printable(text: str, limit: int = 160) -> str:
    """``text`` safe to print on one terminal line: control characters (newlines included)
    shown escaped, the length cut at ``limit``."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def nearest(word: str, valid: Iterable[str]) -> str | None:
    """The valid word closest to a mistyped ``word`` (a key, a switch, a choice), if any is
    close enough to suggest."""
    close = difflib.get_close_matches(word, list(valid), n=1, cutoff=0.6)
    return close[0] if close else None


_QUOTED = re.compile(r"'([^']{1,80})'")


def validation_problem(err: Mapping[str, Any], prefix: str = "") -> tuple[str, str]:
    """One pydantic validation error as ``(where, what)``: the dotted field path (after
    ``prefix``, empty when the error is about the whole input) and the message without
    pydantic's ``Value error,`` lead-in, each printable and bounded (a field name or value
    that came from an untrusted file may be long, or hold control characters)."""
    where = ".".join(str(p) for p in (prefix, *err.get("loc", ())) if p != "")
    what = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    given, expected = err.get("input"), (err.get("ctx") or {}).get("expected")
    if err.get("type") in ("enum", "literal_error") and isinstance(given, str) \
            and isinstance(expected, str):  # a choice mistyped: name the closest one
        close = nearest(given[:80], _QUOTED.findall(expected[:2000]))
        what += f"; did you mean {close!r}?" if close else ""
    return printable(" ".join(where.split()), _FIELD_LIMIT), printable(what, _MSG_LIMIT)


def first_problem(exc: ValidationError, prefix: str = "") -> tuple[str, str]:
    """:func:`validation_problem` of the first error ``exc`` holds."""
    return validation_problem(exc.errors()[0], prefix)
