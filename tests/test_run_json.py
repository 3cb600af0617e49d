"""``hicache run --json`` has one schema whatever the topology: ``cache_stats.ranks.<rank>``
plus ``cache_stats.total``, durations in seconds rounded to the millisecond."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from cli import app
from hicache_runtime.launch.run import TIME_DECIMALS, CacheStats, RunSummary

SMALL = ["--requests", "8", "--device-tokens", "256", "--host-tokens", "512", "--page-size",
         "4", "--max-new-tokens", "4"]


def run_json(tmp_path: Path, *extra: str) -> dict[str, Any]:
    res = CliRunner().invoke(app, ["run", *SMALL, "--storage", "file", "--storage-path",
                                   str(tmp_path / "l3"), "--bundle-dir", str(tmp_path / "b"),
                                   "--json", *extra])
    assert res.exit_code == 0, res.output
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def floats(node: Any, path: str = "") -> list[tuple[str, float]]:
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in floats(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in floats(v, f"{path}[{i}]")]
    return [(path, node)] if isinstance(node, float) else []


def check_shape(out: dict[str, Any], ranks: set[str]) -> None:
    jsonschema.validate(out, RunSummary.model_json_schema(mode="serialization"))  # as written
    RunSummary.model_validate_json(json.dumps(out))  # extra keys are refused
    stats = out["cache_stats"]
    assert set(stats) == {"ranks", "total"}
    assert set(stats["ranks"]) == ranks
    shapes = {json.dumps(_keys(r)) for r in (*stats["ranks"].values(), stats["total"])}
    assert len(shapes) == 1, "every rank and the total have the same keys"
    for name in ("backup_tokens", "evicted_device", "load_tokens"):
        assert stats["total"][name] == sum(r[name] for r in stats["ranks"].values())
    assert stats["total"]["l3"]["backend"]["sets"] == sum(
        r["l3"]["backend"]["sets"] for r in stats["ranks"].values())
    times = floats(out)
    assert any(p.endswith("wall_s") for p, _ in times)
    for path, value in times:
        if path.endswith("_s"):
            assert value == round(value, TIME_DECIMALS), (path, value)


def _keys(node: Any) -> Any:
    return {k: _keys(v) for k, v in sorted(node.items())} if isinstance(node, dict) else None


def test_one_rank_run_json_has_the_schema(tmp_path: Path) -> None:
    out = run_json(tmp_path)
    assert out["outcome"] == "healthy"
    check_shape(out, {"0"})
    assert out["cache_stats"]["ranks"]["0"]["l3"]["backup_pages"] > 0


@pytest.mark.slow
def test_multi_rank_run_json_has_the_same_schema(tmp_path: Path) -> None:
    out = run_json(tmp_path, "--tp", "2")
    assert out["outcome"] == "healthy", out.get("error")
    check_shape(out, {"0", "1"})
    one = run_json(tmp_path / "one")
    assert _keys(one["cache_stats"]["total"]) == _keys(out["cache_stats"]["total"])


def test_a_run_without_l3_has_no_l3_block_anywhere() -> None:
    stats = CacheStats.of({0: {"backup_tokens": 3}, 1: {"backup_tokens": 4}})
    assert stats.total.backup_tokens == 7
    assert stats.total.l3 is None
    dumped = json.loads(stats.model_dump_json())
    assert set(dumped["ranks"]) == {"0", "1"}


def test_durations_are_rounded_whoever_sets_them() -> None:
    s = RunSummary.model_validate({
        "outcome": "healthy", "requests": 1, "completed": 1, "aborted": 0,
        "output_match": True, "cached_tokens": {}, "steps": 1, "wall_s": 1.23456789,
        "topology": {"tp": 1, "pp": 1}})
    assert s.wall_s == 1.235
    s.reference_wall_s = 0.1000004
    assert s.reference_wall_s == 0.1
    stats = CacheStats.of({0: {"l3": {"backend": {"get_s": 0.123456, "gets": 2}}}})
    assert stats.ranks[0].l3 is not None
    assert stats.ranks[0].l3.backend.get_s == 0.123
