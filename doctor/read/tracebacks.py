"""Python tracebacks, line by line: most recent call last, chained causes, exception groups.

:class:`TracebackParser` is fed one (prefix-stripped) line at a time by the log scanner and
emits one :class:`ExceptionRecord` per exception, frames innermost first. It understands

* ``Traceback (most recent call last):`` anywhere in a line (SGLang prints it after
  ``Scheduler hit an exception: ``), ``File "...", line N, in func`` frames, code and ``^^^^``
  caret lines, ``[Previous line repeated N more times]``;
* chains: ``During handling of the above exception...`` (``context``) and ``The above exception
  was the direct cause...`` (``cause``) tag the exception that follows;
* exception groups (3.11+): the ``+-+---- 1 ----`` / ``|`` box is stripped and every member
  becomes a record tagged ``group``.

It never raises; a block that stops looking like a traceback is closed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.evidence import ExceptionRecord, Frame, SourceRef

HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d{1,9}), in (?P<func>.+?)\s*$')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:::\w+)*)(?::\s?(?P<msg>.*))?$")
_BOX = re.compile(r"^\s*(?:[|+](?:-+\+?)*(?: |$))+")
_SEPARATOR = re.compile(r"^-+(?: \d+ -+| \.\.\.)?-*$|^\.\.\. and \d+ more exception")
_CONTEXT = "During handling of the above exception, another exception occurred:"
_CAUSE = "The above exception was the direct cause of the following exception:"
MAX_FRAMES = 200
_MAX_NOISE = 20
_MAX_MESSAGE = 2000

Emit = Callable[[ExceptionRecord], None]


class TracebackParser:
    """One open traceback stream (one per rank prefix in an interleaved log)."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self._frames: list[Frame] = []
        self._in_tb = False
        self._group = False
        self._pending = ""
        self._noise = 0

    @staticmethod
    def starts(line: str) -> bool:
        return HEADER in line

    def feed(self, line: str, src: SourceRef) -> bool:
        """Consume one line; returns False when the line does not belong to this traceback
        (the block is then closed and the caller may try other parsers on the line)."""
        if HEADER in line:
            self._begin("Exception Group" in line)
            return True
        if not self.open:
            return False
        text = _BOX.sub("", line) if self._group else line
        stripped = text.strip()
        if self._structural(text, stripped, src):
            self._noise = 0
            return True
        self._noise += 1
        if self._noise > (2 if not self._in_tb else _MAX_NOISE):
            self.close()
            return False
        return True

    def close(self) -> None:
        self.open = False
        self._in_tb = False
        self._frames = []

    def _begin(self, group: bool) -> None:
        if not self.open:
            self._group = group
        self._group = self._group or group
        self.open = True
        self._in_tb = True
        self._frames = []
        self._noise = 0

    def _structural(self, text: str, stripped: str, src: SourceRef) -> bool:
        m = _FRAME.match(text)
        if m and self._in_tb:
            if len(self._frames) < MAX_FRAMES:
                self._frames.append(Frame(m["func"], m["file"], int(m["line"])))
            return True
        if stripped in (_CONTEXT, _CAUSE):
            self._pending = "context" if stripped == _CONTEXT else "cause"
            return True
        if not stripped:
            return True
        if self._group and _SEPARATOR.match(stripped):
            self._in_tb, self._frames = True, []
            return True
        if self._in_tb and (text.startswith("    ") or stripped.startswith("[Previous line")):
            return True
        if self._in_tb and not text[:1].isspace():
            return self._exception(stripped, src)
        return False

    def _exception(self, stripped: str, src: SourceRef) -> bool:
        m = _EXC.match(stripped)
        if not m or (m["msg"] is None and not stripped[:1].isupper()):
            return False
        chain = self._pending or ("group" if self._group else "")
        self._pending = ""
        msg = (m["msg"] or "").strip()[:_MAX_MESSAGE]
        self._emit(ExceptionRecord(type=m["type"], message=msg,
                                   frames=list(reversed(self._frames)), source=src, chain=chain))
        self._frames = []
        self._in_tb = self._group  # a group may carry more members without a new header
        if not self._group:
            self._noise = 0
        return True
