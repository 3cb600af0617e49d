"""Backends by name, and the factory the runtime calls to build one rank's L3 backend.

The names (built-ins, registered ones, and plug-ins from installed distributions' entry points
in the group ``hicache.l3_backends``) are kept in :mod:`hicache_runtime.contracts.l3_backends`,
below the config, which checks ``storage.backend`` against them. Backend modules are imported
lazily, on first use, so a run without L3 (or with the file backend) never imports redis-py.
Tests and embedding code may add names with :func:`register_backend`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from hicache_runtime.contracts import l3_backends
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.l3.faulty import wrap_faults
from hicache_runtime.l3.keys import KeyScheme

if TYPE_CHECKING:
    from pathlib import Path

    from faults.injector import FaultInjector
    from hicache_runtime.config import RuntimeConfig, StorageConfig
    from hicache_runtime.contracts.topology import RankInfo
    from hicache_runtime.l3.backend import PrivateStore, StorageBackend
    from hicache_runtime.l3.formats import UpstreamPages
    from hicache_runtime.telemetry.tracer import Tracer


class BackendFactory(Protocol):
    """What a registered backend class provides (``FileBackend``, ``RedisBackend``)."""

    def from_config(self, cfg: StorageConfig, scheme: KeyScheme, *, required: bool = True,
                    tracer: Tracer | None = None,
                    max_payload_bytes: int = ...) -> StorageBackend: ...

    def unavailable(self, cfg: StorageConfig) -> str | None: ...

    url_schemes: tuple[str, ...]
    url_example: str
    url_required: bool

    def url_problem(self, url: str) -> str | None: ...

    def throwaway(self, workdir: Path | None = None) -> PrivateStore | None: ...


def known_backends() -> list[str]:
    """Registered backend names, sorted (installed plug-ins included)."""
    return l3_backends.known()


def register_backend(name: str, target: str) -> None:
    """Register ``"package.module:ClassName"`` under ``name`` (replaces an existing entry)."""
    l3_backends.register(name, target)


def backend_class(name: str) -> BackendFactory:
    """The backend class registered as ``name``, imported now.

    Raises :class:`ConfigError` (field ``storage.backend``) for an unknown name, listing the
    known ones, and for a backend whose module or class cannot be loaded.
    """
    cls: BackendFactory = l3_backends.load(name)
    return cls


def takes_url(name: str) -> bool:
    """Whether backend ``name`` keeps its store in a server a URL names (``url_schemes``)."""
    return name != l3_backends.NO_BACKEND and bool(backend_class(name).url_schemes)


def backend_for_url(url: str) -> str | None:
    """The backend whose URL scheme ``url`` uses (the first by name), or None."""
    scheme = url.partition(":")[0] if ":" in url else ""
    for name in known_backends():
        try:
            if scheme in backend_class(name).url_schemes:
                return name
        except ConfigError:  # a plug-in that cannot load names no scheme
            continue
    return None


@contextlib.contextmanager
def private_store(cfg: RuntimeConfig) -> Iterator[tuple[RuntimeConfig, PrivateStore | None]]:
    """``cfg`` with a private store of its backend when it takes a URL and names none (started
    here, stopped on exit, yielded with the config), else ``cfg`` unchanged and ``None``. A
    backend whose server only the user may name (``url_required``) gets none."""
    st = cfg.storage
    cls = None if st.backend == l3_backends.NO_BACKEND or st.url else backend_class(st.backend)
    store = None if cls is None or cls.url_required else cls.throwaway()
    if store is None:
        yield cfg, None
        return
    with store:
        yield cfg.with_overrides(**{"storage.url": store.url}), store


def unavailable(cfg: StorageConfig) -> str | None:
    """Why this machine cannot run ``cfg``'s backend (its client library or programs are not
    installed), or None, as the backend class says (``StorageBackend.unavailable``); unknown
    names are the config's to reject."""
    if cfg.backend == "none":
        return None
    return backend_class(cfg.backend).unavailable(cfg)


def make_backend(cfg: StorageConfig, rank: RankInfo, *, model: str, required: bool = True,
                 faults: FaultInjector | None = None, tracer: Tracer | None = None,
                 step: Callable[[], int] | None = None,
                 max_payload_bytes: int | None = None,
                 upstream: UpstreamPages | None = None) -> StorageBackend | None:
    """Build this rank's L3 backend, or ``None`` when ``cfg.backend == "none"``.

    ``model`` is the ``<model>`` part of key suffixes (``keys.model_id(cfg.model)``). Keys are
    shared across TP ranks when ``cfg.single_writer`` (MLA-style), per TP rank otherwise.
    ``required=False`` lets a Redis backend start while the server is down (it fails soft and
    reconnects); with ``required=True`` an unreachable server raises
    :class:`~hicache_runtime.contracts.errors.StorageUnavailable`. The result is wrapped for fault
    injection only when ``faults`` arms a storage point on this rank; ``step`` reads the
    scheduler step for ``steps=`` selectors. ``max_payload_bytes`` is the largest page payload
    this rank reads or writes (its biggest codec's payload size): store contents are untrusted,
    and the backend rejects any bigger object from its size, unread; ``None`` keeps the
    backend's default bound (:data:`~hicache_runtime.l3.envelope.DEFAULT_MAX_PAYLOAD_BYTES`).
    """
    if cfg.backend == "none":
        return None
    scheme = KeyScheme.for_rank(model, rank, shared_across_tp=cfg.single_writer)
    bound = {} if max_payload_bytes is None else {"max_payload_bytes": max_payload_bytes}
    backend = backend_class(cfg.backend).from_config(cfg, scheme, required=required,
                                                     tracer=tracer, **bound)
    if upstream is not None:  # ``storage.format: upstream``, on the backend the wrapper calls
        backend.store_upstream(upstream)
    return wrap_faults(backend, faults, step)


def is_storage_writer(cfg: StorageConfig, rank: RankInfo) -> bool:
    """Whether this rank writes L3 (SGLang's ``is_storage_writer``): every rank, or only TP
    rank 0 of each stage with ``single_writer``. Non-writers skip the write but still ack."""
    return not cfg.single_writer or rank.tp_rank == 0
