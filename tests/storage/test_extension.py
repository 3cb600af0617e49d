"""Adding an L3 backend is one module: ``extra_backends/memstore.py`` (a backend, its URL scheme
and check, a throwaway store, one ``register_backend`` line) and nothing else. Here every place
that once named backends one by one meets it: the config's URL check, private stores, a
campaign's ``--storage-url``, a replay's URL, and a real run whose L3 it serves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from faults.campaign.cells import cell_config
from faults.campaign.plan import load_campaign, needs_store
from faults.campaign.replay_guard import guard_config
from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.outcome import RunOutcome
from hicache_runtime.l3.registry import backend_for_url, private_store, takes_url
from hicache_runtime.launch.run import run_single
from tests.storage.extra_backends import memstore


def test_the_config_checks_urls_with_the_backends_own_rule() -> None:
    cfg = load_config({"storage.backend": "mem", "storage.url": "mem://shared"})
    assert cfg.storage.url == "mem://shared"
    with pytest.raises(ConfigError, match=r"storage\.url: scheme 'redis' is not one of mem"):
        load_config({"storage.backend": "mem", "storage.url": "redis://127.0.0.1:6379/0"})
    with pytest.raises(ConfigError, match=r"a mem URL is mem://NAME"):
        load_config({"storage.backend": "mem", "storage.url": "mem://UPPER"})
    # ...and the built-ins keep theirs: a mem URL is no Redis URL.
    with pytest.raises(ConfigError, match=r"scheme 'mem' is not one of redis, rediss, unix"):
        load_config({"storage.backend": "redis", "storage.url": "mem://shared"})


def test_urls_name_their_backend_and_a_run_without_one_gets_a_private_store() -> None:
    assert backend_for_url("mem://x") == "mem"
    assert backend_for_url("redis://127.0.0.1:6379/0") == "redis"
    assert backend_for_url("mooncake://h:1?metadata=http://h:2/metadata") == "mooncake"
    assert backend_for_url("s3://bucket") is None
    assert takes_url("mem")
    assert takes_url("redis")
    assert not takes_url("file")
    cfg = load_config({"storage.backend": "mem"})
    with private_store(cfg) as (with_store, store):
        assert store is not None
        assert with_store.storage.url == store.url
        assert store.url.removeprefix("mem://") in memstore.STORES
    assert store.url.removeprefix("mem://") not in memstore.STORES  # stopped on exit


def test_campaign_cells_take_the_command_lines_store(tmp_path: Path) -> None:
    spec_file = tmp_path / "mem.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "mem", "defaults": {"storage.backend": "mem"},
        "cells": [{"id": "one", "tp": 1, "pp": 1, "expect": "healthy"}]}))
    spec = load_campaign(spec_file)
    assert needs_store(spec, spec.cells) == []  # it starts its own when none is named
    cfg = cell_config(spec, spec.cells[0], tmp_path, tmp_path / "bundles",
                      storage_url="mem://from-cli")
    assert cfg.storage.url == "mem://from-cli"


def test_a_replay_maps_a_url_to_its_backend() -> None:
    raw = {"storage": {"backend": "file"}}
    guarded = guard_config(raw, storage_url="mem://replay")
    assert (guarded.cfg.storage.backend, guarded.cfg.storage.url) == ("mem", "mem://replay")
    with pytest.raises(ConfigError, match=r"uses no known L3 backend's URL scheme"):
        guard_config(raw, storage_url="s3://bucket/key")
    note = guard_config({"storage": {"backend": "mem", "url": "mem://theirs"}})
    assert "used a mem store at mem://theirs; not contacted" in " ".join(note.notes)


def test_a_real_run_keeps_its_l3_in_the_new_backend(tmp_path: Path) -> None:
    cfg = load_config({
        "storage.backend": "mem", "workload.requests": 48, "cache.device_tokens": 512,
        "cache.host_tokens": 768, "storage.io_batch_pages": 4,
        "observability.watchdog_timeout_s": 30.0})
    with private_store(cfg) as (cfg, store):
        assert store is not None
        first = run_single(cfg, compare=False, bundle_root=tmp_path)
        assert first.outcome is RunOutcome.HEALTHY, first.error
        assert memstore.STORES[store.url.removeprefix("mem://")], "L3 got the backups"
        again = run_single(cfg, bundle_root=tmp_path)  # same prompts, L1 and L2 empty
    assert again.outcome is RunOutcome.HEALTHY, again.error
    assert again.output_match is not False
    assert again.cached_tokens.storage > 0, "hits came back from the mem store"
