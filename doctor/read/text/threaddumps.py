"""Thread dumps in text: faulthandler (most recent call FIRST) and ``py-spy dump`` text.

Both parsers are fed prefix-stripped lines by the log scanner and emit one
:class:`ThreadStack` per thread, frames innermost first (both formats already print them
that way).

faulthandler::

    Fatal Python error: Segmentation fault

    Current thread 0x00007fc593084b80 (most recent call first):
      File "/.../ctypes/__init__.py", line 519 in string_at

py-spy (``--native`` adds ``clock_nanosleep (libc.so.6)`` frames without a line; ``--locals``
adds indented ``Arguments:``/``Locals:`` blocks, skipped here); pasted as a fragment it may have
no ``Process``/``Thread`` header and any indentation: a run of ``func (file.py:123)`` lines is
one thread::

    Process 6481: /usr/bin/python3 /srv/hung_rank.py
    Python v3.11.7 (/usr/bin/python3.11)

    Thread 6481 (idle): "MainThread"
        all_reduce_stub (hung_rank.py:8)
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.model.evidence import Frame, SourceRef, ThreadStack

Emit = Callable[[ThreadStack], None]
MAX_FRAMES = 200

_FH_FATAL = re.compile(r"Fatal Python error: (?P<what>[^\n]+)")
_FH_THREAD = re.compile(r"^(?P<cur>Current thread|Thread) (?P<tid>0x[0-9a-fA-F]+)"
                        r"(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):")
_FH_STACK = re.compile(r"^Stack \(most recent call first\):")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d{1,9}|\?\?\?) in '
                       r'(?P<func>.*?)\s*$')
_FH_SKIP = re.compile(r"^(\s+<no Python frame>|Extension modules:|Python runtime state:|"
                      r"Timeout \(\d+:\d\d:\d\d(?:\.\d+)?\)!|\s+\.\.\.|\s*$)")

_FH_FRAME_ANY = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d{1,9}|\?\?\?) in '
                           r'(?P<func>[^\s,]+)\s*$')
_PS_PROCESS = re.compile(r"^Process (?P<pid>\d{1,9}): ")
_PS_PYTHON = re.compile(r"^Python v\d")
_PS_THREAD = re.compile(r'^\s*Thread (?P<tid>0x[0-9a-fA-F]+|\d{1,12}) \((?P<state>[^)]*)\)'
                        r'(?:: "(?P<name>.*)")?\s*$')
_PS_FRAME = re.compile(r"^\s*(?P<func>[^\s()][^()]{0,300}?) \((?P<loc>[^()]*)\)\s*$")
#: A frame that is a py-spy frame on its face (a Python file and line): it opens a fragment.
_PS_PY_FRAME = re.compile(r"^\s*(?P<func>[\w.<>\[\]-]{1,300}) "
                          r"\((?P<loc>[^()\s]*\.py:\d{1,9})\)\s*$")


class FaulthandlerParser:
    """One faulthandler dump; ``starts`` says whether a line opens one."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self._fatal: str | None = None
        self._fatal_src: SourceRef | None = None
        self._fatal_owned = False
        self._thread: ThreadStack | None = None

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = ("Fatal Python error:", "(most recent call first):", "Timeout (", 'File "')

    @staticmethod
    def starts(line: str) -> bool:
        return ("Fatal Python error:" in line or "(most recent call first):" in line
                or line.startswith("Timeout (")
                or ('File "' in line and bool(_FH_FRAME_ANY.match(line))))

    def feed(self, line: str, src: SourceRef) -> bool:
        m = _FH_FATAL.search(line)
        if m:
            self.close()
            self.open, self._fatal = True, m["what"].strip()
            self._fatal_src, self._fatal_owned = src, False
            return True
        m = _FH_THREAD.match(line.lstrip()) or _FH_STACK.match(line.lstrip())
        if m:
            self._flush()
            self.open = True
            cur = bool(m.groupdict().get("cur") == "Current thread") or "tid" not in m.groupdict()
            self._thread = ThreadStack(
                name=(m.groupdict().get("name") or ""), tid=m.groupdict().get("tid") or "?",
                frames=[], source=src, origin="faulthandler", current=cur,
                fatal=self._fatal if cur else None)
            self._fatal_owned |= cur
            return True
        if not self.open:
            if not _FH_FRAME_ANY.match(line):
                return False
            # frames pasted without their thread header: one thread of unknown identity
            self.open = True
            self._thread = ThreadStack(name="", tid="?", frames=[], source=src,
                                       origin="faulthandler")
        m = _FH_FRAME.match(line) or _FH_FRAME_ANY.match(line)
        if m and self._thread is not None:
            if len(self._thread.frames) < MAX_FRAMES:
                ln = m["line"]
                self._thread.frames.append(
                    Frame(m["func"], m["file"], int(ln) if ln.isdigit() else None))
            return True
        if _FH_SKIP.match(line):
            return True
        self.close()
        return False

    def close(self) -> None:
        self._flush()
        if self._fatal is not None and not self._fatal_owned and self._fatal_src is not None:
            # The signal hit a thread without a Python stack (a C++ abort on a gloo or NCCL
            # thread): no thread is "Current", so the fatal error gets a frameless thread of
            # its own; the rank table then shows what the Python threads were doing.
            self._emit(ThreadStack(name="(native thread)", tid="native", frames=[],
                                   source=self._fatal_src, origin="faulthandler", current=True,
                                   fatal=self._fatal))
        self.open = False
        self._fatal, self._fatal_src, self._fatal_owned = None, None, False

    def _flush(self) -> None:
        if self._thread is not None:
            self._emit(self._thread)
            self._thread = None


