"""C++ exceptions that end a process: ``std::terminate`` after an uncaught exception.

A gloo or c10 error raised on a background (non-Python) thread never becomes a Python
exception; the C++ runtime prints two lines and aborts the process (SIGABRT, exit -6)::

    terminate called after throwing an instance of 'gloo::EnforceNotMet'
      what():  [enforce fail at .../pair.cc:456] op.preamble.length <= op.nbytes. 47744 vs 35456.

:class:`CppTerminateParser` turns that pair into one :class:`ExceptionRecord` (no frames: the
throwing thread has no Python stack; faulthandler's dump that follows shows the Python threads).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.model.evidence import ExceptionRecord, SourceRef

TRIGGERS = ("terminate called after throwing an instance of", "what():")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']{1,200})'")
_WHAT = re.compile(r"^\s*what\(\):\s*(?P<msg>.*)$")
_MAX_MESSAGE = 2000

Emit = Callable[[ExceptionRecord], None]


class CppTerminateParser:
    """The two-line ``terminate called ...`` / ``what():`` record of one rank stream."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self._type = ""
        self._src: SourceRef | None = None

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = ("terminate called after throwing an instance of",)

    @staticmethod
    def starts(line: str) -> bool:
        return "terminate called after throwing an instance of" in line

    def feed(self, line: str, src: SourceRef) -> bool:
        """Consume a line; False when it does not belong to the record (which is then closed
        without a message)."""
        m = _TERMINATE.search(line)
        if m:
            self.close()
            self.open, self._type, self._src = True, m["type"], src
            return True
        if not self.open:
            return False
        w = _WHAT.match(line)
        if w:  # the record is one statement: cited where it says what failed (the same
            self._src = src  # line a catalog pattern on the message matches)
        self._finish(w["msg"].strip()[:_MAX_MESSAGE] if w else "")
        return w is not None

    def close(self) -> None:
        if self.open:
            self._finish("")

    def _finish(self, message: str) -> None:
        assert self._src is not None  # set whenever the record is open
        self._emit(ExceptionRecord(self._type, message, [], self._src))
        self.open, self._type, self._src = False, "", None
