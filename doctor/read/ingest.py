"""Reading inputs: files, directories, tar archives, gzip files and stdin.

Every artifact goes through ``_read_one``, which sniffs it and hands it to its reader inside a
guard: any error (malformed, truncated, binary, hostile, huge) becomes an
:class:`~doctor.model.evidence.InputRecord` with a plain message and the next artifact is read — one
bad file never stops the analysis (flutter-doctor style: a failing check is a result).

Archives are streamed member by member and never extracted to disk; nested archives are read
one level deep. Directories are walked without following symlinks.

Every input is untrusted, and memory must not follow its size: text is scanned in chunks with
lines cut at a fixed length, a gzip stream stops once it has expanded ``GZIP_RATIO`` times past
``GZIP_BASE``, structured files are read up to a size cap and parsed only if what they would
build stays under ``MAX_BUILD_COST``, and a command-line path that is a device or socket is not
read (a FIFO is: ``hicache doctor <(zcat log.gz)``).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from doctor.model.builder import EvidenceBuilder
from doctor.model.evidence import MAX_NAME, InputRecord, InputStatus, RankHint, clip
from doctor.model.frames import classifier_for
from doctor.read.bundle import MAX_MANIFEST_BYTES, read_capture, read_manifest
from doctor.read.dumps import read_pyspy_json, read_runtime_fr, read_torch_fr
from doctor.read.logscan import LogScanner
from doctor.read.rankid import path_hint
from doctor.read.safe_pickle import MAX_BUILD_COST, MAX_PICKLE_BYTES, load_plain
from doctor.read.sniff import HEAD_BYTES, Kind, sniff
from doctor.read.text.lines import LineHandler
from doctor.read.text.pages import HtmlText
from doctor.read.trace import read_events, read_state
from hicache_runtime.contracts.errors import DumpFormatError
from hicache_runtime.contracts.jsonl import describe_mode, open_regular
from signatures.models import Catalog

MAX_JSON_BYTES = 64 << 20
GZIP_BASE = 1 << 30
GZIP_RATIO = 200
EMPTY = "empty"
"""The kind of an input with nothing in it (an empty file or directory)."""
MAX_FILES = 100_000
MAX_DEPTH = 16
_SKIP_DIRS = {".git", "__pycache__", ".venv", "node_modules"}


class _Prefixed(io.RawIOBase):
    """A stream that yields ``head`` (already read for sniffing) and then the rest."""

    def __init__(self, head: bytes, rest: BinaryIO) -> None:
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # a writable buffer (bytearray or memoryview)
        if self._head:
            n = min(len(b), len(self._head))
            b[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read(len(b))
        b[:len(data)] = data
        return len(data)


class Ingester:
    """Reads every input into one :class:`EvidenceBuilder`."""

    def __init__(self, catalog: Catalog, sink: EvidenceBuilder) -> None:
        self.catalog = catalog
        self.sink = sink
        self.frames = classifier_for(catalog.frames)

    def add_path(self, arg: str) -> None:
        """A command-line input: ``-`` (stdin), a file, a FIFO (``<(zcat log.gz)``) or a
        directory. Anything else (a device such as ``/dev/zero``, a socket) is not read."""
        if arg == "-":
            self._read_one("<stdin>", sys.stdin.buffer, depth=0)
            return
        path = Path(arg)
        try:
            mode = path.stat().st_mode
        except OSError as exc:
            why = "not found" if isinstance(exc, FileNotFoundError) else \
                f"cannot read: {exc.strerror or exc}"
            self.sink.inputs.append(InputRecord(arg, "?", InputStatus.ERROR, why))
            return
        if stat.S_ISDIR(mode):
            count = len(self.sink.inputs)
            for f in _walk(path, self.sink):
                self._read_file(f, display=str(f), regular_only=True)
            if len(self.sink.inputs) == count:  # like an empty file: read, nothing in it
                self.sink.inputs.append(InputRecord(arg, EMPTY, InputStatus.READ,
                                                    "empty directory"))
        elif stat.S_ISREG(mode) or stat.S_ISFIFO(mode):
            self._read_file(path, display=arg)
        else:
            self.sink.inputs.append(InputRecord(arg, "?", InputStatus.ERROR, f"not a regular file "
                                                f"({describe_mode(mode)}); not read"))

    def add_stream(self, name: str, stream: BinaryIO) -> None:
        """An already open stream (tests, stdin)."""
        self._read_one(name, stream, depth=0)

    def _read_file(self, path: Path, display: str, regular_only: bool = False) -> None:
        """Read one file. ``regular_only`` (a directory's files): opened without blocking and
        checked on the open descriptor, so a file swapped for a FIFO after the walk looked at
        it is refused, never waited on."""
        try:
            with open_regular(path) if regular_only else path.open("rb") as fh:
                self._read_one(display, fh, depth=0)
        except DumpFormatError as exc:
            self.sink.inputs.append(InputRecord(display, "?", InputStatus.ERROR,
                                                str(exc).replace(f"{path}: ", "", 1)))
        except OSError as exc:
            self.sink.inputs.append(InputRecord(display, "?", InputStatus.ERROR,
                                                f"cannot open: {exc.strerror or exc}"))

    def _read_one(self, name: str, stream: BinaryIO, depth: int) -> None:
        try:
            head = stream.read(HEAD_BYTES)
        except (OSError, EOFError, tarfile.TarError, gzip.BadGzipFile) as exc:
            self.sink.inputs.append(InputRecord(name, "?", InputStatus.ERROR,
                                                f"cannot read: {exc}"))
            return
        if not head:
            self.sink.inputs.append(InputRecord(name, EMPTY, InputStatus.READ, "empty",
                                                rank=path_hint(name).rank))
            return
        kind = sniff(name, head)
        record = InputRecord(name, kind.value, InputStatus.READ, rank=path_hint(name).rank)
        self.sink.inputs.append(record)
        body = _rewound(stream, head)
        try:
            record.message = self._dispatch(kind, name, head, body, depth) or ""
        except DumpFormatError as exc:
            record.status, record.message = InputStatus.ERROR, str(exc)
        except (OSError, EOFError, tarfile.TarError, gzip.BadGzipFile, UnicodeError,
                ValueError, RecursionError, MemoryError) as exc:
            record.status, record.message = InputStatus.ERROR, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a reader bug must not hide the other inputs' evidence
            record.status = InputStatus.ERROR
            record.message = f"internal error reading this input ({type(exc).__name__}: {exc})"

    def _dispatch(self, kind: Kind, name: str, head: bytes, body: BinaryIO,
                  depth: int) -> str | None:
        hint = path_hint(name)
        if kind in (Kind.TEXT, Kind.HTML):
            scanner = LogScanner(LineHandler(self.catalog, self.sink, name, hint,
                                             kind=_text_kind(name)))
            scanner.scan(body if kind is Kind.TEXT
                         else io.BufferedReader(HtmlText(body), buffer_size=1 << 20))
            return f"{scanner.lines} lines" + (
                f", {scanner.long_lines} over-long line(s) cut" if scanner.long_lines else "")
        if kind is Kind.BINARY:
            raise DumpFormatError("binary file that is not a known dump; skipped")
        if kind is Kind.DIAGNOSIS:
            return "a doctor report (output, not evidence); skipped"
        if kind in (Kind.TAR, Kind.GZIP):
            return self._archive(kind, name, head, body, depth)
        if kind is Kind.EVENTS:
            return f"{read_events(body, name, hint, self.sink)} events kept"
        return self._structured(kind, name, body, hint)

    def _structured(self, kind: Kind, name: str, body: BinaryIO, hint: RankHint) -> str | None:
        limit = MAX_PICKLE_BYTES if kind is Kind.TORCH_FR else MAX_JSON_BYTES
        if kind in (Kind.MANIFEST, Kind.CAPTURE, Kind.STATE):
            limit = MAX_MANIFEST_BYTES
        raw = body.read(limit + 1)
        if len(raw) > limit:
            raise DumpFormatError(f"larger than {limit >> 20} MiB; skipped")
        if kind is Kind.MANIFEST:
            read_manifest(raw, name, self.sink)
            return None
        if kind is Kind.CAPTURE:
            cap = read_capture(raw, name, self.sink)
            return f"{len(cap.targets)} process(es)"
        if kind is Kind.TORCH_FR:
            data = load_plain(raw) if raw[:1] == b"\x80" else _json(raw)
            if hint.rank is None:
                raise DumpFormatError("Flight Recorder dump whose file name names no rank "
                                      "(expected e.g. nccl_trace_rank_3)")
            return f"{read_torch_fr(data, name, hint, self.sink, self.frames)} entries"
        data = _json(raw)
        if kind is Kind.PYSPY_JSON:
            return f"{read_pyspy_json(data, name, hint, self.sink)} threads"
        if kind is Kind.RUNTIME_FR:
            return f"{read_runtime_fr(data, name, hint, self.sink)} records"
        if not self.sink.retain(len(raw)):
            raise DumpFormatError("over the evidence budget; state snapshot not kept")
        read_state(data, name, hint, self.sink)
        return None

    def _archive(self, kind: Kind, name: str, head: bytes, body: BinaryIO, depth: int) -> str:
        if depth >= 2:
            raise DumpFormatError("archive nested too deeply; skipped")
        if kind is Kind.GZIP:
            inner = name[:-3] if name.endswith(".gz") else name + "!gunzip"
            stream = _Inflated(body)
            self._read_one(inner, cast(BinaryIO, stream), depth + 1)
            if stream.cut:
                self.sink.problem(stream.cut_message(name))
            return "gzip stream" + (" (cut: expands too far)" if stream.cut else "")
        count = 0
        inflated = _Inflated(body) if head[:2] == b"\x1f\x8b" else None
        with tarfile.open(fileobj=inflated or body, mode="r|" if inflated else "r|*") as tar:
            for member in tar:
                if not member.isfile() or count >= MAX_FILES:
                    continue
                fh = tar.extractfile(member)
                if fh is not None:
                    count += 1
                    self._read_one(clip(f"{name}!{member.name}", MAX_NAME),
                                   cast(BinaryIO, fh), depth + 1)
        if inflated is not None and inflated.cut:
            self.sink.problem(inflated.cut_message(name))
        return f"{count} member(s)"


class _Counting(io.RawIOBase):
    """Counts the bytes read from a stream (the compressed side of a gzip stream)."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # a writable buffer (bytearray or memoryview)
        data = self._raw.read(len(b))
        b[:len(data)] = data
        self.count += len(data)
        return len(data)


class _Inflated(io.RawIOBase):
    """A gzip stream that ends early (``cut``) once it has expanded past
    ``GZIP_BASE + GZIP_RATIO * compressed bytes read``: a few MB of compressed zeros must not
    cost the time of reading terabytes. Real logs compress 5-20 times."""

    def __init__(self, body: BinaryIO) -> None:
        self._compressed = _Counting(body)
        self._gz = gzip.GzipFile(fileobj=io.BufferedReader(self._compressed, 1 << 16))
        self.out = 0
        self.cut = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # a writable buffer (bytearray or memoryview)
        if self.cut:
            return 0
        data = self._gz.read(len(b))
        self.out += len(data)
        if self.out > GZIP_BASE + GZIP_RATIO * self._compressed.count:
            self.cut = True
        b[:len(data)] = data
        return len(data)

    def cut_message(self, name: str) -> str:
        return (f"{name}: decompressed {self.out >> 20} MiB from {self._compressed.count >> 10} "
                f"KiB, more than {GZIP_RATIO} times; the rest was not read")


def _rewound(stream: BinaryIO, head: bytes) -> BinaryIO:
    """The whole stream again: seek back when possible (no extra copy), else replay ``head``."""
    try:
        if stream.seekable():
            stream.seek(0)
            return stream
    except (OSError, ValueError, AttributeError):  # tar members in stream mode cannot seek
        pass
    return io.BufferedReader(_Prefixed(head, stream), buffer_size=1 << 20)


def _walk(root: Path, sink: EvidenceBuilder) -> Iterator[Path]:
    count = 0
    base_depth = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS
                             and len(Path(dirpath).parts) - base_depth < MAX_DEPTH)
        for f in sorted(filenames):
            p = Path(dirpath) / f
            if p.is_symlink() or not p.is_file():
                continue
            count += 1
            if count > MAX_FILES:
                sink.problem(f"{root}: more than {MAX_FILES} files; the rest were not read")
                return
            yield p


def _json(raw: bytes) -> object:
    """Parse ``raw`` unless it would build more than ``MAX_BUILD_COST`` of objects: 64 MiB of
    ``[[],[],...]`` is 20 million lists (counted with ``bytes.count``, before parsing)."""
    cost = (len(raw) + 72 * (raw.count(b"[") + raw.count(b"{"))
            + 16 * (raw.count(b",") + raw.count(b":")))
    if cost > MAX_BUILD_COST:
        raise DumpFormatError(f"JSON that would build more than {MAX_BUILD_COST >> 20} MiB of "
                              "objects; skipped")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DumpFormatError(f"invalid JSON ({str(exc)[:200]})") from None


def _text_kind(name: str) -> str:
    lower = name.lower()
    if "pyspy" in lower or "py-spy" in lower:
        return "pyspy"
    if "stacks" in lower or "faulthandler" in lower:
        return "faulthandler"
    if "traceback" in lower:
        return "traceback"
    return "log"
