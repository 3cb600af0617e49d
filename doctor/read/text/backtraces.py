"""Native stacks and call chains: gdb ``bt``, c10's ``frame #N:`` lists, ``a -> b -> c``.

gdb (``bt``, ``thread apply all bt``) prints the innermost frame first::

    Thread 3 (Thread 0x7f2b0effd640 (LWP 3313) "python3"):
    #0  0x00007f2c1a4e5f3d in syscall () from /lib/x86_64-linux-gnu/libc.so.6
    #1  0x00007f2bd0a4b1d2 in gloo::transport::tcp::UnboundBuffer::waitRecv(int*, ...) ()
        at /opt/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78

c10 (PyTorch's C++ errors) appends its own backtrace to the message::

    Exception raised from waitForResult at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:634
    frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f... in .../libc10.so)

Both become a :class:`ThreadStack` (origin ``native``). A line that is only a call chain of
code names (``writing_check -> _all_reduce_attn_groups -> all_reduce``: caller first, or
``all_reduce <- _sync_storage_hit_count <- prefetch_thread_func``: innermost first) becomes a
stack of origin ``chain``: the shape is evidence even when nobody kept the dump.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.model.evidence import Frame, SourceRef, ThreadStack

Emit = Callable[[ThreadStack], None]
TRIGGERS = ("#0 ", "frame #", " -> ", " <- ", "→", "←", "(LWP ")
MAX_FRAMES = 200

_GDB_THREAD = re.compile(r'^\s*Thread (?P<n>\d{1,7}) \((?:Thread (?P<addr>0x[0-9a-fA-F]+) )?'
                         r'\(?LWP (?P<lwp>\d{1,9})\)?(?:\) "(?P<name>[^"]*)")?.*\):\s*$')
_GDB_FRAME = re.compile(r"^\s*#(?P<n>\d{1,5})\s+(?:0x[0-9a-fA-F]+ in )?(?P<rest>.+)$")
_GDB_AT = re.compile(r" at (?P<file>[^\s:]+):(?P<line>\d{1,9})\s*$")
_GDB_FROM = re.compile(r" from (?P<lib>\S+)\s*$")
_GDB_NOISE = re.compile(r"^\s*(?:\[(?:New|Switching to|Thread debugging|Inferior)\b.*|"
                        r"Backtrace stopped.*|\(More stack frames follow\.\.\.\)|"
                        r"at [^\s:]+:\d+\s*|)$")
_C10_HEADER = re.compile(r"^\s*Exception raised from (?P<func>\S+) at (?P<file>[^\s:]+):"
                         r"(?P<line>\d{1,9})")
_C10_FRAME = re.compile(r"^\s*frame #(?P<n>\d{1,5}): (?P<func>.+?)(?: \+ 0x[0-9a-fA-F]+)?"
                        r"(?: \((?:0x[0-9a-fA-F]+ in )?(?P<lib>[^()]*)\))?\s*$")
_NAME = r"[A-Za-z_][\w.:<>\[\]~]*(?:\([^()]{0,120}\))?"
_ARROW = r"\s*(?:->|→|<-|←)\s*"
_CHAIN = re.compile(rf"^\s*{_NAME}(?:{_ARROW}{_NAME}){{1,40}}\s*\.?$")
_ITEM = re.compile(r"[A-Za-z_][\w.:<>\[\]~]*")


class NativeStackParser:
    """gdb backtraces (one stack per ``Thread N (...)`` header) and c10 ``frame #N:`` lists."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self._thread: ThreadStack | None = None
        self._style = ""

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = ("#0 ", "Thread ", "Exception raised from ", "frame #")

    @staticmethod
    def starts(line: str) -> bool:
        # the cheap literal test first (see PySpyTextParser.starts)
        return bool((line.lstrip().startswith("#0 ") and _GDB_FRAME.match(line))
                    or ("Thread " in line and _GDB_THREAD.match(line))
                    or ("Exception raised from " in line and _C10_HEADER.match(line))
                    or ("frame #" in line and _C10_FRAME.match(line)))

    def feed(self, line: str, src: SourceRef) -> bool:
        m = _GDB_THREAD.match(line)
        if m:
            self._start("gdb", src, name=m["name"] or "", tid=m["lwp"] or m["n"])
            return True
        m = _C10_HEADER.match(line)
        if m:
            self._start("c10", src)
            return True
        m = _C10_FRAME.match(line)
        if m and (self._style == "c10" or not self.open):
            if not self.open or (m["n"] == "0" and self._thread and self._thread.frames):
                self._start("c10", src)
            self._add(Frame(m["func"].strip(), (m["lib"] or "?").strip(), None))
            return True
        m = _GDB_FRAME.match(line)
        if m and (self._style == "gdb" or not self.open):
            if not self.open or (m["n"] == "0" and self._thread and self._thread.frames):
                self._start("gdb", src)
            self._add(_gdb_frame(m["rest"]))
            return True
        if self.open and self._style == "gdb" and _GDB_NOISE.match(line):
            at = _GDB_AT.search(" " + line.strip())
            if at and self._thread is not None and self._thread.frames:
                last = self._thread.frames[-1]  # gdb wraps long frames: "    at file.cc:78"
                self._thread.frames[-1] = Frame(last.func, at["file"], int(at["line"]))
            return True
        if self.open:
            self.close()
        return False

    def close(self) -> None:
        if self._thread is not None and self._thread.frames:
            self._emit(self._thread)
        self._thread = None
        self.open = False
        self._style = ""

    def _start(self, style: str, src: SourceRef, name: str = "", tid: str = "?") -> None:
        self.close()
        self.open, self._style = True, style
        self._thread = ThreadStack(name=name, tid=tid, frames=[], source=src, origin="native")

    def _add(self, frame: Frame) -> None:
        if self._thread is not None and len(self._thread.frames) < MAX_FRAMES:
            self._thread.frames.append(frame)


def _gdb_frame(rest: str) -> Frame:
    func = re.match(r"[^\s(]+", rest)
    at, lib = _GDB_AT.search(rest), _GDB_FROM.search(rest)
    if at:
        return Frame(func[0] if func else "?", at["file"], int(at["line"]))
    return Frame(func[0] if func else "?", lib["lib"] if lib else "?", None)


def chain_stack(line: str, src: SourceRef) -> ThreadStack | None:
    """A call chain on one line as a stack (innermost first), or None if the line is not one.
    At least one name must look like code (``_`` ``.`` ``::``), so prose arrows never count."""
    if not _CHAIN.match(line):
        return None
    items = [m[0] for m in _ITEM.finditer(re.sub(r"\([^()]*\)", "", line))]
    if len(items) < 2 or not any(("_" in i or "." in i or "::" in i) for i in items):
        return None
    if "->" in line or "→" in line:
        items.reverse()  # caller -> callee: the innermost is the last
    frames = [Frame(i.rstrip("."), "?", None) for i in items[:MAX_FRAMES]]
    return ThreadStack(name="(call chain)", tid="-", frames=frames, source=src, origin="chain")
