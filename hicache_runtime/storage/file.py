"""The embedded default L3 backend: one file per page in a directory (SGLang's ``HiCacheFile``).

Each object is ``<dir>/<page hash><suffix>.bin`` holding one sealed page (envelope header +
payload). Why this is safe under concurrency and crashes:

* Writes go to a uniquely named temporary file in the same directory, then ``os.replace`` it
  into place. A reader sees either no file or a complete one, never a torn write; two ranks or
  threads writing the same key race harmlessly (same content, last rename wins).
* A key whose file exists is not rewritten (SGLang does the same: the prefix chain makes the
  content a function of the key).
* A file that is truncated, extended or altered on disk fails the envelope check: it is
  counted, deleted (so the next backup of that page rewrites it) and reported as a miss.

No fsync by default: L3 is a cache, and a page lost in a power cut is only a miss. Pass
``fsync=True`` for durability at a large write-cost.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from hicache_runtime.errors import StorageUnavailable
from hicache_runtime.storage import envelope
from hicache_runtime.storage.base import RawPage, StorageBackend
from hicache_runtime.storage.keys import KeyScheme

if TYPE_CHECKING:
    from hicache_runtime.config import StorageConfig
    from hicache_runtime.tracing import Tracer

log = logging.getLogger(__name__)

_SUFFIX = ".bin"
_TMP_SUFFIX = ".tmp"


def default_dir() -> Path:
    """Where pages go when no path is configured (SGLang defaults to ``/tmp/hicache``)."""
    return Path(tempfile.gettempdir()) / "hicache"


class FileBackend(StorageBackend):
    """Pages as files under ``root``. Thread-safe: no shared state besides the counters and a
    temp-name counter (``itertools.count`` is atomic under the GIL)."""

    name = "file"

    def __init__(self, root: Path, scheme: KeyScheme, *, fsync: bool = False,
                 tracer: Tracer | None = None) -> None:
        """Create ``root`` if needed and check that it is writable.

        Raises :class:`StorageUnavailable` when the directory cannot be created or written.
        """
        super().__init__(scheme, tracer=tracer)
        self.root = Path(root)
        self.fsync = fsync
        self._tmp_ids = itertools.count()
        self._io_error_logged = False
        self._log_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self._tmp_path("probe")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StorageUnavailable(
                f"L3 file storage at {self.root} is not usable: {exc.strerror or exc}",
                hint="pass a writable --storage-path",
            ) from None

    @classmethod
    def from_config(cls, cfg: StorageConfig, scheme: KeyScheme, *, required: bool = True,
                    tracer: Tracer | None = None) -> FileBackend:
        """Build from ``storage.path`` (default :func:`default_dir`). ``required`` is accepted
        for symmetry with Redis; a local directory that is unusable always raises."""
        return cls(cfg.path or default_dir(), scheme, tracer=tracer)

    def describe(self) -> str:
        return f"file:{self.root} (suffix {self.scheme.suffix})"

    def path_of(self, object_key: str) -> Path:
        """The file holding an object (tests corrupt pages through this)."""
        return self.root / (object_key + _SUFFIX)

    def path_for(self, page_hash: str) -> Path:
        """The file holding a page hash's object on this rank."""
        return self.path_of(self.scheme.object_key(page_hash))

    # --- hooks --------------------------------------------------------------------------------

    def _exists_leading(self, object_keys: list[str]) -> int:
        n = 0
        for key in object_keys:
            if not self.path_of(key).is_file():
                break
            n += 1
        return n

    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        out: list[RawPage | None] = []
        for key in object_keys:
            try:
                out.append(_read_parts(self.path_of(key)))
            except FileNotFoundError:
                out.append(None)
            except OSError as exc:
                self._io_error("read", key, exc)
                out.append(None)
        return out

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        out: list[bool] = []
        for key, page in zip(object_keys, pages):
            path = self.path_of(key)
            if path.is_file():
                self._count(set_skipped=1)
                out.append(True)
                continue
            out.append(self._write_atomic(path, key, page))
        return out

    def _clear(self) -> None:
        try:
            entries = list(os.scandir(self.root))
        except OSError as exc:
            self._io_error("list", str(self.root), exc)
            return
        for entry in entries:
            name = entry.name
            page = name.endswith(_SUFFIX) and self.scheme.owns(name[: -len(_SUFFIX)])
            leftover = name.startswith(".") and name.endswith(_TMP_SUFFIX)
            if page or leftover:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self._io_error("clear", name, exc)

    def _discard(self, object_key: str) -> bool:
        try:
            os.unlink(self.path_of(object_key))
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._io_error("discard", object_key, exc)
            return False

    # --- internals ----------------------------------------------------------------------------

    def _tmp_path(self, key: str) -> Path:
        # Unique per process, thread and call, and hidden (leading dot) so listings and
        # ``clear`` can tell leftovers of a crashed writer from pages.
        unique = f"{os.getpid()}.{threading.get_ident()}.{next(self._tmp_ids)}"
        return self.root / f".{key}.{unique}{_TMP_SUFFIX}"

    def _write_atomic(self, path: Path, key: str, page: RawPage) -> bool:
        tmp = self._tmp_path(key)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, page)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            self._io_error("write", key, exc)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False

    def _io_error(self, op: str, key: str, exc: OSError) -> None:
        self._count(errors=1)
        with self._log_lock:
            first = not self._io_error_logged
            self._io_error_logged = True
        # One warning per backend; the counter carries the rest (a full disk fails every write).
        log.log(logging.WARNING if first else logging.DEBUG,
                "L3 file %s failed for %s: %s", op, key, exc)
        self._emit("io_error", what=op, error=str(exc))


def _read_parts(path: Path) -> RawPage:
    """(first ``HEADER_SIZE`` bytes, the rest to EOF) with positional reads: the payload lands
    in its own buffer with one copy, and reading to EOF (not to the length the header claims)
    lets the length check catch trailing garbage as well as truncation."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        header = os.pread(fd, envelope.HEADER_SIZE, 0)
        rest = size - len(header)
        payload = os.pread(fd, rest, len(header)) if rest > 0 else b""
        if len(payload) < rest:  # a short read: the file shrank under us, or a huge page
            payload += _read_to_end(fd, len(header) + len(payload))
        return header, payload
    finally:
        os.close(fd)


def _read_to_end(fd: int, offset: int) -> bytes:
    chunks = []
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, parts: RawPage) -> None:
    """Write header then payload with one ``writev`` (two syscalls only on a short write)."""
    total = sum(len(p) for p in parts)
    done = os.writev(fd, parts)
    if done < total:
        rest = memoryview(b"".join(parts))[done:]
        while rest:
            rest = rest[os.write(fd, rest) :]