class PySpyTextParser:
    """One ``py-spy dump`` text block (possibly several processes with ``--subprocesses``)."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self.pid: int | None = None
        self._thread: ThreadStack | None = None

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = ("Process ", "Python v", "Thread ", ".py:")

    @staticmethod
    def starts(line: str) -> bool:
        # a literal each pattern needs first: `in` is a fast scan, while a pattern that
        # opens with `^\s*` walks a long blank line once per pattern
        return bool(_PS_PROCESS.match(line) or _PS_PYTHON.match(line)
                    or ("Thread " in line and _PS_THREAD.match(line))
                    or (".py:" in line and _PS_PY_FRAME.match(line)))

    def feed(self, line: str, src: SourceRef) -> bool:
        m = _PS_PROCESS.match(line)
        if m:
            self._flush()
            self.open, self.pid = True, int(m["pid"])
            return True
        if _PS_PYTHON.match(line):
            self.open = True
            return True
        if not self.open:
            if not (_PS_THREAD.match(line) or _PS_PY_FRAME.match(line)):
                return False
            self.open = True
        m = _PS_THREAD.match(line)
        if m:
            self._flush()
            state = m["state"]
            self._thread = ThreadStack(
                name=m["name"] or "", tid=m["tid"], frames=[], source=src, origin="pyspy",
                idle="idle" in state)
            return True
        if line.startswith("        ") and self._thread is not None and self._thread.frames \
                and not _PS_PY_FRAME.match(line):
            return True  # --locals: Arguments:/Locals: and their values
        m = _PS_FRAME.match(line)
        if m and (self._thread is not None or _PS_PY_FRAME.match(line)):
            if self._thread is None:  # frames pasted without a thread header
                self._thread = ThreadStack(name="", tid="?", frames=[], source=src,
                                           origin="pyspy")
            if len(self._thread.frames) < MAX_FRAMES:
                self._thread.frames.append(_pyspy_frame(m["func"], m["loc"]))
            return True
        if not line.strip() or line.startswith("Parent Process"):
            return True
        self.close()
        return False

    def close(self) -> None:
        self._flush()
        self.open = False

    def _flush(self) -> None:
        if self._thread is not None:
            self._emit(self._thread)
            self._thread = None


def _pyspy_frame(func: str, loc: str) -> Frame:
    """``file.py:12`` or a native ``libc.so.6`` (no line)."""
    file, sep, line = loc.rpartition(":")
    if sep and line.isdigit() and len(line) <= 9:
        return Frame(func.strip(), file, int(line))
    return Frame(func.strip(), loc, None)
