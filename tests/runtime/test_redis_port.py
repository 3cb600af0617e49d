"""A throwaway redis-server never mistakes someone else's server for its own: the port it
picked may be taken before it binds it (another job, another test), and then it picks again."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_runtime.contracts.errors import StorageUnavailable
from hicache_runtime.l3.backends.redis_server import LocalRedisServer


def test_a_picked_port_taken_meanwhile_is_replaced(redis_server: LocalRedisServer,
                                                   tmp_path: Path) -> None:
    mine = LocalRedisServer(workdir=tmp_path / "mine")
    mine.port = redis_server.port  # as if another job bound the picked port first
    try:
        mine.start()
        assert mine.port != redis_server.port
        assert mine.running
        assert mine.ping()
        mine.kill()
        assert not mine.ping(), "the server that answered was ours"
        assert redis_server.ping(), "the other server was left alone"
    finally:
        mine.close()


def test_a_given_port_in_use_is_an_error_not_someone_elses_server(
        redis_server: LocalRedisServer, tmp_path: Path) -> None:
    clash = LocalRedisServer(port=redis_server.port, workdir=tmp_path / "clash")
    try:
        with pytest.raises(StorageUnavailable, match="in use"):
            clash.start()
        assert not clash.running
    finally:
        clash.close()
    assert redis_server.ping()
