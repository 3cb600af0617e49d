"""``storage.format: upstream``: the runtime's file store in the layout SGLang's own
``HiCacheFile`` reads and writes, checked against that class itself (sglang 0.5.23's
``mem_cache/hicache_storage.py``, installed ``--no-deps`` by the README's test command and
loaded here with stand-ins for the serving stack it does not use, as
``tests/runtime/test_tree_oracle.py`` loads the tree).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.outcome import RunOutcome
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.formats import UpstreamPages, mooncake_prefix
from hicache_runtime.l3.keys import KeyScheme, chain_hashes
from hicache_runtime.launch.run import run_single

SGLANG_VERSION = "0.5.23"
MODEL = "org/tiny-llama"


class _Unset:
    def get(self) -> None:
        return None


class _Envs:
    """``sglang.srt.environ.envs`` with nothing set: every variable's default is None here."""

    def __getattr__(self, name: str) -> _Unset:
        return _Unset()


def _load_hicache_storage() -> tuple[dict[str, ModuleType], str]:
    """SGLang's modules that ``HiCacheFile`` needs, by name (empty, and why, when they cannot
    load). They are kept out of ``sys.modules`` between uses (:func:`upstream_modules`)."""
    try:
        dist = importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return {}, f"sglang is not installed (pip install --no-deps sglang=={SGLANG_VERSION})"
    if dist.version != SGLANG_VERSION:
        return {}, f"sglang {dist.version} is installed; the oracle is {SGLANG_VERSION}"
    if "sglang" in sys.modules:
        return {}, "sglang is already imported in this process; the oracle loads it alone"
    pkg = Path(str(dist.locate_file("sglang")))
    before = set(sys.modules)
    stand_ins = {
        "sglang": {"__path__": [str(pkg)]},
        "sglang.srt.environ": {"envs": _Envs()},
        # utils/__init__ star-imports the serving stack; the file evictor needs one helper
        "sglang.srt.utils": {"__path__": [str(pkg / "srt" / "utils")]},
        "sglang.srt.utils.common": {"human_readable_int": int},
    }
    try:
        for name, attrs in stand_ins.items():
            module = ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        importlib.import_module("sglang.srt.mem_cache.storage.file.lru_file_evictor")
        return {n: sys.modules[n] for n in set(sys.modules) - before
                if n == "sglang" or n.startswith("sglang.")}, ""
    except Exception as exc:
        return {}, f"sglang {SGLANG_VERSION}'s hicache_storage.py did not load: {exc!r}"
    finally:
        for name in set(sys.modules) - before:
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]


UPSTREAM, UPSTREAM_MISSING = _load_hicache_storage()
needs_upstream = pytest.mark.skipif(not UPSTREAM, reason=UPSTREAM_MISSING)


@contextlib.contextmanager
def upstream_modules() -> Iterator[ModuleType]:
    """SGLang's loaded modules in ``sys.modules`` for a call that imports lazily (the
    file backend's constructor); gone again after it."""
    sys.modules.update(UPSTREAM)
    try:
        yield UPSTREAM["sglang.srt.mem_cache.hicache_storage"]
    finally:
        for name in UPSTREAM:
            sys.modules.pop(name, None)


def upstream_file(path: Path) -> Any:
    """SGLang's ``HiCacheFile`` on ``path``: rank 0 of 1, MHA, serving ``MODEL``."""
    with upstream_modules() as storage:
        cfg = storage.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
            model_name=MODEL, extra_config={"file_storage_path": str(path)})
        return storage.HiCacheFile(cfg)


def l3_config(path: Path, **overrides: object) -> Any:
    base: dict[str, object] = {
        "storage.backend": "file", "storage.path": path, "storage.format": "upstream",
        "storage.model_name": MODEL, "workload.requests": 48, "cache.device_tokens": 512,
        "cache.host_tokens": 768, "storage.io_batch_pages": 4,
        "observability.watchdog_timeout_s": 30.0}
    base.update(overrides)
    return load_config(base)


def test_page_hashes_are_upstreams() -> None:
    """The chained page hashes SGLang 0.5.23 computes (its native ``hash_binding.cpp``,
    built from the wheel's source) for tokens 1..10 in pages of 4."""
    assert chain_hashes(list(range(1, 11)), 4) == [
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
        "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"]


