"""The Mooncake Store L3 backend: pages as objects in a Mooncake distributed store.

``--storage mooncake --storage-url mooncake://HOST:RPC_PORT?metadata=http://HOST:PORT/metadata``
(the URL is parsed in ``mooncake_client``). The calls keep upstream SGLang's semantics for its
``MooncakeStore``:

* ``batch_exists``: one ``batch_is_exist`` per batch; the count of leading keys that exist;
* ``batch_get``: one ``batch_get_into`` per batch, straight into a buffer registered with the
  client (``register_buffer``), one slot of header + largest page per key, so an object bigger
  than any page cannot be read (the client refuses it: a counted corrupt miss);
* ``batch_set``: ``batch_is_exist`` first and one put of the missing keys only (existing
  objects are kept: a key names its content): over TCP ``batch_put_from_multi_buffers`` from
  where each envelope header and payload lie (no staging copy), over RDMA ``batch_put_from``
  from the registered buffer (RDMA reads registered memory only);
* keys carry the rank suffix of every backend (``keys.KeyScheme``: per TP rank, or one shared
  object per stage with ``single_writer``, where only TP rank 0 writes), and values are the
  same checksummed envelopes, so corruption is caught the same way as with files or Redis.

Outages. The client's ping thread notices a lost master at once and ``health_check()`` (a local
read) then says so; calls made then would block for seconds each inside the client. So every
call first asks ``health_check()``; while the master is away calls fail soft at once and are
counted, the backend logs one warning per outage and emits ``l3.storage`` trace events
``outage`` / ``reconnect``, and one caller at a time probes again after an exponential
backoff. The client reconnects by itself when the master is back (a restarted master has lost
its objects: misses until backups refill it). A master that was unreachable when the backend
was built (``required=False``) is joined by the first probe that finds it up.

Buffers are per thread (the query, IO and backup threads call concurrently); they are kept in a
dict owned by the backend, registered once and unregistered at ``close``. Client calls are
thread-safe. The client's own log lines are what the doctor reads in a bundle
(:meth:`MooncakeBackend.client_log`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from hicache_runtime.contracts.errors import ConfigError, CorruptPage, StorageUnavailable
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backend import RawPage, StorageBackend
from hicache_runtime.l3.backends import mooncake_client as mc
from hicache_runtime.l3.formats import StorageFormat
from hicache_runtime.l3.keys import KeyScheme
from hicache_runtime.l3.outage import Outage

if TYPE_CHECKING:
    from pathlib import Path

    from hicache_runtime.config import StorageConfig
    from hicache_runtime.l3.backends.mooncake_master import LocalMooncakeStore
    from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)
T = TypeVar("T")
_MIN_ARENA_BYTES = 4 << 20
"""Smallest per-thread buffer: a few batches of ordinary pages, so it rarely grows."""
_CLOSE_WAIT_S = 10.0
"""How long ``close`` waits for calls still running on other threads before it gives up and
leaves the client open: freeing the native client under a call crashes the process."""


class _Arena:
    """One thread's registered transfer buffer: anonymous memory (pages are only committed
    where a transfer touches them, so a slot sized for the largest page costs nothing until a
    page that large arrives)."""

    def __init__(self, client: Any, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self._anchor = ctypes.c_char.from_buffer(self.mem)
        self.addr = ctypes.addressof(self._anchor)
        self.size = size
        self.view = memoryview(self.mem)
        rc = client.register_buffer(self.addr, size)
        if rc != 0:
            raise OSError(f"register_buffer of {size} bytes failed ({mc.code_name(rc)})")

    def release(self, client: Any) -> None:
        client.unregister_buffer(self.addr)
        self.view.release()
        del self._anchor  # the last export: the mapping can now be closed
        self.mem.close()


def _escape(text: str) -> str:
    """``text`` as a literal in the client's regular expressions."""
    return "".join(c if c.isalnum() or c == "_" else f"\\{c}" for c in text)


def _address(data: bytes) -> int:
    """Where the bytes of an (immutable) bytes object lie; valid while the caller holds it."""
    return int(ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0)


