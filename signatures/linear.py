"""Regular expressions that run in time linear in their input, by construction.

The catalog's patterns (log patterns, exception templates, frame and file rules, upstream
markers) are matched against untrusted text: any log, traceback or dump someone attaches. A
backtracking engine (Python's ``re``) can take exponential time on a pattern with nested or
overlapping repetition, and quadratic time on many ordinary ones when ``search`` retries every
start position; a 96-byte line stalled such a reader for minutes. Every catalog pattern is
therefore compiled with RE2 (Google's automaton engine: time linear in the input, memory
bounded by the pattern), which refuses what it cannot run in linear time: backreferences and
lookaround. :func:`linear` is the one way a catalog pattern is compiled, and the catalog model
refuses a pattern :func:`linear` cannot compile.

RE2's ``\\w``, ``\\d`` and ``\\s`` are ASCII; catalog patterns match identifiers, paths and
English messages, which are.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import re2

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # RE2 would print every refused pattern on stderr
_INLINE = ((re.IGNORECASE, "i"), (re.DOTALL, "s"), (re.MULTILINE, "m"))


class UnsafePattern(ValueError):
    """A pattern RE2 cannot run in linear time (backreferences, lookaround) or cannot parse."""


@functools.lru_cache(maxsize=8192)
def linear(pattern: str, flags: int = 0) -> Any:
    """``pattern`` compiled for linear-time matching (an RE2 regexp with the ``re`` methods:
    ``search``, ``match``, ``fullmatch``, ``finditer``, ``sub``; match objects with
    ``group``, ``groupdict``, ``span``). ``flags`` may be ``re.I``, ``re.S``, ``re.M``.
    Raises :class:`UnsafePattern` saying why RE2 refused it."""
    inline = "".join(c for bit, c in _INLINE if flags & bit)
    try:
        return re2.compile(f"(?{inline}){pattern}" if inline else pattern, _OPTIONS)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(
            exc.args[0], bytes) else str(exc)
        raise UnsafePattern(f"{pattern[:120]!r} cannot be matched in linear time ({why}); "
                            "rewrite it without backreferences or lookaround") from None


class PatternSet:
    """Which of several patterns a text matches, in one linear pass (an RE2 set) instead of
    one search per pattern."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = list(patterns)
        self._set = re2.Set.SearchSet(_OPTIONS)
        for p in self.patterns:
            try:
                self._set.Add(p)
            except re2.error:
                raise UnsafePattern(f"{p[:120]!r} cannot be matched in linear time") from None
        self._set.Compile()

    def found(self, text: str) -> list[int]:
        """Indices (into :attr:`patterns`) of the patterns ``text`` matches."""
        return self._set.Match(text) or []


def any_of(literals: tuple[str, ...] | list[str]) -> str:
    """A pattern matching any of ``literals`` (an entry of a :class:`PatternSet`)."""
    return "|".join(re.escape(lit) for lit in literals)
