"""The Redis backend against a real redis-server: pipelining, corruption, outages."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from hicache_runtime.config import StorageConfig, load_config
from hicache_runtime.contracts.errors import ConfigError, StorageUnavailable
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends.redis import RedisBackend
from hicache_runtime.l3.backends.redis_server import LocalRedisServer, free_port
from tests.storage.support import SCHEME, hashes, payload_for

pytestmark = pytest.mark.redis

MakeBackend = Callable[..., StorageBackend]


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_objects_are_suffixed_sealed_strings(make_redis_backend: MakeBackend,
                                             redis_server: LocalRedisServer) -> None:
    b = make_redis_backend()
    keys = hashes(2)
    b.batch_set(keys, [b"p0", b"p1"])
    raw = redis.Redis.from_url(redis_server.url)
    assert sorted(raw.keys()) == sorted((k + SCHEME.suffix).encode() for k in keys)
    assert raw.get(keys[0] + SCHEME.suffix)[:4] == b"HCL3"  # type: ignore[index]
    raw.close()


@pytest.mark.parametrize("how", ["flip", "truncate", "swap", "garbage"])
def test_corrupt_value_is_a_counted_miss_and_dropped(make_redis_backend: MakeBackend,
                                                     redis_server: LocalRedisServer,
                                                     how: str) -> None:
    b = make_redis_backend()
    keys = hashes(3)
    payloads = [payload_for(k) for k in keys]
    b.batch_set(keys, payloads)
    raw = redis.Redis.from_url(redis_server.url)
    victim = keys[1] + SCHEME.suffix
    blob = raw.get(victim)
    assert isinstance(blob, bytes)
    bad = {"flip": blob[:-1] + bytes([blob[-1] ^ 0x80]), "truncate": blob[:-5],
           "swap": raw.get(keys[2] + SCHEME.suffix), "garbage": b"not a page"}[how]
    raw.set(victim, bad)
    assert b.batch_get(keys) == [payloads[0], None, payloads[2]]
    s = b.stats()
    assert (s.corrupt, s.discarded, s.misses) == (1, 1, 1)
    assert raw.exists(victim) == 0  # dropped, so the next backup rewrites it
    raw.close()


def test_unreachable_server_at_start_is_one_clear_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StorageUnavailable) as info:
        RedisBackend(url, SCHEME, connect_timeout_s=0.5)
    msg = str(info.value)
    assert "\n" not in msg
    assert url in msg
    assert "unreachable" in msg
    assert info.value.hint


def test_credentials_never_appear_in_errors() -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(StorageUnavailable) as info:
        RedisBackend(url, SCHEME, connect_timeout_s=0.5)
    assert "s3cret" not in str(info.value)
    assert "***@127.0.0.1" in str(info.value)


def test_bad_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"storage\.url"):
        RedisBackend("http://nowhere", SCHEME)
    with pytest.raises(ConfigError, match=r"storage\.url"):
        RedisBackend.from_config(StorageConfig.model_construct(backend="redis"), SCHEME)
    with pytest.raises(ConfigError, match=r"storage\.url: the redis backend needs its server's "
                                          r"URL \(redis://"):
        load_config({"storage.backend": "redis"})
    with pytest.raises(ConfigError, match=r"scheme 'http' is not one of redis, rediss, unix"):
        load_config({"storage.backend": "redis", "storage.url": "http://nowhere"})


def test_degraded_start_connects_when_the_server_appears(redis_server: LocalRedisServer) -> None:
    redis_server.kill()
    b = RedisBackend(redis_server.url, SCHEME, required=False, reconnect_backoff_s=0.02,
                     max_backoff_s=0.1)
    try:
        assert not b.healthy
        keys = hashes(2)
        assert b.batch_set(keys, [b"a", b"b"]) == [False, False]
        redis_server.start()
        assert wait_until(lambda: b.batch_set(keys, [b"a", b"b"]) == [True, True])
        assert b.healthy
        assert b.batch_get(keys) == [b"a", b"b"]
        s = b.stats()
        assert s.outages == 1
        assert s.reconnects == 1
    finally:
        b.close()


def test_server_killed_mid_use_fails_soft_then_recovers_on_restart(
        make_redis_backend: MakeBackend, redis_server: LocalRedisServer,
        caplog: pytest.LogCaptureFixture) -> None:
    b = make_redis_backend()
    keys = hashes(8)
    payloads = [payload_for(k) for k in keys]
    assert all(b.batch_set(keys, payloads))

    redis_server.kill()
    with caplog.at_level(logging.INFO, logger="hicache_runtime.l3"):
        t0 = time.monotonic()
        for _ in range(50):  # a busy runtime keeps calling during the outage
            assert b.batch_exists(keys) == 0
            assert b.batch_get(keys) == [None] * len(keys)
            assert b.batch_set(keys, payloads) == [False] * len(keys)
        assert time.monotonic() - t0 < 5.0  # no caller blocks for long
        assert not b.healthy
        s = b.stats()
        assert s.outages == 1
        assert s.errors >= 150
        assert s.set_failures == 50 * len(keys)

        redis_server.start()  # same port; the data is gone (no persistence)
        assert wait_until(lambda: b.batch_set(keys, payloads) == [True] * len(keys))
        assert b.healthy
        assert b.batch_exists(keys) == len(keys)
        assert b.batch_get(keys) == payloads
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if "is back" in r.getMessage()]
    assert len(warnings) == 1
    assert "unavailable" in warnings[0].getMessage()
    assert len(infos) == 1
    s = b.stats()
    assert s.reconnects == 1
    assert s.outages == 1
    assert s.corrupt == 0


def test_backoff_grows_and_is_capped(make_redis_backend: MakeBackend,
                                     redis_server: LocalRedisServer) -> None:
    b = make_redis_backend(reconnect_backoff_s=0.01, max_backoff_s=0.04)
    assert isinstance(b, RedisBackend)
    redis_server.kill()
    b.batch_exists(hashes(1))
    seen = []
    for _ in range(6):
        time.sleep(0.05)  # past any backoff: this call is the probe
        b.batch_exists(hashes(1))
        seen.append(b.outage.state()["backoff_s"])
    assert seen[0] == 0.02
    assert max(seen) == 0.04
    assert b.stats().outages == 1


def test_outage_with_concurrent_callers(make_redis_backend: MakeBackend,
                                        redis_server: LocalRedisServer) -> None:
    """Backup, prefetch and query threads keep calling through a kill and a restart."""
    b = make_redis_backend()
    keys = hashes(16, seed=4)
    wrong: list[str] = []
    stop = threading.Event()

    def loop(role: str) -> None:
        while not stop.is_set():
            if role == "set":
                b.batch_set(keys, [payload_for(k) for k in keys])
            elif role == "get":
                for k, p in zip(keys, b.batch_get(keys)):
                    if p is not None and p != payload_for(k):
                        wrong.append(k)
            else:
                b.batch_exists(keys)

    threads = [threading.Thread(target=loop, args=(r,)) for r in ("set", "get", "exists")]
    for t in threads:
        t.start()
    time.sleep(0.2)
    redis_server.kill()
    time.sleep(0.3)
    redis_server.start()
    ok = wait_until(lambda: b.healthy and b.batch_exists(keys) == len(keys))
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert ok
    assert not wrong
    s = b.stats()
    assert s.outages >= 1
    assert s.reconnects == s.outages
    assert s.corrupt == 0


def test_a_restartable_server_s_port_is_below_the_ephemeral_range(tmp_path: Path) -> None:
    """The port a throwaway server is started again on is one the kernel never hands out by
    itself (port-0 binds and outgoing connections take theirs from the ephemeral range), so
    nothing on the machine takes it while the server is down."""
    from hicache_runtime.l3.backends.redis_server import _ephemeral_low, stable_port

    low = _ephemeral_low()
    if low <= 10001:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = [stable_port() for _ in range(50)]
    assert all(10000 <= p < low for p in ports), ports
    assert len(set(ports)) > 40  # drawn anew by each process, not from a seeded generator
    assert LocalRedisServer(workdir=tmp_path).port < low
    with socket.socket() as s:  # an ephemeral port stays in its range: the premise above
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low
