"""Streaming log scanner: large buffered reads, a vectorised prefilter, then the slow path.

Memory is flat whatever the input size: the scanner holds one chunk (``CHUNK`` bytes) plus the
unfinished last line, and everything it keeps is bounded per rank (see
:mod:`doctor.model.evidence`).

Which lines reach the slow path (:class:`~doctor.read.text.lines.LineHandler`):

* the first ``HEAD_LINES`` lines of the input, and the first ``CHUNK_HEAD_LINES`` lines of every
  chunk (the rank prefixes in use) — for their prefixes and blocks only;
* every line holding a trigger (a catalog pattern's literal, or a block opener such as
  ``Traceback (most recent call last)``), found by :class:`~doctor.read.prefilter.TriggerIndex`;
* every line while a block (traceback, thread dump, torchrun summary) is open, so multi-line
  records are read whole even when ranks interleave.

Line numbers are exact (newlines are counted in C with ``bytes.count``), counting every line
boundary ``str.splitlines`` knows (:class:`LineEndings`).
"""

from __future__ import annotations

import re
from typing import BinaryIO

from doctor.read.prefilter import TriggerIndex
from doctor.read.text.lines import LineHandler
from hicache_runtime.contracts.jsonl import LongLine, line_blocks

CHUNK = 4 << 20
HEAD_LINES = 500
CHUNK_HEAD_LINES = 8
MAX_LINE = 1 << 20
"""A "line" longer than this is cut (binary junk, minified JSON) and reported once."""


_ONE_BYTE = bytes.maketrans(b"\x0b\x0c\x1c\x1d\x1e", b"\n\n\n\n\n")
_LONE_CR = re.compile(rb"\r(?!\n)")
_MULTI_BYTE = ("\u2028".encode(), "\u2029".encode(), "\x85".encode())
_HELD = (b"\r", *(sep[:n] for sep in _MULTI_BYTE for n in range(1, len(sep))))
"""Chunk endings that may be the first bytes of a separator the next chunk completes."""


class LineEndings:
    """Every line boundary ``str.splitlines`` knows, made ``\n`` as the bytes stream past:
    a lone ``\r`` (old Mac files, progress bars, logs copied through some terminals), the
    vertical tab, form feed and file/group/record separators, and UTF-8's NEL, LINE SEPARATOR
    and PARAGRAPH SEPARATOR. ``\r\n`` stays (the line parsers drop the ``\r``). A separator
    cut by a chunk boundary is held back until the next chunk says what it is."""

    def __init__(self) -> None:
        self._held = b""

    def __call__(self, chunk: bytes) -> bytes:
        chunk = self._held + chunk if self._held else chunk
        self._held = next((h for h in _HELD if chunk.endswith(h)), b"")
        if self._held:
            chunk = chunk[:-len(self._held)]
        return _normalise(chunk)

    def flush(self) -> bytes:
        """What was held back, at the end of the stream (a final ``\r`` ends a line)."""
        held, self._held = self._held, b""
        return _normalise(held + b"\n" if held == b"\r" else held)


_RARE = (b"\x0b", b"\x0c", b"\x1c", b"\x1d", b"\x1e")


def _normalise(chunk: bytes) -> bytes:
    # each `in` is a memchr-speed scan; translating every chunk would cost a third of the
    # scanner's throughput for separators almost no log has
    if any(c in chunk for c in _RARE):
        chunk = chunk.translate(_ONE_BYTE)
    if b"\r" in chunk:
        chunk = _LONE_CR.sub(b"\n", chunk)
    for sep in _MULTI_BYTE:
        if sep[:1] in chunk and sep in chunk:  # the lead byte by memchr first: ASCII logs
            chunk = chunk.replace(sep, b"\n")
    return chunk


class LogScanner:
    """Scans one input stream into a :class:`LineHandler`."""

    def __init__(self, handler: LineHandler) -> None:
        self.handler = handler
        self.index = TriggerIndex([t.encode() for t in handler.triggers])
        self.lines = 0
        self.long_lines = 0
        self._planned = False
        self._hits: set[int] = set()

    def scan(self, stream: BinaryIO) -> None:
        """Read ``stream`` to its end; never raises on content (I/O errors propagate)."""
        for block in line_blocks(stream, MAX_LINE, CHUNK, LineEndings()):
            if isinstance(block, LongLine):  # keep its head as one line, drop the rest of it
                self.long_lines += 1
                block = block.head + b"\n"
            if not self._planned:
                self.index.plan(block)
                self._planned = True
            self._scan(block, len(block))
        self.handler.finish()

    def _scan(self, buf: bytes, end: int) -> None:
        """Process the complete lines of ``buf[:end]`` (``end`` is just past a newline)."""
        pos, lineno = 0, self.lines + 1
        hits = self.index.lines(buf, end)
        self._hits = set(hits)
        head = max(HEAD_LINES - self.lines, CHUNK_HEAD_LINES)
        pos, lineno = self._sequential(buf, end, pos, lineno, limit=head)
        if self.handler.blocks_open:  # a record that started in the previous chunk
            pos, lineno = self._sequential(buf, end, pos, lineno, limit=None)
        for start in hits:
            if start < pos:
                continue
            lineno += buf.count(b"\n", pos, start)
            pos, lineno = self._sequential(buf, end, start, lineno, limit=1)
            if self.handler.blocks_open:
                pos, lineno = self._sequential(buf, end, pos, lineno, limit=None)
        self.lines += buf.count(b"\n", 0, end)

    def _sequential(self, buf: bytes, end: int, pos: int, lineno: int,
                    limit: int | None) -> tuple[int, int]:
        """Process lines one by one from ``pos``: ``limit`` lines, or (``None``) while a block
        is open. Returns the new position and line number. Only lines the prefilter selected
        are matched against the log patterns; the others feed prefixes and open blocks."""
        handler, hits = self.handler, self._hits
        done = 0
        while pos < end and (done < limit if limit is not None else handler.blocks_open):
            nl = buf.find(b"\n", pos, end)
            nl = end - 1 if nl < 0 else nl
            handler.line(buf[pos:nl], lineno, pos in hits)
            pos, lineno, done = nl + 1, lineno + 1, done + 1
        return pos, lineno