class MooncakeBackend(StorageBackend):
    """Pages in a Mooncake Store. See the module docstring for semantics and outages."""

    name = "mooncake"
    formats = (StorageFormat.ENVELOPE, StorageFormat.UPSTREAM)
    upstream_pp_since = (0, 5, 8)  # mha_suffix with the PP rank (0.5.13 L508-512)
    url_schemes = (mc.SCHEME,)
    url_example = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"

    @classmethod
    def url_problem(cls, url: str) -> str | None:
        try:
            mc.parse_url(url)
        except ConfigError as exc:
            return str(exc).partition(": ")[2]  # without the field, which the caller names
        return None

    @classmethod
    def format_problem(cls, fmt: StorageFormat, mem_layout: str, release: str | None = None,
                       pp: int = 1) -> str | None:
        if fmt is StorageFormat.UPSTREAM and mem_layout == "layer_first":
            # upstream keeps a page as two objects, each one contiguous block of the pool
            return ("upstream Mooncake pages are a K and a V object, each one block of a "
                    "page_first or page_first_direct host pool (0.5.23 mooncake_store.py "
                    "refuses layer_first, L1319-1323); pass --mem-layout page_first")
        return super().format_problem(fmt, mem_layout, release, pp)

    @classmethod
    def throwaway(cls, workdir: Path | None = None) -> LocalMooncakeStore:
        """``mooncake_master`` and one segment holder on 127.0.0.1 (what a run without
        ``storage.url`` gets)."""
        from hicache_runtime.l3.backends.mooncake_master import LocalMooncakeStore

        return LocalMooncakeStore(workdir=workdir)

    def __init__(self, url: str, scheme: KeyScheme, *, required: bool = True,
                 reconnect_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 connect_timeout_s: float = 1.0,
                 max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES,
                 tracer: Tracer | None = None) -> None:
        """Join the store.

        Raises :class:`ConfigError` for a malformed URL and
        :class:`~hicache_runtime.contracts.errors.ToolUnavailable` when the client library is
        missing. When the master does not answer: with ``required`` raises
        :class:`StorageUnavailable`; without it, logs once and starts in the outage state.
        """
        super().__init__(scheme, tracer=tracer)
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
        self.target = mc.parse_url(url)
        self.url = self.target.url
        self.max_payload_bytes = max_payload_bytes
        self.slot_bytes = envelope.HEADER_SIZE + max_payload_bytes
        self.connect_timeout_s = connect_timeout_s
        self._client: Any = None
        self._arenas: dict[int, _Arena] = {}
        self._calls = threading.Condition()
        self._running = 0
        """Client calls under way (``_call``); ``close`` frees the client only at none."""
        self.outage = Outage("mooncake", self.target.master, base_backoff_s=reconnect_backoff_s,
                             max_backoff_s=max_backoff_s, count=self._count, emit=self._emit,
                             url=self.url)
        self._warned: set[str] = set()
        self._log_start = 0
        problem = mc.reachable(self.target, connect_timeout_s)
        try:
            if problem is None:
                self._open()
        except StorageUnavailable as exc:
            problem = str(exc)
        if problem is not None:
            if required:
                raise StorageUnavailable(
                    f"Mooncake master at {self.target.master} is unreachable ({problem})",
                    hint="start mooncake_master (or omit --storage-url for a private one), fix "
                         "--storage-url, or pass --storage-optional to start with L3 off")
            self.outage.mark_down(problem)

    @classmethod
    def from_config(cls, cfg: StorageConfig, scheme: KeyScheme, *, required: bool = True,
                    tracer: Tracer | None = None,
                    max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES
                    ) -> MooncakeBackend:
        if not cfg.url:
            raise ConfigError("storage.url", "the mooncake backend needs the master's URL",
                              hint=mc.URL_HINT)
        return cls(cfg.url, scheme, required=required,
                   reconnect_backoff_s=cfg.reconnect_backoff_s,
                   max_backoff_s=cfg.reconnect_backoff_max_s, tracer=tracer,
                   max_payload_bytes=max_payload_bytes)

    @staticmethod
    def unavailable(cfg: StorageConfig) -> str | None:
        """Why this machine cannot run the backend (campaign cells skip with it), or None:
        the client library, and without a URL the programs of a private store."""
        from hicache_runtime.l3.backends.mooncake_master import mooncake_binary

        if not mc.mooncake_installed():
            return f"the Mooncake client is not installed ({mc.INSTALL_HINT})"
        missing = [b for b in ("mooncake_master", "mooncake_client") if not mooncake_binary(b)]
        if not cfg.url and missing:
            return f"{', '.join(missing)} not found for a private store ({mc.INSTALL_HINT})"
        return None

    def describe(self) -> str:
        return f"mooncake:{self.target.master} (suffix {self.scheme.suffix})"

    @property
    def healthy(self) -> bool:
        return not self._closed and not self.outage.down

    @property
    def last_error(self) -> str:
        """The error that started (or last extended) the current outage."""
        return self.outage.last_error

    def client_log(self) -> str | None:
        """The Mooncake client's own log lines since this backend joined the store (bounded),
        or None when the client logs to stderr (``MC_LOG_DIR`` unset)."""
        return mc.client_log_tail(self._log_start)

    # --- hooks --------------------------------------------------------------------------------

    def _exists_leading(self, object_keys: list[str]) -> int:
        per_page = 1 if self.upstream is None else 2  # upstream: K then V of each page

        def run(client: Any) -> int:
            n = 0
            for code in client.batch_is_exist(self._store_keys(object_keys)):
                if code != 1:
                    if code < 0:
                        self._check_code("exists", code)
                    break
                n += 1
            return n // per_page
        return self._call("exists", run, 0)

    def _store_keys(self, object_keys: list[str]) -> list[str]:
        """The store's keys of ``object_keys``: themselves, or upstream's K and V of each."""
        if self.upstream is None:
            return object_keys
        return [k for key in object_keys for k in self.upstream.kv_keys(key)]

    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        if self.upstream is not None:
            return self._read_upstream(object_keys, self.upstream.raw_bytes // 2)

        def run(client: Any) -> list[RawPage | None]:
            arena = self._arena(client, len(object_keys) * self.slot_bytes)
            slot = self.slot_bytes
            codes = client.batch_get_into(object_keys, [arena.addr + i * slot
                                                        for i in range(len(object_keys))],
                                          [slot] * len(object_keys))
            out: list[RawPage | None] = []
            for i, (key, code) in enumerate(zip(object_keys, codes)):
                if code > 0:
                    base = i * slot
                    out.append((bytes(arena.view[base : base + envelope.HEADER_SIZE]),
                                bytes(arena.view[base + envelope.HEADER_SIZE : base + code])))
                elif code == mc.INVALID_PARAMS:
                    # The object does not fit one slot: bigger than any page, never read.
                    self._reject(key)
                    out.append(None)
                else:
                    if code < 0 and code not in mc.MISS_CODES:
                        self._check_code("get", code)
                    out.append(None)
            return out
        return self._call("get", run, [None] * len(object_keys))

    def _read_upstream(self, object_keys: list[str], half: int) -> list[RawPage | None]:
        """Upstream pages: each page's K and V objects, read into two slots of a page half
        each; a page is its K bytes then its V bytes (upstream's file form), or a miss."""
        keys = self._store_keys(object_keys)

        def run(client: Any) -> list[RawPage | None]:
            arena = self._arena(client, len(keys) * half)
            codes = client.batch_get_into(keys, [arena.addr + i * half for i in range(len(keys))],
                                          [half] * len(keys))
            out: list[RawPage | None] = []
            for i, key in enumerate(object_keys):
                k, v = codes[2 * i], codes[2 * i + 1]
                if k == half and v == half:
                    out.append((b"", bytes(arena.view[2 * i * half : (2 * i + 2) * half])))
                    continue
                if k == mc.INVALID_PARAMS or v == mc.INVALID_PARAMS or 0 < min(k, v) < half:
                    self._reject(key)  # another writer's page size: never served
                for code in (k, v):
                    if code < 0 and code not in mc.MISS_CODES and code != mc.INVALID_PARAMS:
                        self._check_code("get", code)
                out.append(None)
            return out
        return self._call("get", run, [None] * len(object_keys))

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        if self.upstream is not None:  # upstream: a page is a K object and a V object
            half = self.upstream.raw_bytes // 2
            object_keys = self._store_keys(object_keys)
            pages = [(b"", part) for _, raw in pages for part in (raw[:half], raw[half:])]
            done = self._write_objects(object_keys, pages)
            return [a and b for a, b in zip(done[::2], done[1::2])]
        return self._write_objects(object_keys, pages)

    def _write_objects(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        fits = [len(p[1]) <= self.max_payload_bytes for p in pages]
        if not all(fits):
            # Such an object could never be read back (it would not fit a read slot).
            self._warn_once("oversize", "L3 mooncake: %d page(s) larger than max_payload_bytes "
                            "%d; not stored", fits.count(False), self.max_payload_bytes)

        def run(client: Any) -> list[bool]:
            keys = [k for k, ok in zip(object_keys, fits) if ok]
            sized = [p for p, ok in zip(pages, fits) if ok]
            present = client.batch_is_exist(keys) if keys else []
            todo = [i for i, code in enumerate(present) if code != 1]
            for i in todo:
                if present[i] < 0:
                    self._check_code("set", present[i])
            stored = {i: True for i, code in enumerate(present) if code == 1}
            self._count(set_skipped=len(stored))
            if todo:
                codes = self._put(client, [keys[i] for i in todo], [sized[i] for i in todo])
                for i, code in zip(todo, codes):
                    stored[i] = code == 0 or code in mc.PRESENT_CODES
                    if not stored[i]:
                        self._check_code("set", code)
            it = iter(stored[i] for i in range(len(keys)))
            return [next(it) if ok else False for ok in fits]
        return self._call("set", run, [False] * len(object_keys))

    def _put(self, client: Any, keys: list[str], pages: list[RawPage]) -> list[int]:
        """Put sealed pages in one call. Over TCP the client reads each page's header and
        payload where they lie (two parts per object, no staging copy); RDMA reads only
        registered memory, so there they are first copied into this thread's buffer."""
        if self.target.protocol == "tcp" and all(type(h) is bytes and type(p) is bytes
                                                 for h, p in pages):
            parts = [[b for b in page if b] for page in pages]  # an upstream page has no header
            return list(client.batch_put_from_multi_buffers(
                keys, [[_address(b) for b in bufs] for bufs in parts],
                [[len(b) for b in bufs] for bufs in parts]))
        sizes = [len(h) + len(p) for h, p in pages]
        arena = self._arena(client, sum(sizes))
        ptrs, off = [], 0
        for (header, payload), size in zip(pages, sizes):
            arena.view[off : off + len(header)] = header
            arena.view[off + len(header) : off + size] = payload
            ptrs.append(arena.addr + off)
            off += size
        return list(client.batch_put_from(keys, ptrs, sizes))

    def _clear(self) -> None:
        def run(client: Any) -> None:
            if self.upstream is not None:
                up = self.upstream
                pattern = f"^{_escape(up.key_prefix)}_[0-9a-f]+_{_escape(up.rank_part)}_[kv]$"
            else:  # keys are hex hashes + a suffix of [\w.-]
                pattern = f"^[0-9a-f]+{_escape(self.scheme.suffix)}$"
            client.remove_by_regex(pattern, True)
        self._call("clear", run, None)

    def _discard(self, object_key: str) -> bool:
        def run(client: Any) -> bool:
            codes = [client.remove(k, True) for k in self._store_keys([object_key])]  # both
            return all(code == 0 for code in codes)
        return self._call("discard", run, False)

    def _close(self) -> None:
        # A caller that is past the closed check holds the native client: wait for it (the
        # last rank threads to stop may still be inside a put after their join timed out).
        with self._calls:
            idle = self._calls.wait_for(lambda: self._running == 0, timeout=_CLOSE_WAIT_S)
            client = self._client
            self._client = None
        if client is None:
            return
        if not idle:
            log.warning("L3 mooncake at %s: %d calls still under way %g s after close; the "
                        "client is left open (freeing it under them would crash the process)",
                        self.target.master, self._running, _CLOSE_WAIT_S)
            return
        for arena in self._arenas.values():
            arena.release(client)
        self._arenas.clear()
        client.close()

    # --- helpers ------------------------------------------------------------------------------

    def _open(self) -> None:
        self._log_start = mc.log_offset()
        client = mc.open_client(self.target)
        # A client's first put opens its transfer connection to the segment that takes it
        # (about a second): paid here, at start-up, not by the first backup (as upstream's
        # warm-up does). A store without room for it is only logged: puts fail soft.
        key = f"hicache-warmup-{uuid.uuid4().hex}"
        rc = client.put(key, bytes(envelope.HEADER_SIZE))
        if rc == 0:
            client.remove(key, True)
        else:
            log.warning("L3 mooncake at %s: a warm-up put failed (%s); is a segment mounted?",
                        self.target.master, mc.code_name(rc))
        self._client = client

    def _arena(self, client: Any, size: int) -> _Arena:
        """This thread's registered buffer, grown to ``size`` bytes if smaller."""
        tid = threading.get_ident()
        arena = self._arenas.get(tid)
        if arena is None or arena.size < size:
            if arena is not None:
                arena.release(client)
            arena = _Arena(client, max(size, _MIN_ARENA_BYTES))
            # A thread id names one live thread; the dict only gains or replaces its entry.
            self._arenas[tid] = arena
        return arena

    def _reject(self, key: str) -> None:
        self._report_corrupt(CorruptPage(f"{key}: object is larger than any page "
                                         f"({self.slot_bytes} bytes with its header)"))
        self._count(corrupt=1, discarded=int(self._discard(key)))

    def _check_code(self, op: str, code: int) -> None:
        """A failed key: counted; the master's loss starts an outage, other codes (a full
        store, an evicted replica) are logged once per code."""
        self._count(errors=1)
        if code in mc.OUTAGE_CODES:
            self.outage.mark_down(f"{op}: {mc.code_name(code)}")
        else:
            self._warn_once(str(code), "L3 mooncake %s failed: %s", op, mc.code_name(code))

    def _call(self, op: str, run: Callable[[Any], T], fallback: T) -> T:
        """Run one client operation, or fail soft with ``fallback`` (also once closed)."""
        with self._calls:
            if self._closed:
                self._count(errors=1)
                return fallback
            self._running += 1
        try:
            return self._call_client(op, run, fallback)
        finally:
            with self._calls:
                self._running -= 1
                self._calls.notify_all()

    def _call_client(self, op: str, run: Callable[[Any], T], fallback: T) -> T:
        client = self._may_try()
        if client is None:
            self._count(errors=1)
            return fallback
        try:
            result = run(client)
        except (RuntimeError, OSError, ValueError, TypeError) as exc:
            # The binding raises for what it cannot do (a buffer it refuses, a closed
            # client): this call failed; whether the master is gone, the next check says.
            self._count(errors=1)
            self._warn_once(type(exc).__name__, "L3 mooncake %s failed: %s", op, exc)
            self.outage.release()
            return fallback
        except BaseException:
            self.outage.release()  # never leave the probe slot taken
            raise
        # a probe whose call met the outage again (an outage code) gave its slot up already
        self.outage.mark_up()
        return result

    def _may_try(self) -> Any:
        """The client when a call may go ahead: while up, when the client's own health check
        (a local read) passes; while down, for one probing caller after the backoff."""
        if self._closed or not self.outage.may_try():
            return None
        client = self._client
        if client is None:
            problem = mc.reachable(self.target, self.connect_timeout_s)
            if problem is None:
                try:
                    self._open()
                    client = self._client
                except StorageUnavailable as exc:
                    problem = str(exc)
            if problem is not None:
                self.outage.mark_down(problem)
                return None
        status = client.health_check()
        if status != mc.HEALTHY:
            self.outage.mark_down("the master is unreachable" if status == 2
                            else f"client health check {status}")
            return None
        return client

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, msg, *args)
