"""L3 backend plug-ins: a distribution that declares an entry point in the group
``hicache.l3_backends`` adds a backend name the config accepts and ``make_backend`` builds.

The plug-in here is a real distribution: its source (a backend subclassing the real
``StorageBackend`` that keeps pages in a dict) is built and installed by pip into a temporary
directory, and that directory is put on ``sys.path``, where ``importlib.metadata`` finds its
``entry_points.txt`` as it would in site-packages; the venv itself is left alone.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_runtime.config import StorageConfig, load_config
from hicache_runtime.contracts import l3_backends
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.keys import model_id
from hicache_runtime.l3.registry import backend_class, known_backends, make_backend
from tests.storage.support import hashes

PLUGIN = "dictstore_plugin"

_PYPROJECT = f"""\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "dictstore-plugin"
version = "0.1.0"

[project.entry-points."{l3_backends.ENTRY_POINT_GROUP}"]
dictstore = "{PLUGIN}:DictBackend"
broken = "{PLUGIN}.missing:Nothing"
file = "{PLUGIN}:DictBackend"

[tool.setuptools]
packages = ["{PLUGIN}"]
"""

_MODULE = '''\
"""An L3 backend that keeps sealed pages in a dict shared by every instance."""

from __future__ import annotations

import threading

from hicache_runtime.l3.backend import RawPage, StorageBackend

STORE: dict[str, RawPage] = {}
_LOCK = threading.Lock()


class DictBackend(StorageBackend):
    name = "dictstore"

    @classmethod
    def from_config(cls, cfg, scheme, *, required=True, tracer=None, max_payload_bytes=0):
        return cls(scheme, tracer=tracer)

    def _exists_leading(self, object_keys):
        with _LOCK:
            n = 0
            while n < len(object_keys) and object_keys[n] in STORE:
                n += 1
            return n

    def read_raw(self, object_keys):
        with _LOCK:
            return [STORE.get(k) for k in object_keys]

    def write_sealed(self, object_keys, pages):
        with _LOCK:
            for key, page in zip(object_keys, pages):
                STORE.setdefault(key, page)
        return [True] * len(object_keys)

    def _clear(self):
        with _LOCK:
            for key in [k for k in STORE if k.endswith(self.scheme.suffix)]:
                del STORE[key]
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plug-in distribution, built and installed by pip into a directory of its own."""
    src = tmp_path_factory.mktemp("dictstore-src")
    (src / "pyproject.toml").write_text(_PYPROJECT)
    (src / PLUGIN).mkdir()
    (src / PLUGIN / "__init__.py").write_text(textwrap.dedent(_MODULE))
    target = tmp_path_factory.mktemp("dictstore-site")
    # No build isolation and no index: the venv's setuptools builds it, offline.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), str(src)],
                   check=True, capture_output=True, timeout=300)
    assert list(target.glob("dictstore_plugin-0.1.0.dist-info/entry_points.txt"))
    return target


@pytest.fixture
def installed(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The plug-in on ``sys.path`` for one test; its module forgotten afterwards."""
    monkeypatch.syspath_prepend(str(plugin_dir))
    yield plugin_dir
    for name in [m for m in sys.modules if m == PLUGIN or m.startswith(PLUGIN + ".")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_without_the_plugin_the_name_is_unknown() -> None:
    assert "dictstore" not in known_backends()
    with pytest.raises(ConfigError, match=r"unknown L3 backend 'dictstore' \(known: file, "):
        load_config({"storage.backend": "dictstore"})


def test_config_accepts_the_plugin_name_and_asks_the_plugin_about_urls(
        installed: Path) -> None:
    assert {"dictstore", "file", "redis"} <= set(known_backends())
    cfg = load_config({"storage.backend": "dictstore"})
    assert cfg.storage.backend == "dictstore"
    # The plug-in declares no URL scheme (the base class's default): a URL is refused in its
    # words, by the class the name stands for.
    with pytest.raises(ConfigError, match=r"storage\.url: the dictstore backend takes no URL"):
        load_config({"storage.backend": "dictstore", "storage.url": "redis://127.0.0.1:1/0"})
    with pytest.raises(ConfigError, match=r"unknown L3 backend 'dictstor' \(known: .*dictstore"):
        load_config({"storage.backend": "dictstor"})


def test_make_backend_builds_and_uses_the_plugin(installed: Path) -> None:
    cfg = load_config({"storage.backend": "dictstore"})
    ranks = [RankInfo.of(r, tp_size=2, pp_size=1) for r in range(2)]
    b0, b1 = (make_backend(cfg.storage, r, model=model_id(cfg.model)) for r in ranks)
    assert isinstance(b0, StorageBackend)
    assert isinstance(b1, StorageBackend)
    assert type(b0).__module__ == PLUGIN
    keys = hashes(3)
    assert b0.batch_set(keys[:2], [b"page-0", b"page-1"]) == [True, True]
    assert b0.batch_exists(keys) == 2
    assert b0.batch_get(keys) == [b"page-0", b"page-1", None]
    assert b1.batch_exists(keys) == 0, "per-rank key suffixes keep TP ranks apart"
    stats = b0.stats()
    assert (stats.stored, stats.hits, stats.misses) == (2, 2, 1)


def test_a_plugin_cannot_shadow_a_builtin_and_a_broken_one_is_a_config_error(
        installed: Path) -> None:
    assert backend_class("file").__module__ == "hicache_runtime.l3.backends.file"
    # The name is declared but its module is not there: the config check, which asks the
    # class about URLs, says so before any run starts.
    with pytest.raises(ConfigError, match=r"L3 backend 'broken' .* cannot be loaded"):
        load_config({"storage.backend": "broken"})
    cfg = StorageConfig.model_construct(backend="broken")  # a config built past the check
    with pytest.raises(ConfigError, match=r"L3 backend 'broken' .* cannot be loaded"):
        make_backend(cfg, RankInfo(), model="m")
