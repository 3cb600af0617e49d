"""The embedded default L3 backend: one file per page in a directory (SGLang's ``HiCacheFile``).

Each object is ``<dir>/<page hash><suffix>.bin`` holding one sealed page (envelope header +
payload), or with ``storage.format: upstream`` the raw page bytes SGLang writes
(``formats.py``; no checksum, so the envelope's guarantees below do not hold for those).
Why this is safe under concurrency and crashes:

* Writes go to a uniquely named temporary file in the same directory, then ``os.replace`` it
  into place. A reader sees either no file or a complete one, never a torn write; two ranks or
  threads writing the same key race harmlessly (same content, last rename wins).
* A key whose file exists is not rewritten (SGLang does the same: the prefix chain makes the
  content a function of the key).
* A file that is truncated, extended or altered on disk fails the envelope check: it is
  counted, deleted (so the next backup of that page rewrites it) and reported as a miss.
* Store contents are untrusted input. A page file's size is checked on the open descriptor
  before anything is read, and at most one header plus the page size the reader expects
  (``max_payload_bytes``) is ever read: a planted sparse 1 GiB file, a FIFO, a device or a
  symlink under a page's name is a counted corrupt miss, never an allocation, a hang or a
  crash.
* The default directory is private to the user (:func:`default_dir`): created 0700, and
  refused when someone else owns it or may write to it, because a page with a valid checksum
  can be forged by anyone who can write the store.

No fsync by default: L3 is a cache, and a page lost in a power cut is only a miss. Pass
``fsync=True`` for durability at a large write-cost.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from hicache_runtime.contracts.errors import CorruptPage, StorageUnavailable
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backend import RawPage, StorageBackend
from hicache_runtime.l3.formats import StorageFormat
from hicache_runtime.l3.keys import KeyScheme

if TYPE_CHECKING:
    from hicache_runtime.config import StorageConfig
    from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)

_SUFFIX = ".bin"
_TMP_SUFFIX = ".tmp"


def default_dir(base: Path | None = None) -> Path:
    """Where pages go when no path is configured: ``<tmp>/hicache-<uid>``, private to the user.

    SGLang defaults to a shared ``/tmp/hicache``; on a shared ``/tmp`` another user could then
    plant pages (with valid checksums) that this user's runs would serve. The directory is
    created 0700; an existing one is used only when it is a real directory (not a symlink)
    owned by this user that nobody else may write. ``base`` defaults to the system temporary
    directory (``$TMPDIR``). Raises :class:`StorageUnavailable` (one line, with a hint)
    otherwise.
    """
    root = Path(base if base is not None else tempfile.gettempdir()) / f"hicache-{os.getuid()}"
    ensure_private_dir(root)
    return root


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 directory, or check that the existing one is private.

    A directory this user owns that others may only read is tightened to 0700 (nothing can
    have been planted in it); one that others may write, or that someone else owns, is
    refused: pages already in it cannot be trusted.
    """
    hint = "remove it, or pass --storage-path DIR (a directory only you can write)"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageUnavailable(f"default L3 store {path} cannot be created: "
                                 f"{exc.strerror or exc}", hint=hint) from None
    try:
        st = os.lstat(path)  # lstat: a symlink planted under the name is not followed
    except OSError as exc:
        raise StorageUnavailable(f"default L3 store {path} is not usable: "
                                 f"{exc.strerror or exc}", hint=hint) from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorageUnavailable(f"default L3 store {path} is not a directory (a symlink or "
                                 "file is in its place)", hint=hint)
    if st.st_uid != os.getuid():
        raise StorageUnavailable(f"default L3 store {path} belongs to uid {st.st_uid}, not to "
                                 f"you (uid {os.getuid()}): its pages cannot be trusted",
                                 hint=hint)
    if st.st_mode & 0o022:
        raise StorageUnavailable(f"default L3 store {path} is writable by others (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): its pages cannot be "
                                 "trusted", hint=hint)
    if st.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise StorageUnavailable(f"default L3 store {path} cannot be made private: "
                                     f"{exc.strerror or exc}", hint=hint) from None


