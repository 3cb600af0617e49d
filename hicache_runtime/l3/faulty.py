"""Storage fault injection: a backend wrapper acting at the ``storage.*`` fault points.

What a fired fault does here is its kind's (``faults.kinds``), through the storage hooks of
:class:`~faults.kinds.base.Kind`, applied in this order on each call:

* ``before_storage``: before the call (``storage-latency`` sleeps ``ms``; ``storage-error``
  with ``mode=raise`` raises :class:`InjectedFault`, as a client library that throws, which
  the L3 threads must survive);
* ``fails_storage`` (get, set): the call fails soft without touching the medium: every page a
  miss, every write ``False`` (``storage-error``);
* ``corrupts_reads`` (page, once per page a get read): one byte of that page's stored payload
  is flipped in memory **before** the envelope check, so the checksum must reject it: that
  page is a miss, counted as corrupt, and the stored object is left alone
  (``storage-corrupt``). Decided per page, by its key and how often it was read before (the
  injector's ``key``), so how many reads are hit does not hang on how the prefetch thread
  happened to batch them;
* ``shortens_exists`` (exists): the leading count the caller sees (``storage-shortfall``
  ``mode=short``: ``pages`` fewer, never below 0);
* ``blanks`` (get): offsets of the batch that come back ``None`` while later pages still load
  (``storage-shortfall`` ``mode=holes``: ``at`` .. ``at+pages-1``).

Zero cost when off: :func:`wrap_faults` returns the backend itself when no storage point is
armed on this rank, so the runtime never pays for a wrapper it does not need.

Thread-safety: the injector is thread-safe and decides per calling thread (its determinism
contract); the wrapper's own counters are guarded by the base class lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from faults.kinds import KINDS, StorageOp
from faults.points import FaultPoint
from hicache_runtime.l3.backend import RawPage, StorageBackend, StorageCallInfo, StorageStats

if TYPE_CHECKING:
    from faults.injector import FaultInjector
    from faults.spec import FaultSpec

_STORAGE_POINTS = (FaultPoint.STORAGE_EXISTS, FaultPoint.STORAGE_GET, FaultPoint.STORAGE_PAGE,
                   FaultPoint.STORAGE_SET)


def wrap_faults(backend: StorageBackend, injector: FaultInjector | None,
                step: Callable[[], int] | None = None) -> StorageBackend:
    """``backend`` wrapped in a :class:`FaultyBackend` if any storage fault is armed on this
    rank, else ``backend`` itself. ``step`` reads the current scheduler step (for ``steps=``
    selectors) when a call carries none."""
    if injector is None or not any(injector.armed(p) for p in _STORAGE_POINTS):
        return backend
    return FaultyBackend(backend, injector, step)


class FaultyBackend(StorageBackend):
    """Wraps another backend; every call goes to it unless a fault replaces the answer.

    ``stats()`` is the inner backend's counters plus the calls this wrapper answered itself
    (``storage-error``), the pages it blanked (holes count as misses) and ``injected``.
    """

    def __init__(self, inner: StorageBackend, injector: FaultInjector,
                 step: Callable[[], int] | None = None) -> None:
        super().__init__(inner.scheme, tracer=inner.tracer)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # report as the backend it wraps
        self.injector = injector
        self._step = step or (lambda: 0)
        self._per_page = injector.armed(FaultPoint.STORAGE_PAGE)
        self._page_reads: Counter[str] = Counter()
        self._reads_lock = threading.Lock()

    # --- the interface ----------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str], info: StorageCallInfo | None = None) -> int:
        fired = self._fire(FaultPoint.STORAGE_EXISTS, "exists", info)
        n = self.inner.batch_exists(keys, info)
        for spec in fired:
            n = KINDS[spec.kind].shortens_exists(spec, n)
        return n

    def batch_get(self, keys: Sequence[str],
                  info: StorageCallInfo | None = None) -> list[bytes | None]:
        fired = self._fire(FaultPoint.STORAGE_GET, "get", info)
        if any(KINDS[s.kind].fails_storage(s, "get") for s in fired):
            self._count(get_calls=1, gets=len(keys), misses=len(keys))
            return [None] * len(keys)
        if self._per_page:
            obj = self.inner.scheme.object_keys(keys)
            t0 = time.perf_counter()
            raws: list[RawPage | None] = \
                self.inner.read_raw(obj) if self.inner.healthy and obj else [None] * len(obj)
            flipped = self._corrupt_pages(obj, raws, info)
            # The objects flipped stay: the stored object is fine, only our copy is bad.
            out = self.inner.verify(obj, raws, t0=t0, keep=flipped)
        else:
            out = self.inner.batch_get(keys, info)
        for spec in fired:
            for i in KINDS[spec.kind].blanks(spec, len(out)):
                blanked = out[i]
                out[i] = None
                if blanked is not None:  # the inner backend counted a hit; the caller sees a miss
                    self._count(hits=-1, misses=1, bytes_read=-len(blanked))
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes],
                  info: StorageCallInfo | None = None) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        fired = self._fire(FaultPoint.STORAGE_SET, "set", info)
        if any(KINDS[s.kind].fails_storage(s, "set") for s in fired):
            self._count(set_calls=1, sets=len(keys), set_failures=len(keys))
            return [False] * len(keys)
        return self.inner.batch_set(keys, values, info)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> StorageStats:
        return self.inner.stats() + super().stats()

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    def client_log(self) -> str | None:
        return self.inner.client_log()

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return self.inner.describe() + " with injected faults"

    # --- hooks: delegate (used only if someone calls them on the wrapper) ------------------

    def _exists_leading(self, object_keys: list[str]) -> int:
        return self.inner._exists_leading(object_keys)

    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        return self.inner.read_raw(object_keys)

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        return self.inner.write_sealed(object_keys, pages)

    def _clear(self) -> None:
        self.inner.clear()

    # --- internals ----------------------------------------------------------------------------

    def _fire(self, point: FaultPoint, op: StorageOp, info: StorageCallInfo | None,
              key: str | None = None) -> list[FaultSpec]:
        step = info.step if info is not None and info.step is not None else self._step()
        rid = info.rid if info is not None else None
        pool = info.pool if info is not None else "kv"
        fired = self.injector.fire(point, step=step, rid=rid, pool=pool, key=key)
        if fired:
            self._count(injected=len(fired))
        for spec in fired:
            KINDS[spec.kind].before_storage(spec, op)
        return fired

    def _corrupt_pages(self, obj: list[str], raws: list[RawPage | None],
                       info: StorageCallInfo | None) -> set[str]:
        """Flip one payload byte of each present page a ``storage.page`` fault hits, in
        ``raws``; the objects flipped. The n-th read of an object is one visit, keyed
        ``object#n``: a page read again may be read fine (a bad read, not a bad medium), and
        the byte is a seeded draw of the same key."""
        flipped: set[str] = set()
        for i, (name, raw) in enumerate(zip(obj, raws, strict=True)):
            if raw is None or not raw[1]:
                continue
            with self._reads_lock:
                nth = self._page_reads[name]
                self._page_reads[name] = nth + 1
            visit = f"{name}#{nth}"
            fired = self._fire(FaultPoint.STORAGE_PAGE, "get", info, key=visit)
            if not any(KINDS[s.kind].corrupts_reads(s) for s in fired):
                continue
            header, payload = raw
            pos = int(self.injector.draw(f"storage-corrupt/byte/{visit}", 0) * len(payload))
            bad = bytearray(payload)
            bad[pos] ^= 0xFF
            raws[i] = (header, bytes(bad))
            flipped.add(name)
        return flipped
