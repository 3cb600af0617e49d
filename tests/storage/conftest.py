"""Fixtures for the L3 storage tests: backends on a fresh medium (the ``redis_server``
fixture lives in ``tests/conftest.py``, shared with the runtime tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.backends.redis_server import LocalRedisServer
from tests.storage.support import SCHEME


@pytest.fixture
def file_backend(tmp_path: Path) -> Iterator[FileBackend]:
    backend = FileBackend(tmp_path / "l3", SCHEME)
    yield backend
    backend.close()


def _redis_backend(server: LocalRedisServer) -> StorageBackend:
    from hicache_runtime.l3.backends.redis import RedisBackend

    return RedisBackend(server.url, SCHEME, reconnect_backoff_s=0.02, max_backoff_s=0.2)


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    """Each backend in turn, on a fresh medium."""
    if request.param == "file":
        b: StorageBackend = FileBackend(tmp_path / "l3", SCHEME)
    else:
        server = request.getfixturevalue("redis_server")
        b = _redis_backend(server)
    yield b
    b.close()


@pytest.fixture
def make_redis_backend(redis_server: LocalRedisServer) -> Iterator[Callable[..., StorageBackend]]:
    """A factory of Redis backends on the test server (closed at teardown)."""
    from hicache_runtime.l3.backends.redis import RedisBackend

    made: list[StorageBackend] = []

    def make(**kwargs: object) -> StorageBackend:
        opts: dict[str, object] = {"reconnect_backoff_s": 0.02, "max_backoff_s": 0.2}
        opts.update(kwargs)
        scheme = opts.pop("scheme", SCHEME)
        b = RedisBackend(redis_server.url, scheme, **opts)  # type: ignore[arg-type]
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()
