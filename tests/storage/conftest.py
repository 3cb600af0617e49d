"""Fixtures for the L3 storage tests: every backend on a fresh medium (the ``redis_server``
fixture lives in ``tests/conftest.py``, shared with the runtime tests).

The contract tests run on every backend the registry knows: the built-ins, installed plug-ins,
and the backends written for tests in ``extra_backends/`` (each module there registers
itself). A backend that keeps its store in a server gets one throwaway server per session
(``StorageBackend.throwaway``) and clears its objects before each test; one that cannot run
here (``StorageBackend.unavailable``, a missing program) is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hicache_runtime.config import StorageConfig
from hicache_runtime.contracts.errors import HiCacheError
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.backends.redis_server import LocalRedisServer
from hicache_runtime.l3.keys import KeyScheme
from hicache_runtime.l3.registry import backend_class, known_backends
from tests.storage.support import SCHEME, MakeBackend

EXTRA_BACKENDS = Path(__file__).with_name("extra_backends")
for _module in sorted(EXTRA_BACKENDS.glob("[!_]*.py")):
    importlib.import_module(f"tests.storage.extra_backends.{_module.stem}")

CONTRACT_BACKENDS = known_backends()
"""Every backend the contract tests run on (read once, at collection)."""


@pytest.fixture(scope="session")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], str | None]]:
    """The URL of a throwaway server of a backend, started on first use and kept for the
    session (None for a backend without a server). Skips when it cannot start here."""
    urls: dict[str, str | None] = {}
    with contextlib.ExitStack() as stack:
        def url(name: str) -> str | None:
            if name not in urls:
                store = backend_class(name).throwaway(tmp_path_factory.mktemp(f"store-{name}"))
                try:
                    urls[name] = None if store is None else stack.enter_context(store).url
                except HiCacheError as exc:  # a missing program, a server that did not start
                    pytest.skip(f"no {name} store here: {exc}")
            return urls[name]

        yield url


@pytest.fixture(params=[pytest.param(n, marks=pytest.mark.redis) if n == "redis" else n
                        for n in CONTRACT_BACKENDS])
def new_backend(request: pytest.FixtureRequest, tmp_path: Path,
                 store_url: Callable[[str], str | None]) -> Iterator[MakeBackend]:
    """Each backend in turn: a factory of this backend's instances (one per rank's key
    scheme) on one medium, closed at teardown."""
    name: str = request.param
    cls = backend_class(name)
    reason = cls.unavailable(StorageConfig.model_construct(backend=name, url=None))
    if reason:
        pytest.skip(reason)
    cfg = StorageConfig(backend=name, url=store_url(name), path=tmp_path / "l3",
                        reconnect_backoff_s=0.02, reconnect_backoff_max_s=0.2)
    made: list[StorageBackend] = []

    def make(scheme: KeyScheme = SCHEME) -> StorageBackend:
        made.append(cls.from_config(cfg, scheme))
        return made[-1]

    yield make
    for b in made:
        b.close()


@pytest.fixture
def backend(new_backend: MakeBackend) -> StorageBackend:
    """Each backend in turn, with none of its objects left from an earlier test."""
    b = new_backend()
    b.clear()
    return b


@pytest.fixture
def file_backend(tmp_path: Path) -> Iterator[FileBackend]:
    backend = FileBackend(tmp_path / "l3", SCHEME)
    yield backend
    backend.close()


@pytest.fixture
def make_redis_backend(redis_server: LocalRedisServer) -> Iterator[MakeBackend]:
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
