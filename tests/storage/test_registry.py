"""Backends by name and the per-rank factory."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.injector import FaultInjector
from faults.spec import parse_faults
from hicache_runtime.config import StorageConfig, load_config
from hicache_runtime.contracts.errors import ConfigError, StorageUnavailable
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.backends.redis_server import LocalRedisServer, free_port
from hicache_runtime.l3.faulty import FaultyBackend
from hicache_runtime.l3.keys import model_id
from hicache_runtime.l3.registry import (
    backend_class,
    is_storage_writer,
    known_backends,
    make_backend,
    register_backend,
)
from tests.storage.support import hashes


def test_known_names_and_unknown_name_error() -> None:
    assert {"file", "redis"} <= set(known_backends())
    with pytest.raises(ConfigError,
                       match=r"unknown L3 backend 'nfs' \(known: file, .*mooncake, redis"):
        backend_class("nfs")
    with pytest.raises(ValueError, match="module:Class"):
        register_backend("bad", "no.colon")


def test_none_builds_nothing() -> None:
    assert make_backend(StorageConfig(), RankInfo(), model="m") is None


def test_file_backend_from_config_with_rank_suffixes(tmp_path: Path) -> None:
    cfg = StorageConfig(backend="file", path=tmp_path)
    ranks = [RankInfo.of(r, tp_size=2, pp_size=2) for r in range(4)]
    backends = [make_backend(cfg, r, model="m") for r in ranks]
    assert all(isinstance(b, FileBackend) for b in backends)
    assert [b.scheme.suffix for b in backends if b] == ["_m_0_2_2_0", "_m_1_2_2_0",
                                                        "_m_0_2_2_1", "_m_1_2_2_1"]


def test_single_writer_shares_objects_across_tp(tmp_path: Path) -> None:
    cfg = StorageConfig(backend="file", path=tmp_path, single_writer=True)
    r0, r1 = RankInfo.of(0, 2, 1), RankInfo.of(1, 2, 1)
    b0, b1 = make_backend(cfg, r0, model="m"), make_backend(cfg, r1, model="m")
    assert b0 is not None
    assert b1 is not None
    keys = hashes(2)
    assert is_storage_writer(cfg, r0)
    assert not is_storage_writer(cfg, r1)
    b0.batch_set(keys, [b"shared", b"shared"])
    assert b1.batch_get(keys) == [b"shared", b"shared"]
    assert is_storage_writer(StorageConfig(), r1)


def test_model_id_from_runtime_config(tmp_path: Path) -> None:
    cfg = load_config({"storage.backend": "file", "storage.path": str(tmp_path)})
    b = make_backend(cfg.storage, RankInfo(), model=model_id(cfg.model))
    assert b is not None
    assert b.scheme.suffix == f"_{model_id(cfg.model)}_0_1"


def test_faults_wrap_only_when_armed(tmp_path: Path) -> None:
    cfg = StorageConfig(backend="file", path=tmp_path)
    rank = RankInfo()
    armed = FaultInjector(parse_faults(["storage-latency:ms=1"]), 0, rank)
    other = FaultInjector(parse_faults(["dma-lag:ms=1"]), 0, rank)
    assert isinstance(make_backend(cfg, rank, model="m", faults=armed), FaultyBackend)
    assert isinstance(make_backend(cfg, rank, model="m", faults=other), FileBackend)


def test_redis_unreachable_required_or_degraded() -> None:
    cfg = StorageConfig(backend="redis", url=f"redis://127.0.0.1:{free_port()}/0",
                        reconnect_backoff_s=0.05)
    with pytest.raises(StorageUnavailable, match="unreachable"):
        make_backend(cfg, RankInfo(), model="m")
    b = make_backend(cfg, RankInfo(), model="m", required=False)
    assert b is not None
    assert not b.healthy
    assert b.batch_exists(hashes(2)) == 0
    b.close()


@pytest.mark.redis
def test_redis_from_config(redis_server: LocalRedisServer) -> None:
    cfg = StorageConfig(backend="redis", url=redis_server.url)
    b = make_backend(cfg, RankInfo(), model="m")
    assert b is not None
    assert b.healthy
    assert b.name == "redis"
    keys = hashes(2)
    assert b.batch_set(keys, [b"a", b"b"]) == [True, True]
    assert b.batch_get(keys) == [b"a", b"b"]
    b.close()
