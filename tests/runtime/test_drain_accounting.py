"""End-of-run page accounting (``RunSummary.leaks``): what a rank still holds once drained, on
real pools and a real radix tree after real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.cache.accounting import drain_account, reached_drain
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.errors import InjectedFault, InvariantViolation
from hicache_runtime.engine.loop import Engine
from hicache_runtime.engine.rank import RankRuntime, build_rank
from hicache_runtime.engine.workload import Workload
from hicache_runtime.launch.run import RunSummary, run_single


def config(tmp_path: Path, **overrides: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "workload.requests": 16, "cache.device_tokens": 256, "cache.host_tokens": 512,
        "storage.backend": "file", "storage.path": tmp_path / "l3",
        "observability.watchdog_timeout_s": 30.0}
    base.update(overrides)
    return load_config(base)


def engine_for(cfg: RuntimeConfig) -> tuple[RankRuntime, Engine]:
    rt = build_rank(cfg)
    return rt, Engine(rt, Workload(cfg.workload, cfg.model.vocab_size, cfg.seed))


def test_a_healthy_run_reports_every_page_accounted_for(tmp_path: Path,
                                                        bundle_root: Path) -> None:
    s = run_single(config(tmp_path), bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.leaks is not None
    assert s.leaks.complete
    assert s.leaks.leaked_pages == 0
    d = s.leaks.ranks[0]
    # At drain the tree owns every page that is not free, on both tiers.
    assert d.device_tree > 0
    assert d.device_free + d.device_tree == d.device_capacity
    assert d.host_tree > 0
    assert d.host_free + d.host_tree == d.host_capacity
    assert s.leaks.describe() == "no page leaked"
    again = RunSummary.model_validate_json(s.model_dump_json())  # part of the --json schema
    assert again.leaks == s.leaks
    assert json.loads(s.model_dump_json())["leaks"]["ranks"]["0"]["leaked_pages"] == 0


def test_a_run_that_crashed_before_its_drain_has_no_accounting(tmp_path: Path,
                                                               bundle_root: Path) -> None:
    s = run_single(config(tmp_path, faults=(parse_fault("crash:point=scheduler.step,step=5"),)),
                   bundle_root=bundle_root)
    assert s.outcome is RunOutcome.CRASH
    assert s.leaks is None  # mid-run holdings are requests', not leaks


@pytest.mark.parametrize("pool", ["device", "host"])
def test_a_page_nobody_owns_fails_the_drain_and_is_counted(pool: str, tmp_path: Path) -> None:
    """One page taken from a pool and never given to a request or the tree: the drain's check
    raises, and the accounting taken then names the pool and the page."""
    rt, engine = engine_for(config(tmp_path))
    try:
        stray = getattr(rt.cache, pool).alloc(rt.cfg.cache.page_size)
        assert stray is not None
        with pytest.raises(InvariantViolation, match=f"{pool} pool") as info:
            engine.run()
        assert reached_drain(info.value)
        account = drain_account(rt.cache)
        assert account.leaks() == {f"{pool}_unowned": 1}
        assert account.leaked_pages == 1
    finally:
        rt.close()


def test_locks_pins_and_reservations_left_at_drain_are_leaks(tmp_path: Path) -> None:
    rt, engine = engine_for(config(tmp_path))
    try:
        engine.run()
        cache = rt.cache
        assert drain_account(cache).leaked_pages == 0
        node = next(n for n in cache.tree.nodes()
                    if n.value is not None and n.host_value is not None and n.key)
        pages = len(node.key) // cache.page_size
        cache.tree.inc_lock_ref(node)  # a holder that never unlocked
        cache.pins.pin(node.host_value)  # a backup that never released its pages
        assert cache.l3 is not None
        cache.l3.occupied += cache.page_size  # a prefetch reservation never returned
        account = drain_account(cache)
        locked = sum(len(n.key) // cache.page_size for n in cache.tree.path_to_root(node)
                     if n is not cache.tree.root)
        assert account.device_locked == locked >= pages
        assert account.host_pinned == pages
        assert account.l3_reserved == 1
        assert account.leaked_pages == locked + pages + 1
        assert account.device_unowned == account.host_unowned == 0
    finally:
        rt.close()


def test_a_crash_that_is_not_the_drain_check_is_not_a_drain(tmp_path: Path) -> None:
    rt, engine = engine_for(config(tmp_path, faults=(
        parse_fault("crash:point=scheduler.step,step=3"),)))
    try:
        with pytest.raises(InjectedFault) as info:
            engine.run()
        assert not reached_drain(info.value)
    finally:
        rt.close()
