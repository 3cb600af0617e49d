"""Python tracebacks, line by line, whole or in fragments.

:class:`TracebackParser` is fed one (prefix-stripped) line at a time by the log scanner and
emits one :class:`ExceptionRecord` per exception, frames innermost first. It reads

* the whole form: ``Traceback (most recent call last):`` anywhere in a line (SGLang prints it
  after ``Scheduler hit an exception: ``), ``File "...", line N, in func`` frames, source and
  ``^^^^``/``~~~`` lines, ``[Previous line repeated N more times]``;
* chains (``During handling of the above exception...`` tags the next one ``context``, ``The
  above exception was the direct cause...`` tags it ``cause``) and exception groups (the
  ``+-+---- 1 ----`` / ``|`` box is stripped; every member is tagged ``group``);
* what users paste instead: frames without the header, frames and source lines without their
  indentation (log collectors strip it), the exception line first and the frames after it, a
  paste cut off before the exception line (the frames are kept as a ``truncated`` record: a few
  lines of a stack are evidence), a lone exception line with no frames at all, and a message
  that runs over several lines (NCCL and CUDA errors do).

A lone exception line is only taken when its type looks like an exception class
(``RuntimeError``, ``torch.OutOfMemoryError``, ``gloo::EnforceNotMet``); inside a traceback any
``Name: message`` line after the frames is the exception. It never raises; a block that stops
looking like a traceback is closed.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.model.evidence import ExceptionRecord, Frame, SourceRef

HEADER = "Traceback (most recent call last):"
TRIGGERS = ("File \"", "File \\\"")
#: ``File "x.py", line 3, in f``; also as JSON-escaped logs print it (``File \"x.py\"``).
_FRAME = re.compile(r'^\s*File \\?"(?P<file>[^"\\]*)\\?", line (?P<line>\d{1,9}), '
                    r'in (?P<func>.+?)\s*$')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:::\w+)*)(?::\s?(?P<msg>.*))?$")
#: A type that is an exception class on its face: a lone line of it is an exception.
_STRONG = re.compile(
    r"^(?:(?:[A-Za-z_]\w*\.)*+[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Failure|Fault|"
    r"Timeout|NotMet|Stalled|Divergence|Unavailable|Violation|Detected)|(?:[A-Za-z_]\w*::)++"
    r"[A-Za-z_]\w*|StopIteration|DoubleFree|DoubleAllocation)$")
# [|+] then dashes and pluses up to a space: one way to split any line ("(?:-+\+?)*" had
# exponentially many for a run of dashes with no space after it). The repetitions of groups
# here are possessive: each split is unique (a dotted or "::" part ends at its separator, which
# the type's last part cannot hold), and Python's engine keeps a backtracking frame for every
# iteration of a plain one (150 MB on a megabyte of "| | | ...").
_BOX = re.compile(r"^\s*(?:[|+](?:-[-+]*)?(?: |$))++")
_SEPARATOR = re.compile(r"^-+(?: \d+ -+| \.\.\.)?-*$|^\.\.\. and \d+ more exception")
_CONTEXT = "During handling of the above exception, another exception occurred:"
_CAUSE = "The above exception was the direct cause of the following exception:"
_CARETS = re.compile(r"^\s*[\^~]+\s*$")
#: The first call on a source line: ``x = self.cache.dec_lock_ref(node)``,
#: ``if self.load_back(node, quota):``, ``return func(*args)``.
_CALL = re.compile(r"(?:^|(?<=[\s=(,!]))(?:[A-Za-z_]\w*\.)*(?P<func>[A-Za-z_]\w*)\(")
_RULE = re.compile(r"^[=\-_*#]{4,}$")
#: What Python prints before the traceback of a process or thread that died
#: (multiprocessing's ``BaseProcess._bootstrap``, threading's ``excepthook``): the next
#: failure's header, never more of the last message.
_BANNER = re.compile(r"^(?:Process [\w.:-]{1,80}"
                     r"|Exception in thread [^\s:]{1,80}(?: \([^)]{0,80}\))?):$")
MAX_FRAMES = 200
_MAX_NOISE = 20
_MAX_MESSAGE = 2000
_MAX_CONTINUATION = 8
_ATTACH_GAP = 3
"""Frames that start within this many lines after a lone exception line belong to it."""

Emit = Callable[[ExceptionRecord], None]


def strong_exception(line: str) -> re.Match[str] | None:
    """``Type: message`` whose type is an exception class on its face (see the module doc)."""
    m = _EXC.match(line.strip())
    if m and m["msg"] is not None and _STRONG.match(m["type"]):
        return m
    return None


class TracebackParser:
    """One open traceback stream (one per rank prefix in an interleaved log)."""

    def __init__(self, emit: Emit, claimed: Callable[[str], bool] | None = None) -> None:
        self._emit = emit
        self._claimed = claimed or (lambda _line: False)
        """Whether another block parser starts on a line (it then ends this block)."""
        self.open = False
        self._frames: list[Frame] = []
        self._frames_src: SourceRef | None = None
        self._in_tb = False
        self._after_frame = False
        self._group = False
        self._pending = ""
        self._noise = 0
        self._last: ExceptionRecord | None = None
        """The exception last emitted, while its message may still continue."""
        self._continued = 0
        self._cut = False
        self._lone: tuple[ExceptionRecord, int] | None = None
        """A frameless exception (and its line) that frames pasted after it may belong to."""

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = (HEADER, "File ", ":")  # ":" for "Type: message"

    @staticmethod
    def starts(line: str) -> bool:
        return (HEADER in line or ("File " in line and bool(_FRAME.match(line)))
                or strong_exception(line) is not None)

    def boundary(self) -> None:
        """A new log record starts: an exception message cannot continue across it."""
        self._last = None

    def feed(self, line: str, src: SourceRef) -> bool:
        """Consume one line; returns False when the line does not belong to this traceback
        (the block is then closed and the caller may try other parsers on the line)."""
        if HEADER in line:
            self._begin("Exception Group" in line, src)
            return True
        text = _BOX.sub("", line) if self._group else line
        stripped = text.strip()
        if not self.open:
            return self._open_on(text, stripped, src)
        if self._structural(text, stripped, src):
            self._noise = 0
            return True
        if self._claimed(line):
            self.close()
            return False
        if self._continue_message(stripped):
            return True
        if stripped.startswith(("File \"", "File \\\"")):
            self._cut = True  # a frame line cut off mid-way: the paste ends inside the stack
        self._noise += 1
        if self._noise > (2 if not self._in_tb else _MAX_NOISE):
            self.close()
            return False
        return True

    def close(self) -> None:
        """End the block; frames without their exception line are kept as a truncated one."""
        if self._frames:
            self._emit_truncated()
        self.open = False
        self._in_tb = self._after_frame = False
        self._frames, self._frames_src = [], None
        self._last, self._pending = None, ""

    def _open_on(self, text: str, stripped: str, src: SourceRef) -> bool:
        """A block opened by a frame (no header) or by a lone exception line."""
        if _FRAME.match(text):
            self._begin(False, src)
            return self._structural(text, stripped, src)
        m = strong_exception(stripped)
        if m is None:
            return False
        self.open, self._group, self._in_tb = True, False, False
        self._noise = 0
        record = self._exception_record(m, src, lone=True)
        self._lone = (record, src.line or 0)
        return True

    def _begin(self, group: bool, src: SourceRef) -> None:
        if self._frames:
            self._emit_truncated()
        self._group = (self._group and self.open) or group
        self.open = True
        self._in_tb = True
        self._after_frame = False
        self._frames, self._frames_src = [], src
        self._noise = 0
        self._last = None

    def _structural(self, text: str, stripped: str, src: SourceRef) -> bool:
        m = _FRAME.match(text)
        if m:
            if not self._in_tb:  # frames again after an exception line: a new traceback
                self._begin(self._group, src)
            if len(self._frames) < MAX_FRAMES:
                self._frames.append(Frame(m["func"], m["file"], int(m["line"])))
            self._after_frame, self._last = True, None
            return True
        if stripped in (_CONTEXT, _CAUSE):
            self._pending = "context" if stripped == _CONTEXT else "cause"
            self._last = None
            return True
        if not stripped:
            self._last = None
            return True
        if self._group and _SEPARATOR.match(stripped):
            self._in_tb, self._frames = True, []
            return True
        if self._in_tb and (_CARETS.match(stripped) or stripped.startswith("[Previous line")):
            return True
        if self._in_tb:
            m = _EXC.match(stripped)
            strong = m is not None and bool(_STRONG.match(m["type"]))
            if self._after_frame and not strong:
                # the line after a frame is its source line, unless it is plainly an exception
                # (collectors strip indentation, so indentation cannot tell them apart)
                self._after_frame = False
                last = self._frames[-1] if self._frames else None
                if last is not None and not last.code:
                    self._frames[-1] = Frame(last.func, last.file, last.line, stripped[:200])
                return True
            self._after_frame = False
            if m is not None and (m["msg"] is not None or stripped[:1].isupper()) \
                    and (strong or not text[:1].isspace()):
                self._exception_record(m, src, lone=False)
                return True
            if text.startswith("    "):
                return True
        return False

    def _exception_record(self, m: re.Match[str], src: SourceRef, lone: bool) -> ExceptionRecord:
        chain = self._pending or ("group" if self._group else "")
        self._pending = ""
        msg = (m["msg"] or "").strip()[:_MAX_MESSAGE]
        frames = list(reversed(self._frames))
        if not msg and m["type"].endswith("AssertionError") and frames \
                and frames[0].code.startswith("assert "):
            msg = frames[0].code  # a bare assert: the statement says what was asserted
        lone_rec = self._lone[0] if self._lone else None
        if (not lone and lone_rec is not None and not lone_rec.frames
                and lone_rec.type == m["type"] and lone_rec.message == msg):
            # the exception line came first and the traceback repeats it: one exception
            lone_rec.frames = frames
            record = lone_rec
        else:
            record = ExceptionRecord(type=m["type"], message=msg, frames=frames, source=src,
                                     chain=chain)
            self._emit(record)
        if not lone:
            self._lone = None
        self._frames, self._frames_src = [], None
        self._in_tb = self._group  # a group may carry more members without a new header
        self._after_frame = False
        self._last, self._continued = record, 0
        if not self._group:
            self._noise = 0
        return record

    def _continue_message(self, stripped: str) -> bool:
        """A further line of the last exception's message (NCCL/CUDA errors span several)."""
        last = self._last
        if (last is None or self._continued >= _MAX_CONTINUATION or _FRAME.match(stripped)
                or _RULE.match(stripped) or _BANNER.match(stripped)):
            return False
        if len(last.message) + len(stripped) < _MAX_MESSAGE:
            last.message = f"{last.message}\n{stripped}" if last.message else stripped
        self._continued += 1
        return True

    def _emit_truncated(self) -> None:
        """Frames whose exception line is missing (a paste cut short, or the exception
        printed before them)."""
        frames = list(reversed(self._frames))
        self._frames = []
        lone = self._lone
        src = self._frames_src or SourceRef("?", None)
        attach = lone is not None and not lone[0].frames \
            and 0 < (src.line or 0) - lone[1] <= _ATTACH_GAP
        callee = _CALL.search(frames[0].code) if frames and frames[0].code else None
        if callee and (not attach or self._cut):
            # the paste ends while descending into a call: the innermost frame's source line
            # names the function that was being entered (and that raised, in a crash report)
            frames.insert(0, Frame(callee["func"], "(cut off)", None))
        self._cut = False
        if attach and lone is not None:
            lone[0].frames = frames
            self._lone = None
            return
        self._emit(ExceptionRecord(type="", message="", frames=frames, source=src,
                                   chain="", truncated=True))
