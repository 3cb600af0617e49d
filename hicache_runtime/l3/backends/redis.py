"""The Redis L3 backend: pages as Redis strings on a real server (``redis://host:port/db``).

Each batch is one pipelined round trip (EXISTS / STRLEN+GETRANGE / SET NX per key, no
MULTI). Values are the same sealed envelopes as the file backend, so corruption is caught the
same way. Values are untrusted: a read fetches at most one header plus ``max_payload_bytes``
of each (``GETRANGE``), and ``STRLEN`` rejects a longer value from its size alone, so a huge
value planted under a page key is a counted miss, not an allocation; a key of another type is
a counted miss for that key only.

Connection loss: the runtime must keep serving from L1/L2 while Redis is away. So

* every call fails soft (exists → 0, get → misses, set → ``False``) and is counted;
* the backend logs **once per outage** (a warning when it goes down, an info line when it is
  back) and emits ``l3.storage`` trace events ``outage`` / ``reconnect``;
* while down, calls return at once without touching the network, except one probe at a time,
  allowed after an exponential backoff (``reconnect_backoff_s``, doubling, capped at
  ``max_backoff_s``); the probe is the caller's own request, so a successful probe serves it
  (the state machine, shared with the Mooncake backend: :mod:`hicache_runtime.l3.outage`);
* socket timeouts are short (``connect_timeout_s``, ``socket_timeout_s``) and redis-py's own
  retries are disabled, so no caller blocks for long on a dead server.

Thread-safety: redis-py's connection pool hands each pipeline its own connection; the outage
state guards itself. Every public method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from hicache_runtime.config_files import short_repr
from hicache_runtime.contracts.errors import ConfigError, CorruptPage, StorageUnavailable
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.backend import RawPage, StorageBackend
from hicache_runtime.l3.keys import KeyScheme
from hicache_runtime.l3.outage import Outage

if TYPE_CHECKING:
    from pathlib import Path

    from hicache_runtime.config import StorageConfig
    from hicache_runtime.l3.backends.redis_server import LocalRedisServer
    from hicache_runtime.telemetry.tracer import Tracer

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "the server is not reachable" (as opposed to a command error).
_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
_SCAN_COUNT = 1000
_ARENA_KEEP_BYTES = 64 << 20
"""Largest per-thread join buffer kept between calls (bigger batches allocate per call)."""
_DELETE_CHUNK = 500


class RedisBackend(StorageBackend):
    """Pages in a Redis database. See the module docstring for outage handling."""

    name = "redis"
    url_schemes = ("redis", "rediss", "unix")
    url_example = "redis://127.0.0.1:6379/0"
    url_required = True  # a Redis server is the user's to name; tests start their own

    @classmethod
    def url_problem(cls, url: str) -> str | None:
        problem = super().url_problem(url)
        if problem is not None:
            return f"{problem}; use redis://host:port/db"
        try:
            parts = urlsplit(url)
            port = parts.port  # raises for a non-numeric or out-of-range port
        except ValueError as exc:
            return f"not a URL ({exc}); use redis://host:port/db"
        if parts.scheme == "unix":
            return None if parts.path else "a unix:// URL needs a socket path"
        if port == 0:
            return "port 0 is not a server port"
        db = parts.path.strip("/")
        if db and not (db.isdigit() and len(db) <= 6):
            return f"the database {short_repr(db)} is not a number"
        return None

    @classmethod
    def throwaway(cls, workdir: Path | None = None) -> LocalRedisServer:
        """A ``redis-server`` on a free port of 127.0.0.1, keeping nothing on disk."""
        from hicache_runtime.l3.backends.redis_server import LocalRedisServer

        return LocalRedisServer(workdir=workdir)

    def __init__(self, url: str, scheme: KeyScheme, *, required: bool = True,
                 reconnect_backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 connect_timeout_s: float = 0.5, socket_timeout_s: float = 5.0,
                 max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES,
                 tracer: Tracer | None = None) -> None:
        """Connect and PING.

        Raises :class:`ConfigError` (field ``storage.url``) for a malformed URL. When the
        server does not answer: with ``required`` raises :class:`StorageUnavailable` with a
        one-line message; without it, logs once and starts in the outage state (calls fail
        soft, reconnection is probed with backoff).
        """
        super().__init__(scheme, tracer=tracer)
        if max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes must be positive, got {max_payload_bytes}")
        self.max_payload_bytes = max_payload_bytes
        """Largest page payload read or written; longer values are rejected unread."""
        self.url = _redact(url)
        """The server URL without credentials (safe for logs, errors and traces)."""
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_connect_timeout=connect_timeout_s,
                socket_timeout=socket_timeout_s,
                # Our backoff decides when to retry; redis-py's default retries (with their
                # own sleeps) would block the prefetch and backup threads during an outage.
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                health_check_interval=0,
                decode_responses=False,
            )
        except ValueError as exc:
            raise ConfigError("storage.url", f"{self.url!r} is not a Redis URL: {exc}",
                              hint="use redis://host:port/db") from None
        self.outage = Outage("redis", self.url, base_backoff_s=reconnect_backoff_s,
                             max_backoff_s=max_backoff_s, count=self._count, emit=self._emit,
                             url=self.url, on_down=self._drop_idle_connections)
        self._arenas = threading.local()
        try:
            self._client.ping()
        except _CONNECTION_ERRORS as exc:
            if required:
                self._client.close()
                raise StorageUnavailable(
                    f"Redis at {self.url} is unreachable ({_short(exc)})",
                    hint="start redis-server, fix --storage-url, or pass --storage-optional "
                         "(storage.required=false) to start with L3 off until it answers",
                ) from None
            self.outage.mark_down(_short(exc))
        except RedisError as exc:
            self._client.close()
            raise StorageUnavailable(f"Redis at {self.url} refused PING ({_short(exc)})",
                                     hint="check the server's auth and database") from None

    @classmethod
    def from_config(cls, cfg: StorageConfig, scheme: KeyScheme, *, required: bool = True,
                    tracer: Tracer | None = None,
                    max_payload_bytes: int = envelope.DEFAULT_MAX_PAYLOAD_BYTES) -> RedisBackend:
        if not cfg.url:
            raise ConfigError("storage.url", "the redis backend needs redis://host:port/db")
        return cls(cfg.url, scheme, required=required,
                   reconnect_backoff_s=cfg.reconnect_backoff_s,
                   max_backoff_s=cfg.reconnect_backoff_max_s, tracer=tracer,
                   max_payload_bytes=max_payload_bytes)

    def describe(self) -> str:
        return f"redis:{self.url} (suffix {self.scheme.suffix})"

    @property
    def healthy(self) -> bool:
        return not self._closed and not self.outage.down

    # --- hooks --------------------------------------------------------------------------------

    def _exists_leading(self, object_keys: list[str]) -> int:
        def run(pipe: redis.client.Pipeline) -> int:
            for key in object_keys:
                pipe.exists(key)
            n = 0
            for found in pipe.execute():
                if not found:
                    break
                n += 1
            return n
        return self._call("exists", run, 0)

    def read_raw(self, object_keys: list[str]) -> list[RawPage | None]:
        last = envelope.HEADER_SIZE + self.max_payload_bytes  # GETRANGE's end is inclusive

        def run(pipe: redis.client.Pipeline) -> list[tuple[str, object, object]]:
            for key in object_keys:
                pipe.strlen(key)
                pipe.getrange(key, 0, last)
            # raise_on_error=False: a key of another type (WRONGTYPE) fails that key only.
            replies = pipe.execute(raise_on_error=False)
            return [(key, replies[2 * i], replies[2 * i + 1])
                    for i, key in enumerate(object_keys)]

        got = self._call("get", run, None)
        if got is None:
            return [None] * len(object_keys)
        out: list[RawPage | None] = []
        for key, size, blob in got:
            try:
                out.append(self._bounded(key, size, blob))
            except CorruptPage as exc:
                # Rejected without decoding: a miss, counted and dropped here (``verify``
                # only sees what was accepted).
                self._report_corrupt(exc)
                self._count(corrupt=1, discarded=int(self._discard(key)))
                out.append(None)
        return out

    def _bounded(self, key: str, size: object, blob: object) -> RawPage | None:
        """One key's STRLEN and GETRANGE replies as a raw page; ``None`` when absent (STRLEN
        is 0 for a missing key, and an empty value is no page either)."""
        for reply in (size, blob):
            if isinstance(reply, Exception):
                raise CorruptPage(f"{key}: not a string value ({_short(reply)})")
        if not isinstance(size, int) or not isinstance(blob, bytes):
            raise CorruptPage(f"{key}: unexpected reply types {type(size).__name__}, "
                              f"{type(blob).__name__}")
        if size == 0:
            return None
        envelope.check_size(key, size, self.max_payload_bytes)
        return envelope.split(blob)

    def write_sealed(self, object_keys: list[str], pages: list[RawPage]) -> list[bool]:
        fits = [len(p[1]) <= self.max_payload_bytes for p in pages]
        if not all(fits):
            # Such a value could never be read back (reads reject it from its size).
            log.warning("L3 redis: %d page(s) larger than max_payload_bytes %d; not stored",
                        fits.count(False), self.max_payload_bytes)
        keys = [k for k, ok in zip(object_keys, fits) if ok]
        sized = [p for p, ok in zip(pages, fits) if ok]

        def run(pipe: redis.client.Pipeline) -> list[bool]:
            for key, blob in zip(keys, self._joined(sized)):
                # NX: an existing object is kept (same content by construction of the key).
                pipe.set(key, blob, nx=True)
            # SET NX answers None when the key existed: stored already, so success.
            replies = pipe.execute()
            self._count(set_skipped=sum(r is None for r in replies))
            return [True] * len(replies)

        stored = self._call("set", run, [False] * len(keys)) if keys else []
        it = iter(stored)
        return [next(it) if ok else False for ok in fits]

    def _clear(self) -> None:
        def run(pipe: redis.client.Pipeline) -> None:
            # SCAN, not KEYS: never block the server. Match the suffix, then check exactly.
            doomed = [k for k in self._client.scan_iter(match=f"*{self.scheme.suffix}",
                                                        count=_SCAN_COUNT)
                      if self.scheme.owns(k.decode())]
            for i in range(0, len(doomed), _DELETE_CHUNK):
                self._client.delete(*doomed[i : i + _DELETE_CHUNK])
        self._call("clear", run, None)

    def _discard(self, object_key: str) -> bool:
        def run(pipe: redis.client.Pipeline) -> bool:
            return bool(self._client.delete(object_key))
        return self._call("discard", run, False)

    def _close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()

    # --- outage handling ----------------------------------------------------------------------

    def _joined(self, pages: list[RawPage]) -> list[memoryview]:
        """Each (header, payload) as one value, as views into a per-thread buffer.

        A Redis value is one string, so header and payload must be joined. Joining into a
        reused buffer costs a memcpy; ``header + payload`` per page would also allocate a
        fresh page-sized object each time, which costs several times more (page faults on
        newly mapped memory). The views are only used until this call's pipeline has been
        sent, and a thread runs one call at a time, so reuse is safe.
        """
        total = sum(len(h) + len(p) for h, p in pages)
        arena = getattr(self._arenas, "buf", None)
        if arena is None or len(arena) < total:
            arena = bytearray(total)
            if total <= _ARENA_KEEP_BYTES:
                self._arenas.buf = arena
        view = memoryview(arena)
        out: list[memoryview] = []
        off = 0
        for header, payload in pages:
            end = off + len(header) + len(payload)
            view[off : off + len(header)] = header
            view[off + len(header) : end] = payload
            out.append(view[off:end])
            off = end
        return out

    def _call(self, op: str, run: Callable[[redis.client.Pipeline], T], fallback: T) -> T:
        """Run one pipelined operation, or fail soft with ``fallback``."""
        if self._closed or not self.outage.may_try():
            self._count(errors=1)
            return fallback
        try:
            with self._client.pipeline(transaction=False) as pipe:
                result = run(pipe)
        except _CONNECTION_ERRORS as exc:
            self._count(errors=1)
            self.outage.mark_down(_short(exc))
            return fallback
        except RedisError as exc:
            # A command error (OOM, READONLY replica...): the server is there, this call
            # failed. Not an outage; counted and logged at debug level.
            self._count(errors=1)
            self.outage.mark_up()
            log.debug("L3 redis %s failed: %s", op, exc)
            return fallback
        except BaseException:
            # A bug in our code, not the server's: let it surface, but never leave the
            # probe slot taken (that would keep the backend down for good).
            self.outage.release()
            raise
        self.outage.mark_up()
        return result

    def _drop_idle_connections(self) -> None:
        # The outage began: drop pooled sockets of the dead server so the probe opens a fresh
        # connection. Connections in use by other threads fail on their own.
        self._client.connection_pool.disconnect(inuse_connections=False)

    @property
    def last_error(self) -> str:
        """The error that started (or last extended) the current outage."""
        return self.outage.last_error


def _redact(url: str) -> str:
    """``url`` with any user/password replaced by ``***``."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _short(exc: BaseException) -> str:
    """An exception as one short line (redis-py messages can span several)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
