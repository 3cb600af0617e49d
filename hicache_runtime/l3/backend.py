"""The L3 storage interface every backend implements (SGLang's ``HiCacheStorage``, §4.1).

Keys passed to the public methods are **page hashes** (``keys.py``); the backend turns them into
object keys with its :class:`~hicache_runtime.l3.keys.KeyScheme` (page hash + rank suffix),
as SGLang's backends do. Values are page payloads (``pages.py``); the backend wraps each in the
checksummed envelope (``envelope.py``) on write and verifies it on read.

Contract, for every backend:

* ``batch_exists(keys) -> int``: how many keys **from the start** exist (a count, not a mask;
  the first missing key ends the run even if later ones exist). It does not verify contents:
  a corrupt object still counts as existing and turns into a miss at ``batch_get``.
* ``batch_get(keys) -> list[bytes | None]``: one entry per key, in order. ``None`` is a miss:
  absent, unreadable, or failing its integrity check. A corrupt or truncated object is counted
  (``corrupt``), optionally dropped so a later backup can rewrite it, and **never returned**.
  Misses can be anywhere ("holes"); callers use the leading run of hits.
* ``batch_set(keys, values) -> list[bool]``: one entry per key. ``True`` means the object is
  stored (written now, or already there: writes skip existing keys); ``False`` means it was not.
* Failures of the medium (I/O errors, a Redis outage) never raise out of these three calls: they
  fail soft (exists → 0, get → all ``None``, set → all ``False``) and are counted. Only
  construction raises (:class:`StorageUnavailable`) when the medium is
  unusable and required. Bad arguments (mismatched lengths, malformed hashes) raise
  ``ValueError``: those are bugs in the caller, not storage faults.
* After ``close()`` the three calls fail soft without touching the medium.

Thread-safety: the prefetch IO thread (gets), the prefetch query thread (exists) and the backup
thread (sets) call one backend concurrently, and the scheduler thread may read ``stats()``. Every
public method is safe to call from any thread at any time. The base class guards its counters
with a lock; backends keep no other shared mutable state outside their own locks (the file
backend relies on atomic renames, the Redis backend on redis-py's thread-safe connection pool).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.contracts.events import Ev
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.formats import StorageFormat, UpstreamPages, pp_problem
from hicache_runtime.l3.keys import KeyScheme

if TYPE_CHECKING:
    from pathlib import Path

    from hicache_runtime.config import StorageConfig
    from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)

RawPage = tuple[bytes, bytes]
"""A sealed object in two parts: (envelope header, payload). Reads give (the first
``HEADER_SIZE`` bytes, everything after them), unverified; writes get a header from
``envelope.seal_parts``. Two parts, so no backend copies a page just to prepend a header."""


class PrivateStore(Protocol):
    """A throwaway server of a backend (``StorageBackend.throwaway``): ``with`` starts it and
    stops it; ``url`` is what ``storage.url`` names it by."""

    @property
    def url(self) -> str: ...

    def __enter__(self) -> PrivateStore: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass
class StorageStats:
    """Counters of one backend since construction. ``stats()`` returns a snapshot copy.

    Key counts, not call counts, except ``*_calls``. ``gets == hits + misses`` and ``misses``
    includes ``corrupt``; ``sets == stored + set_failures`` where ``stored`` includes
    ``set_skipped`` (already present). Bytes are payload bytes (envelope excluded).
    """

    exists_calls: int = 0
    exists_keys: int = 0
    exists_hits: int = 0
    """Sum of the leading-contiguous counts returned."""
    get_calls: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    """Objects that failed the integrity check (subset of ``misses``)."""
    discarded: int = 0
    """Corrupt objects removed from the medium so a later backup can rewrite them."""
    set_calls: int = 0
    sets: int = 0
    stored: int = 0
    set_skipped: int = 0
    set_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    """Failed medium operations (I/O errors, connection errors), per call or per key."""
    outages: int = 0
    """Times the backend went from healthy to unavailable (Redis connection loss)."""
    reconnects: int = 0
    """Times it came back."""
    injected: int = 0
    """Faults injected by the faulty wrapper (only when one is armed)."""
    exists_s: float = 0.0
    get_s: float = 0.0
    set_s: float = 0.0

    def __add__(self, other: StorageStats) -> StorageStats:
        return StorageStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in fields(self)})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StorageCallInfo:
    """Optional context of one call (SGLang's ``extra_info``); backends may ignore it.

    The fault wrapper uses it so request and step selectors of fault specs apply.
    """

    rid: str | None = None
    step: int | None = None
    pool: str = "kv"
    """Which objects the call touches: "kv" pages or a hybrid sidecar pool's pages."""


class StorageBackend(ABC):
    """One rank's view of an L3 store. See the module docstring for the full contract.

    Subclasses implement the object-key hooks (``_exists_leading``, ``read_raw``,
    ``write_sealed``, ``_clear``, ``_discard``, ``_close``); the public methods here add key
    suffixes, the envelope, the closed check and the counters.
    """

    name: ClassVar[str] = "abstract"

    # --- what a backend states about itself ----------------------------------------------
    # The config, the CLI, campaigns and replays read these instead of naming backends, so a
    # backend is one module (and, for a built-in, one line in ``contracts/l3_backends.py``).

    url_schemes: ClassVar[tuple[str, ...]] = ()
    """The schemes ``storage.url`` may use with this backend. Empty: it takes no URL. A
    backend that takes one keeps its store in a server outside the run: a campaign's
    ``--storage-url`` applies to its cells and a replay does not contact the bundle's."""
    url_example: ClassVar[str] = ""
    """A URL of this backend, shown in errors and hints and used to check a campaign spec
    before the command line names the real one."""
    url_required: ClassVar[bool] = False
    """Only the user may name its server: no private store is started without a URL."""
    formats: ClassVar[tuple[StorageFormat, ...]] = (StorageFormat.ENVELOPE,)
    """The page formats it can store (``formats.py``); every backend has the envelope."""
    upstream_pp_since: ClassVar[tuple[int, ...]] = (0,)
    """The first SGLang release whose keys of this backend name the pipeline stage: before
    it, a PP run has no upstream form."""

    @classmethod
    def url_problem(cls, url: str) -> str | None:
        """What is wrong with ``url`` for this backend, or None. A URL comes from files and
        command lines: this is the boundary, so a bad one is a one-line error here and never
        an exception from a client library. Backends with a URL add their own checks."""
        if not cls.url_schemes:
            return f"the {cls.name} backend takes no URL"
        if len(url) > 2048:
            return "the URL is longer than 2048 characters"
        if not url.isprintable() or any(c.isspace() for c in url):
            return "the URL holds spaces or control characters"
        scheme = url.partition(":")[0] if ":" in url else ""
        if scheme not in cls.url_schemes:
            return (f"scheme {scheme[:20] or 'missing'!r} is not one of "
                    f"{', '.join(cls.url_schemes)}")
        return None

    @classmethod
    def format_problem(cls, fmt: StorageFormat, mem_layout: str, release: str | None = None,
                       pp: int = 1) -> str | None:
        """Why this backend cannot store ``fmt`` pages from a host pool of ``mem_layout`` for a
        ``pp``-stage run of SGLang ``release`` (None: the proposed protocols), or None.
        Default: any format in :attr:`formats`, for a PP run from :attr:`upstream_pp_since`."""
        if fmt not in cls.formats:
            return f"the {cls.name} backend has no {fmt.value} page format"
        if fmt is StorageFormat.UPSTREAM:
            return pp_problem(cls.name, cls.upstream_pp_since, release, pp)
        return None

    @classmethod
    def throwaway(cls, workdir: Path | None = None) -> PrivateStore | None:
        """A private store of this backend on this machine, not started (``with`` starts it
        and stops it, and its ``url`` names it), or None when the backend has no server to
        start. Tests, and runs without a URL, use it; ``workdir`` keeps its files (a fresh
        temporary directory when None)."""
        return None

    def __init__(self, scheme: KeyScheme, *, tracer: Tracer | None = None) -> None:
        self.scheme = scheme
        self.tracer = tracer
        self._stats = StorageStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._corrupt_logged = False
        self.upstream: UpstreamPages | None = None
        """Set by :meth:`store_upstream`: pages are upstream's raw bytes, not envelopes."""

    def store_upstream(self, pages: UpstreamPages) -> None:
        """Store and read pages in upstream's raw form from now on (``storage.format:
        upstream``). Raises ``ValueError`` for a backend that has no upstream form."""
        if StorageFormat.UPSTREAM not in self.formats:
            raise ValueError(f"the {self.name} backend has no upstream page format")
        self.upstream = pages

    # --- the interface ----------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], info: StorageCallInfo | None = None) -> int:
        """Count of leading page hashes in ``keys`` whose objects exist. Never raises for
        medium failures (returns 0). Mutates only counters."""
        obj = self.scheme.object_keys(keys)
        t0 = time.perf_counter()
        n = 0 if self._closed or not obj else self._exists_leading(obj)
        n = max(0, min(n, len(obj)))
        self._count(exists_calls=1, exists_keys=len(obj), exists_hits=n,
                    exists_s=time.perf_counter() - t0)
        return n

    def exists(self, key: str) -> bool:
        """Whether one page hash's object exists."""
        return self.batch_exists([key]) == 1

    def batch_get(self, keys: Sequence[str],
                  info: StorageCallInfo | None = None) -> list[bytes | None]:
        """Verified payloads, ``None`` for each miss (absent, unreadable or corrupt).

        Never raises for medium failures or corrupt objects. May delete a corrupt object from
        the medium (counted as ``discarded``).
        """
        obj = self.scheme.object_keys(keys)
        t0 = time.perf_counter()
        raws: list[RawPage | None] = [None] * len(obj) if self._closed or not obj \
            else self.read_raw(obj)
        return self.verify(obj, raws, t0=t0)

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes],
                  info: StorageCallInfo | None = None) -> list[bool]:
        """Store payloads under page hashes; per key ``True`` when stored (or already there).

        Existing objects are not rewritten. Never raises for medium failures (those keys get
        ``False``). Raises ``ValueError`` when ``keys`` and ``values`` differ in length.
        """
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        obj = self.scheme.object_keys(keys)
        t0 = time.perf_counter()
        if self._closed or not obj:
            ok = [False] * len(obj)
        elif self.upstream is not None:
            up = self.upstream
            ok = self.write_sealed(obj, [(b"", up.to_raw(k, v)) for k, v in zip(obj, values)])
        else:
            ok = self.write_sealed(obj, [envelope.seal_parts(k, v) for k, v in zip(obj, values)])
        stored = sum(ok)
        self._count(set_calls=1, sets=len(obj), stored=stored, set_failures=len(obj) - stored,
                    bytes_written=sum(len(v) for v, good in zip(values, ok) if good),
                    set_s=time.perf_counter() - t0)
        return ok

    def clear(self) -> None:
        """Delete every object carrying this backend's key suffix (this rank's objects, or the
        stage's shared objects with shared keys). Other ranks' objects are left alone."""
        if not self._closed:
            self._clear()

    def stats(self) -> StorageStats:
        """A snapshot copy of the counters (safe to read from any thread)."""
        with self._stats_lock:
            return StorageStats(**asdict(self._stats))

    @property
    def healthy(self) -> bool:
        """False while the medium is known to be unavailable (calls fail soft)."""
        return not self._closed

    def client_log(self) -> str | None:
        """The backend's client library's own log lines, when it keeps them outside Python
        logging (a crash bundle carries them as ``storage-client.log``); None by default."""
        return None

    @staticmethod
    def unavailable(cfg: StorageConfig) -> str | None:
        """Why this machine cannot run the backend (a client library or program missing), or
        None; campaign cells skip with the reason. Backends that need nothing keep the
        default."""
        return None

    def close(self) -> None:
        """Release connections and handles. Idempotent; later calls fail soft."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        """One line for logs and summaries: backend name and where it stores."""
        return f"{self.name} (suffix {self.scheme.suffix})"

    # --- verification, shared with the fault wrapper ---------------------------------------

    def verify(self, object_keys: Sequence[str], raws: Sequence[RawPage | None], *,
               t0: float | None = None,
               keep: Collection[str] = ()) -> list[bytes | None]:
        """Turn raw objects into verified payloads, counting hits, misses and corrupt ones.

        A corrupt object is deleted from the medium (``discarded``) unless ``keep`` names it:
        its corruption was injected in memory and the stored object is fine.
        """
        out: list[bytes | None] = []
        corrupt: list[str] = []
        nbytes = 0
        for key, raw in zip(object_keys, raws):
            if raw is None:
                out.append(None)
                continue
            try:
                payload = envelope.open_parts(key, raw[0], raw[1]) if self.upstream is None \
                    else self.upstream.from_raw(key, raw[0] + raw[1])
            except CorruptPage as exc:
                corrupt.append(key)
                self._report_corrupt(exc)
                out.append(None)
                continue
            nbytes += len(payload)
            out.append(payload)
        discarded = 0
        if corrupt and not self._closed:
            for key in corrupt:
                if key not in keep:
                    discarded += int(self._discard(key))
        hits = sum(p is not None for p in out)
        self._count(get_calls=1, gets=len(out), hits=hits, misses=len(out) - hits,
                    corrupt=len(corrupt), discarded=discarded, bytes_read=nbytes,
                    get_s=0.0 if t0 is None else time.perf_counter() - t0)
        return out

    # --- backend hooks (object keys) --------------------------------------------------------

    @abstractmethod
    def _exists_leading(self, object_keys: list[str]) -> int:
        """Leading-contiguous count of existing objects; 0 on medium failure (counted)."""

    @abstractmethod
    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        """The stored objects, unverified; ``None`` where absent or unreadable (counted)."""

    @abstractmethod
    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        """Store sealed objects (header then payload), skipping existing objects (``True``
        for those); ``False`` where the medium failed (counted)."""

    @abstractmethod
    def _clear(self) -> None: ...

    def _discard(self, object_key: str) -> bool:
        """Remove a corrupt object; True when removed. Default: keep it."""
        return False

    def _close(self) -> None:
        """Release resources (default: nothing)."""

    # --- helpers for subclasses -------------------------------------------------------------

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _emit(self, op: str, **attrs: Any) -> None:
        if self.tracer is not None:
            self.tracer.emit(Ev.STORAGE, backend=self.name, op=op, **attrs)

    def _report_corrupt(self, exc: CorruptPage) -> None:
        # The first corrupt page of a backend is a warning; later ones are debug lines (the
        # counter and the trace keep the full record) so a bad disk cannot flood the log.
        level = logging.DEBUG if self._corrupt_logged else logging.WARNING
        self._corrupt_logged = True
        log.log(level, "L3 %s: corrupt page treated as a miss: %s", self.name, exc)
        self._emit("corrupt", error=str(exc))
