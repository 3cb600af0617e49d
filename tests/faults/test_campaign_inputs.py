"""A campaign spec is untrusted input: it is checked whole when it is loaded, before any cell
runs; cell counts are computed, never expanded, and every error is one line."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import app
from faults.campaign.plan import MAX_CELLS, CampaignSpec, load_campaign
from hicache_runtime.contracts.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
AS_CAP = 1536 << 20


def _spec(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_campaign(_spec(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message
    assert len(message) < 400, message
    return message


@pytest.mark.parametrize(("text", "says"), [
    ("cells:\n  - expect: helthy\n", "did you mean healthy"),
    ("cells:\n  - tp: 2\n    legacy: [skip-empty-sync]\n    expect: collective-order-dedlock\n",
     "did you mean collective-order-deadlock"),
    ("cells:\n  - expect: healthy|no-such-signature\n", "'no-such-signature'"),
    ("cells:\n  - expect: '|'\n", "empty expectation"),
    ("matrix:\n  - legacy: [[], [skip-empty-sync]]\n"
     "    expect: {fixed: healthy, skip-empty-sync: colective-order-deadlock}\n",
     "expect.skip-empty-sync"),
])
def test_unknown_expectations_fail_at_load(tmp_path: Path, text: str, says: str) -> None:
    message = _load_error(tmp_path, text)
    assert "nor a known signature" in message or "empty" in message
    assert says in message, message


def test_a_typo_in_a_matrix_expect_key_fails_at_load(tmp_path: Path) -> None:
    """``fixd`` would otherwise leave every cell of the matrix expecting healthy."""
    message = _load_error(tmp_path, "matrix:\n  - legacy: [[], [skip-empty-sync]]\n"
                                    "    expect: {fixd: healthy}\n")
    assert "expect key 'fixd'" in message


def test_topology_keys_are_checked(tmp_path: Path) -> None:
    assert "not tpp" in _load_error(tmp_path, "matrix:\n  - topologies: [{tpp: 2}]\n")


@pytest.mark.parametrize(("text", "says"), [
    ("cells:\n  - tp: 2\n    faults: ['crash:rank=9,point=scheduler.step']\n",
     "rank=9, but the run has 2 ranks"),
    ("matrix:\n  - topologies: [{tp: 2}]\n    faults: [['dma-lag:pp=1']]\n",
     "pp=1, but the run has 1 pipeline stage"),
])
def test_fault_selectors_outside_a_cells_topology_fail_at_load(tmp_path: Path, text: str,
                                                               says: str) -> None:
    assert says in _load_error(tmp_path, text)


def test_cell_configs_are_validated_at_load(tmp_path: Path) -> None:
    message = _load_error(tmp_path, "defaults: {workload.requests: 99999999999}\n"
                                    "cells: [{}]\n")
    assert "workload.requests" in message
    assert "tp1/fixed/none" in message


def test_the_cell_count_is_capped_before_expanding() -> None:
    matrix = {"topologies": [{"tp": 1}] * 100, "faults": [[]] * 100, "seeds": list(range(100))}
    with pytest.raises(ValueError, match="expands to 1000000 cells"):
        CampaignSpec.model_validate({"matrix": [matrix]})
    assert CampaignSpec.model_validate({"matrix": [{**matrix, "seeds": [0]}] * 0}).size == 0


def test_a_million_cell_matrix_is_refused_fast_in_bounded_memory(tmp_path: Path) -> None:
    """About 23 KB of spec that would expand to 10**6 cells: refused before expanding."""
    topologies = ", ".join(["{tp: 1}"] * 100)
    faults = ", ".join(f"['stage-lag:ms={i}']" for i in range(100))
    seeds = ", ".join(str(i) for i in range(100))
    spec = _spec(tmp_path, f"matrix:\n  - topologies: [{topologies}]\n    faults: [{faults}]\n"
                           f"    seeds: [{seeds}]\n")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), "campaign", str(spec), "--list"], cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}, capture_output=True,
        text=True, timeout=60, check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (AS_CAP, AS_CAP)))
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"expands to 1000000 cells; at most {MAX_CELLS}" in lines[0]
    assert time.monotonic() - t0 < 30


def test_expectation_typo_stops_the_campaign_before_any_cell_runs(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "cells:\n  - expect: healthy\n  - id: second\n"
                           "    expect: helthy\n")
    bundles = tmp_path / "bundles"
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["campaign", str(spec), "--bundle-dir", str(bundles)])
    assert res.exit_code == 2, res.output
    assert "did you mean healthy" in res.stderr
    assert time.monotonic() - t0 < 20, "no cell ran"
    assert not bundles.exists()


def test_seed_ranges_are_counted_before_they_are_materialised(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "cells: [{}, {id: second, seed: 1}]\n")
    res = CliRunner().invoke(app, ["campaign", str(spec), "--seeds", "0-99999999999999999",
                                   "--list"])
    assert res.exit_code == 2
    assert "more than 100000 seeds" in res.stderr
    res = CliRunner().invoke(app, ["campaign", str(spec), "--seeds", "0-60000", "--list"])
    assert res.exit_code == 2
    assert "120002 cell runs" in res.stderr


def test_the_readme_nightly_run_lists_and_shards() -> None:
    """The README's nightly line (--seeds 0-99 over the fixed cells: 1200 runs, past a spec's
    own 1000 cells; the seeds are the user's multiplier, up to MAX_RUNS), listed whole and as
    one shard of 30."""
    args = ["campaign", "--seeds", "0-99", "--only", "*/fixed/*", "--list"]
    whole = CliRunner().invoke(app, args)
    assert whole.exit_code == 0, whole.output
    ids = [line for line in whole.stdout.splitlines() if "/fixed/" in line]
    assert len(ids) > MAX_CELLS
    assert any(line.endswith("/seed99") for line in ids)
    part = CliRunner().invoke(app, [*args, "--shard", "1/30"])
    assert part.exit_code == 0, part.output
    shard_ids = [line for line in part.stdout.splitlines() if "/fixed/" in line]
    assert 0 < len(shard_ids) < len(ids) / 20


def test_the_default_campaign_still_loads() -> None:
    assert len(load_campaign().expand()) >= 17


def test_a_cell_may_expect_a_failure_no_signature_fits(tmp_path: Path) -> None:
    """What the shrinker writes for an unknown crash (``expect: no-signature``) loads as a
    campaign, so the shrunk case can be rerun as a cell."""
    spec = load_campaign(_spec(tmp_path, "cells:\n  - faults: ['crash:point=scheduler.step']\n"
                                         "    expect: no-signature\n"))
    assert [c.expect for c in spec.cells] == ["no-signature"]


def test_a_spec_built_in_code_is_size_checked_before_its_cell_runs(tmp_path: Path) -> None:
    """Specs made by code (bench scripts, the shrinker) bypass the YAML loader: the cell's
    config is still refused when a run could not hold it, before anything starts."""
    from faults.campaign.cells import cell_config
    from faults.campaign.plan import CellSpec

    spec = CampaignSpec(defaults={"workload.requests": 10_000_000})
    cell = CellSpec(id="huge")
    with pytest.raises(ConfigError, match=r"workload\.requests"):
        cell_config(spec, cell, tmp_path, tmp_path / "bundles")
    assert not (tmp_path / "bundles").exists()


def _fields(model: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            out |= _fields(ann, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = ann
    return out


def test_every_config_key_that_names_a_place_is_a_location_key() -> None:
    """LOCATION_KEYS is a list of what a spec may not set: a new path-, URL- or host-typed
    config field must join it, or a spec could set it. Every field typed as a path or named
    like a place is in it."""
    from hicache_runtime.config import LOCATION_KEYS, RuntimeConfig

    places = {key for key, ann in _fields(RuntimeConfig).items()
              if "Path" in str(ann) or key.rsplit(".", 1)[-1].rsplit("_", 1)[-1] in
              ("path", "url", "dir", "host", "addr", "address", "uri", "file", "socket")}
    assert places == set(LOCATION_KEYS)


@pytest.mark.parametrize("where", [
    "defaults: {{{key}: {value}}}\ncells:\n  - expect: healthy\n",
    "cells:\n  - expect: healthy\n    config: {{{key}: {value}}}\n",
    "matrix:\n  - faults: [[]]\n    config: {{{key}: {value}}}\n    expect: {{fixed: healthy}}\n",
])
@pytest.mark.parametrize(("key", "value"), [
    ("observability.trace_path", "{victim}"), ("observability.bundle_dir", "{victim}.d"),
    ("storage.path", "{victim}.store"), ("storage.url", "'redis://127.0.0.1:6379/5'"),
    ("storage", "{{path: {victim}.nested}}"),
])
def test_a_spec_cannot_name_a_path_or_a_server(tmp_path: Path, where: str, key: str,
                                                value: str) -> None:
    """A spec that names a file, a directory or a store (dotted or nested) is refused before
    anything runs: it used to truncate the file it named with trace lines and write keys to
    the Redis it named. `--list` refuses it too; nothing is written anywhere."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    spec = _spec(tmp_path, where.format(key=key, value=value.format(victim=victim)))
    res = CliRunner().invoke(app, ["campaign", str(spec), "--list"])
    assert res.exit_code == 2, res.output
    assert "may not name a path, URL or server" in res.stderr
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "victim.txt"]