@needs_upstream
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_upstreams_file_backend_reads_the_runtimes_store_and_back(layout: str,
                                                                  tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    cfg = l3_config(ours, **{"cache.mem_layout": layout})
    first = run_single(cfg, compare=False, bundle_root=tmp_path)  # fills L3
    assert first.outcome is RunOutcome.HEALTHY, first.error
    names = sorted(os.listdir(ours))
    suffix = "_org-tiny-llama_0_1.bin"  # upstream's name: "/" -> "-", tp rank 0 of 1
    assert names
    assert all(n.endswith(suffix) for n in names), names[:3]
    hashes = [n.removesuffix(suffix) for n in names]
    # SGLang's HiCacheFile finds every page and reads each into a page-sized buffer...
    theirs = upstream_file(ours)
    assert theirs.batch_exists(hashes) == len(hashes)
    size = (ours / names[0]).stat().st_size
    pages = []
    for h in hashes:
        target = torch.zeros(size // 4, dtype=torch.float32)
        assert theirs.get(h, target) is not None
        pages.append(target)
    # ...and writes them into a store of its own, which a new run of ours reads: its L3 hits
    # come from pages SGLang's code wrote, and the outputs stay those of a run without cache.
    copy = tmp_path / "theirs"
    assert upstream_file(copy).batch_set(hashes, pages) is True
    assert sorted(os.listdir(copy)) == names
    second = run_single(cfg.with_overrides(**{"storage.path": copy}), bundle_root=tmp_path)
    assert second.outcome is RunOutcome.HEALTHY, second.error
    assert second.output_match is not False
    assert second.cached_tokens.storage > 0


def test_a_page_of_another_size_is_a_counted_miss(tmp_path: Path) -> None:
    header = b"H" * 32
    backend = FileBackend(tmp_path, KeyScheme("_m_0_1"))
    backend.store_upstream(UpstreamPages(header, 32 + 64))
    key = "ab" * 32
    assert backend.batch_set([key], [header + bytes(range(64))]) == [True]
    assert backend.path_for(key).read_bytes() == bytes(range(64))  # no envelope, no header
    assert backend.batch_get([key]) == [header + bytes(range(64))]
    backend.path_for(key).write_bytes(bytes(63))  # a short page (another writer's layout)
    assert backend.batch_get([key]) == [None]
    assert backend.stats().corrupt == 1
    with pytest.raises(ValueError, match="not in this rank's layout"):
        backend.batch_set(["cd" * 32], [b"X" * 32 + bytes(64)])


@pytest.mark.parametrize(("settings", "words"), [
    ({"storage.backend": "redis", "storage.url": "redis://127.0.0.1:6379/0"},
     "the redis backend has no upstream page format"),
    ({"model.sidecars": ["all_pages"]}, "without sidecar pools"),
    ({"model.kv_replicated": True}, "one latent row per token"),
])
def test_what_has_no_upstream_form_is_refused(settings: dict[str, object], words: str,
                                               tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=words):
        l3_config(tmp_path, **settings)


def test_keys_follow_the_release_that_wrote_them() -> None:
    """SGLang's Mooncake keys start with the model name from 0.5.17 only, and 0.5.5's keys of
    either backend name no pipeline stage (so a PP run has no upstream form there)."""
    assert mooncake_prefix("org/tiny", "0.5.23") == "org-tiny"
    assert mooncake_prefix("org/tiny", None) == "org-tiny"  # proposed: the newest form
    assert mooncake_prefix("org/tiny", "0.5.16") == ""
    pages = UpstreamPages(b"H" * 32, 96, key_prefix="", rank_part="1_0")
    assert pages.kv_keys("ab" * 32 + "_m_1_2_2_0") == (f"{'ab' * 32}_1_0_k", f"{'ab' * 32}_1_0_v")
    with pytest.raises(ConfigError, match=r"SGLang 0\.5\.5.s file keys name no pipeline stage"):
        load_config({"profile": "sglang-0.5.5", "topology.pp": 2, "storage.backend": "file",
                     "storage.format": "upstream"})
    assert load_config({"profile": "sglang-0.5.13", "topology.pp": 2,
                        "storage.backend": "file", "storage.format": "upstream"})