class FileBackend(StorageBackend):
    """Pages as files under ``root``. Thread-safe: no shared state besides the counters and a
    temp-name counter (``itertools.count`` is atomic under the GIL)."""

    name = "file"
    formats = (StorageFormat.ENVELOPE, StorageFormat.UPSTREAM)
    upstream_pp_since = (0, 5, 10)  # 0.5.13 hicache_storage.py L332-338

    def __init__(self, root: Path, scheme: KeyScheme, *, fsync: bool = False,
                 max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES,
                 tracer: Tracer | None = None) -> None:
        """Create ``root`` if needed and check that it is writable.

        ``max_payload_bytes`` is the largest page payload this backend reads or writes (the
        caller's page size; see :data:`envelope.DEFAULT_MAX_PAYLOAD_BYTES`). Raises
        :class:`StorageUnavailable` when the directory cannot be created or written.
        """
        super().__init__(scheme, tracer=tracer)
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
        self.root = Path(root)
        self.fsync = fsync
        self.max_payload_bytes = max_payload_bytes
        self._oversize_logged = False
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
                    tracer: Tracer | None = None,
                    max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES) -> FileBackend:
        """Build from ``storage.path`` (default :func:`default_dir`, checked private).
        ``required`` is accepted for symmetry with Redis; a local directory that is unusable
        always raises."""
        return cls(cfg.path or default_dir(), scheme, tracer=tracer,
                   max_payload_bytes=max_payload_bytes)

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
                path = self.path_of(key)
                out.append(read_parts(path, key, self.max_payload_bytes)
                           if self.upstream is None
                           else (b"", _read_exact(path, key, self.upstream.raw_bytes)))
            except FileNotFoundError:
                out.append(None)
            except CorruptPage as exc:
                # Rejected before its payload was read: a miss, counted and dropped here
                # (``verify`` only sees what was read).
                self._report_corrupt(exc)
                self._count(corrupt=1, discarded=int(self._discard(key)))
                out.append(None)
            except OSError as exc:
                self._io_error("read", key, exc)
                out.append(None)
        return out

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        out: list[bool] = []
        for key, page in zip(object_keys, pages):
            if len(page[1]) > self.max_payload_bytes:
                # It could never be read back (reads reject it from its size): not stored.
                self._oversize(key, len(page[1]))
                out.append(False)
                continue
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
        path = self.path_of(object_key)
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            # A directory planted under a page's name: removed when empty; otherwise it stays
            # (its contents are not ours to delete) and the page stays a miss.
            with contextlib.suppress(OSError):
                os.rmdir(path)
                return True
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

    def _oversize(self, key: str, size: int) -> None:
        with self._log_lock:
            first = not self._oversize_logged
            self._oversize_logged = True
        log.log(logging.WARNING if first else logging.DEBUG,
                "L3 file: page %s is %d bytes, more than max_payload_bytes %d; not stored",
                key, size, self.max_payload_bytes)

    def _io_error(self, op: str, key: str, exc: OSError) -> None:
        self._count(errors=1)
        with self._log_lock:
            first = not self._io_error_logged
            self._io_error_logged = True
        # One warning per backend; the counter carries the rest (a full disk fails every write).
        log.log(logging.WARNING if first else logging.DEBUG,
                "L3 file %s failed for %s: %s", op, key, exc)
        self._emit("io_error", what=op, error=str(exc))


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
"""No symlinks (a link planted under a page's name is refused by the kernel, ``ELOOP``), and
never block in ``open`` (a FIFO planted there would wait for a writer forever)."""


def read_parts(path: Path, key: str, limit: int) -> RawPage:
    """(the ``HEADER_SIZE``-byte header, the payload) with positional reads, reading at most
    one header plus ``limit`` payload bytes whatever is on disk.

    Checks on the open descriptor, before reading: a regular file, no bigger than a header
    plus ``limit``, and exactly as long as its header says. Raises :class:`CorruptPage` for
    anything else (a short or unparsable header is returned as read, for ``verify`` to reject
    with its usual message), ``FileNotFoundError`` when absent, ``OSError`` on I/O errors.
    """
    fd, size = open_page(path, key)
    try:
        envelope.check_size(key, size, limit)
        header = os.pread(fd, envelope.HEADER_SIZE, 0)
        try:
            length, _crc, _version = envelope.parse_header(key, header)
        except CorruptPage:
            return header, b""  # ``verify`` rejects the header and says why
        if size != envelope.HEADER_SIZE + length:
            raise CorruptPage(f"{key}: file is {size} bytes, its header says "
                              f"{envelope.HEADER_SIZE + length} (truncated or overlong)")
        payload = os.pread(fd, length, envelope.HEADER_SIZE)
        if len(payload) < length:  # a short read, or the file shrank under us
            payload += _read_upto(fd, envelope.HEADER_SIZE + len(payload), length - len(payload))
        return header, payload
    finally:
        os.close(fd)


def _read_exact(path: Path, key: str, size: int) -> bytes:
    """An upstream page file (raw bytes, no header): exactly ``size`` bytes, checked on the
    open descriptor before anything is read, as :func:`read_parts` does for envelopes.
    Raises :class:`CorruptPage` for another size, a symlink or a special file."""
    fd, found = open_page(path, key)
    try:
        if found != size:
            raise CorruptPage(f"{key}: an upstream page of {found} bytes; this rank's pages "
                              f"are {size}")
        return _read_upto(fd, 0, size)
    finally:
        os.close(fd)


def open_page(path: Path, key: str) -> tuple[int, int]:
    """``(descriptor, size)`` of a page file that is a regular file; the caller closes it.
    Raises ``FileNotFoundError`` when absent and :class:`CorruptPage` for a symlink, a FIFO
    or another special file in the page's place (refused by the kernel or by ``fstat``)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise CorruptPage(f"{key}: a symlink or special file is in the page's place")\
                from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptPage(f"{key}: not a regular file (mode {st.st_mode:o})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _read_upto(fd: int, offset: int, want: int) -> bytes:
    """At most ``want`` bytes from ``offset`` (fewer at EOF)."""
    chunks = []
    while want > 0 and (chunk := os.pread(fd, min(want, 1 << 20), offset)):
        chunks.append(chunk)
        offset += len(chunk)
        want -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, parts: RawPage) -> None:
    """Write header then payload with one ``writev`` (two syscalls only on a short write)."""
    total = sum(len(p) for p in parts)
    done = os.writev(fd, parts)
    if done < total:
        rest = memoryview(b"".join(parts))[done:]
        while rest:
            rest = rest[os.write(fd, rest) :]