def test_the_store_of_a_campaign_comes_from_the_command_line(tmp_path: Path) -> None:
    from faults.campaign.cells import cell_config

    spec = load_campaign(_spec(tmp_path, "defaults: {storage.backend: redis}\n"
                                          "cells:\n  - expect: healthy\n"))
    cell = spec.expand()[0]
    cfg = cell_config(spec, cell, tmp_path, tmp_path / "b", "redis://127.0.0.1:6390/3")
    assert cfg.storage.url == "redis://127.0.0.1:6390/3"
    assert cfg.observability.bundle_dir == tmp_path / "b"
    with pytest.raises(ConfigError, match="redis"):
        cell_config(spec, cell, tmp_path, tmp_path / "b")  # no store named: none is invented


def test_a_redis_campaign_runs_against_the_store_the_command_line_names(
        tmp_path: Path, redis_server: Any) -> None:
    """A spec asks for the redis backend; the server is the one --storage-url names (a real
    Redis), and without it the campaign refuses to start."""
    import redis

    spec = _spec(tmp_path, "name: r\ndefaults: {storage.backend: redis, workload.requests: 8}\n"
                           "cells:\n  - expect: healthy\n")
    res = CliRunner().invoke(app, ["campaign", str(spec)])
    assert res.exit_code == 2
    assert "--storage-url" in res.stderr
    client = redis.Redis.from_url(redis_server.url)
    before = client.dbsize()
    res = CliRunner().invoke(app, ["campaign", str(spec), "--storage-url", redis_server.url,
                                   "--bundle-dir", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 0, res.output
    assert client.dbsize() > before, "the cell wrote its pages to the named store"
