"""Bounded reading of line-oriented files that come from elsewhere (traces in crash bundles,
logs): one reader, :func:`line_blocks`, for every consumer (:func:`iter_lines` here, the
doctor's log scanner).

A line is only materialised when it is short: the stream is read in fixed chunks, and a line
longer than ``max_line`` is skipped as it streams past (reported as ``None``), so a 1 GiB line, a
sparse multi-GB file or an endless stream of NUL bytes costs one chunk of memory, not the line.
:func:`open_regular` refuses what is not a regular file (a device such as ``/dev/zero``, a
socket), checked on the open descriptor, so a symlink swapped in between cannot slip past.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from hicache_runtime.contracts.errors import DumpFormatError

MAX_LINE = 1 << 20
"""The longest line materialised (1 MiB); longer lines are skipped and counted."""
CHUNK = 1 << 20


@dataclass(frozen=True)
class LongLine:
    """A line longer than the reader's limit: its first ``limit`` bytes; the rest was skipped
    as it streamed past, never held."""

    head: bytes


class Endings(Protocol):
    """Rewrites the line boundaries of each chunk as they stream past (a reader of text from
    elsewhere turns ``\r``, NEL and friends into ``\n``); ``flush`` gives what it held back at
    the end of the stream."""

    def __call__(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


def line_blocks(stream: BinaryIO, max_line: int = MAX_LINE, chunk: int = CHUNK,
                endings: Endings | None = None) -> Iterator[bytes | LongLine]:
    """The stream as blocks of whole lines, each ending in ``\n`` (a last line without one gets
    it), in order; an unfinished line that grows past ``max_line`` comes as a
    :class:`LongLine` instead, and the rest of it is skipped unread into memory.

    Memory is at most a chunk plus ``max_line`` whatever the input: a 1 GiB line, a sparse
    multi-GB file or an endless stream of NUL bytes costs one chunk. A whole line longer than
    ``max_line`` inside one chunk is left in its block (the caller bounds what it keeps)."""
    carry = b""
    skipping = False  # inside the rest of an over-long line
    fd = _plain_file(stream) if endings is None else None
    while True:
        if skipping and fd is not None:
            _past_hole(stream, fd)
        raw = stream.read(chunk)
        data = raw if endings is None else (endings(raw) if raw else endings.flush())
        if not data:
            if not raw:
                break
            continue
        if skipping:
            nl = data.find(b"\n")
            if nl < 0:
                continue
            data, skipping = data[nl + 1:], False
        buf = carry + data if carry else data
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield buf[:cut]
        carry = buf[cut:]
        if len(carry) > max_line:
            yield LongLine(carry[:max_line])
            carry, skipping = b"", True
    if carry:
        yield carry + b"\n"


def _plain_file(stream: BinaryIO) -> int | None:
    """The descriptor of ``stream`` when it reads a file on disk directly (not through a
    decompressor or an archive member, whose positions are not the file's)."""
    raw = getattr(stream, "raw", stream)
    if not isinstance(raw, io.FileIO) or not hasattr(os, "SEEK_DATA"):
        return None
    try:
        return stream.fileno() if stream.seekable() else None
    except (OSError, ValueError):
        return None


def _past_hole(stream: BinaryIO, fd: int) -> None:
    """Move a stream that is skipping an over-long line past the hole it is in, if any: a
    hole of a sparse file reads as NUL bytes, which hold no line end, so reading them would
    only cost time (a 2 GiB hole, such as a log truncated under a writer that kept its
    offset, took seconds to read). Only where nothing but a newline ends the skip: with no
    line-ending rewrite."""
    pos = stream.tell()
    raw = os.lseek(fd, 0, os.SEEK_CUR)  # past what the stream has buffered already
    try:
        data = os.lseek(fd, pos, os.SEEK_DATA)
    except OSError as exc:
        data = -1
        if exc.errno == errno.ENXIO:  # nothing but a hole from here to the end
            data = os.fstat(fd).st_size
    if data > pos:
        stream.seek(data)  # drops the stream's buffer: it held NULs of the hole only
    else:  # no hole here (or a file system that cannot say): read on where it was
        os.lseek(fd, raw, os.SEEK_SET)


def iter_lines(stream: BinaryIO, max_line: int = MAX_LINE,
               chunk: int = CHUNK) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, line without its newline)``; ``None`` for a line over ``max_line``.

    Memory is at most a chunk plus ``max_line`` whatever the input (:func:`line_blocks`)."""
    lineno = 0
    for block in line_blocks(stream, max_line, chunk):
        if isinstance(block, LongLine):
            lineno += 1
            yield lineno, None
            continue
        for part in block[:-1].split(b"\n"):
            lineno += 1
            yield lineno, part if len(part) <= max_line else None


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (after symlinks), else raise
    :class:`DumpFormatError` saying what it is. Opened without blocking and checked before
    anything is read: a FIFO would otherwise wait forever for a writer in ``open`` itself."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DumpFormatError(f"{path}: not a regular file ({describe_mode(mode)}); "
                                  "not read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def describe_mode(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield events from a JSONL trace, skipping (not failing on) malformed and over-long
    lines; only a regular file is read (see :func:`open_regular`). ``hicache trace
    export`` lives in :mod:`hicache_runtime.telemetry.perfetto`."""
    with open_regular(path) as fh:
        for _lineno, line in iter_lines(fh):
            if not line or not line.strip():
                continue
            try:
                ev = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(ev, dict) and "kind" in ev and "t_ns" in ev:
                yield ev
