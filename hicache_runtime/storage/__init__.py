"""L3 storage: page keys, page payloads, and the backends behind one interface.

* ``keys``     prefix-chained SHA-256 page hashes and per-rank key suffixes;
* ``pages``    one host page of K/V as bytes (layout header) and back into a host pool;
* ``envelope`` the checksummed wrapper every backend stores around a payload;
* ``base``     :class:`StorageBackend` (the contract) and :class:`StorageStats`;
* ``file``     the embedded default, one file per page;
* ``redis_backend`` a real Redis server, with outage handling;
* ``faulty``   the fault-injection wrapper for the ``storage.*`` fault points;
* ``registry`` backends by name and :func:`make_backend`;
* ``redis_server`` a throwaway local ``redis-server`` for tests and benchmarks.

Backend modules are not imported here (the registry loads them lazily).
"""

from hicache_runtime.storage.base import StorageBackend, StorageCallInfo, StorageStats
from hicache_runtime.storage.keys import (
    KeyScheme,
    chain_hashes,
    extend_chain,
    key_suffix,
    model_id,
    page_hash,
)
from hicache_runtime.storage.pages import PageCodec, PageLayout
from hicache_runtime.storage.registry import (
    is_storage_writer,
    known_backends,
    make_backend,
    register_backend,
)

__all__ = [
    "KeyScheme",
    "PageCodec",
    "PageLayout",
    "StorageBackend",
    "StorageCallInfo",
    "StorageStats",
    "chain_hashes",
    "extend_chain",
    "is_storage_writer",
    "key_suffix",
    "known_backends",
    "make_backend",
    "model_id",
    "page_hash",
    "register_backend",
]
