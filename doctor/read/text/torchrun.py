"""torchrun's failure summary (``ChildFailedError``): which rank died, how, and first.

A crash often leaves only this block::

    torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
    ============================================================
    serve.py FAILED
    ------------------------------------------------------------
    Failures:
    [1]:
      time      : 2026-01-15_05:44:29
      host      : node-a
      rank      : 1 (local_rank: 1)
      exitcode  : 1 (pid: 6175)
      error_file: <N/A>
      traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
    ------------------------------------------------------------
    Root Cause (first observed failure):
    [0]:
      ...
      exitcode  : -11 (pid: 6174)
      traceback : Signal 11 (SIGSEGV) received by PID 6174
    ============================================================

Exit code -9 is SIGKILL (often the OOM killer), -6 an abort (NCCL watchdog), -11 a segfault.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from doctor.model.evidence import ExitRecord, SourceRef

Emit = Callable[[int, ExitRecord], None]
_ENTRY = re.compile(r"^\s*\[(?P<idx>\d{1,6})\]:\s*$")
_FIELD = re.compile(r"^\s+(?P<key>time|host|rank|exitcode|error_file|traceback)\s*:\s*(?P<val>.*)$")
_RANK = re.compile(r"^(?P<rank>\d{1,6})\b")
_EXIT = re.compile(r"^(?P<code>-?\d{1,6})\b(?: \(pid: (?P<pid>\d{1,9})\))?")
_SIGNAL = re.compile(r"Signal \d+ \((?P<sig>SIG[A-Z]+)\)")
_SIGNALS = {-9: "SIGKILL", -6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS", -15: "SIGTERM"}
_MAX_LINES = 400


class TorchrunParser:
    """The ``Failures:`` / ``Root Cause`` block; emits ``(rank, ExitRecord)`` per entry."""

    def __init__(self, emit: Emit) -> None:
        self._emit = emit
        self.open = False
        self._root = False
        self._entry: dict[str, str] | None = None
        self._src: SourceRef | None = None
        self._lines = 0

    #: A line :meth:`starts` a block only if it holds one of these (the reader skips
    #: :meth:`starts` on lines that hold none; tests/doctor/test_parsers.py holds it).
    START_LITERALS = ("ChildFailedError", "Failures:", "Root Cause (first observed failure)")

    @staticmethod
    def starts(line: str) -> bool:
        return ("ChildFailedError" in line or line.strip() == "Failures:"
                or "Root Cause (first observed failure)" in line)

    def feed(self, line: str, src: SourceRef) -> bool:
        stripped = line.strip()
        if self.starts(line):
            self.open = True
            self._lines = 0
            if "Root Cause" in line:
                self._flush()
                self._root = True
            return True
        if not self.open:
            return False
        self._lines += 1
        if self._lines > _MAX_LINES:
            self.close()
            return False
        m = _ENTRY.match(line)
        if m:
            self._flush()
            self._entry, self._src = {"idx": m["idx"]}, src
            return True
        m = _FIELD.match(line)
        if m and self._entry is not None:
            self._entry[m["key"]] = m["val"].strip()
            return True
        if stripped.startswith("=") and self._root:
            self.close()
            return True
        if not stripped or stripped.startswith(("-", "=")) or stripped.endswith("FAILED") \
                or stripped.startswith("<NO_OTHER_FAILURES>"):
            return True
        self.close()
        return False

    def close(self) -> None:
        self._flush()
        self.open = False
        self._root = False

    def _flush(self) -> None:
        entry, src = self._entry, self._src
        self._entry = None
        if entry is None or src is None:
            return
        m = _RANK.match(entry.get("rank", ""))
        rank = int(m["rank"]) if m else int(entry["idx"])
        code = pid = None
        m = _EXIT.match(entry.get("exitcode", ""))
        if m:
            code = int(m["code"])
            pid = int(m["pid"]) if m["pid"] else None
        sm = _SIGNAL.search(entry.get("traceback", ""))
        sig = sm["sig"] if sm else (_SIGNALS.get(code) if code is not None else None)
        self._emit(rank, ExitRecord(exit_code=code, pid=pid, signal=sig, root_cause=self._root,
                                    source=src))
