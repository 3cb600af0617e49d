"""CI shards and their merge: the partition is deterministic, balanced and complete; merged
shard results equal an unsharded run's; a merge refuses shards that are not one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from faults.campaign.cells import CampaignResult, CellResult, run_campaign
from faults.campaign.plan import CampaignSpec, load_campaign
from faults.campaign.shards import cell_cost, merge, parse_shard, shard
from hicache_runtime.contracts.errors import ConfigError


def test_shards_partition_the_cells_deterministically_and_in_balance() -> None:
    spec = load_campaign()
    cells = spec.expand()
    for n in (1, 2, 3, 5):
        parts = [shard(spec, cells, i, n) for i in range(1, n + 1)]
        assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in cells)
        assert parts == [shard(spec, cells, i, n) for i in range(1, n + 1)]  # same again
        for p in parts:  # each keeps the campaign's order
            ids = [c.id for c in cells]
            assert [c.id for c in p] == sorted((c.id for c in p), key=ids.index)
        costs = [sum(cell_cost(spec, c) for c in p) for p in parts]
        biggest = max(cell_cost(spec, c) for c in cells)
        assert max(costs) - min(costs) <= biggest, costs  # greedy bound: one cell apart


def test_a_shard_spec_is_checked() -> None:
    assert parse_shard("2/4") == (2, 4)
    for bad in ("0/4", "5/4", "2", "a/b", "1/99999"):
        with pytest.raises(ConfigError, match="I/N"):
            parse_shard(bad)


def _result(shard_of: str | None, ids: list[str], selection: list[str]) -> CampaignResult:
    return CampaignResult(name="c", started_at="t", wall_s=1.0, shard=shard_of,
                          selection=selection, cells=[
                              CellResult(id=i, expect="healthy", observed="healthy",
                                         passed=True, outcome="healthy", wall_s=1.0)
                              for i in ids])


def test_a_merge_refuses_what_is_not_every_shard_of_one_run() -> None:
    sel = ["a", "b", "c"]
    whole = merge([_result("2/2", ["b"], sel), _result("1/2", ["a", "c"], sel)])
    assert [c.id for c in whole.cells] == sel
    with pytest.raises(ConfigError, match="each once"):
        merge([_result("1/3", ["a"], sel), _result("2/3", ["b", "c"], sel)])
    with pytest.raises(ConfigError, match="two shards"):
        merge([_result("1/2", ["a", "b"], sel), _result("2/2", ["b", "c"], sel)])
    with pytest.raises(ConfigError, match="different selections"):
        merge([_result("1/2", ["a"], sel), _result("2/2", ["b", "c"], ["a", "b", "c", "d"])])
    with pytest.raises(ConfigError, match="whole run"):
        merge([_result(None, sel, [])])


SPEC = {
    "name": "tiny",
    "defaults": {"workload.requests": 8, "cache.device_tokens": 256, "cache.host_tokens": 512},
    "cells": [{"tp": 1, "faults": ["dma-lag:ms=5"], "expect": "healthy"},
              {"tp": 1, "faults": ["stage-lag:ms=2"], "expect": "healthy"},
              {"tp": 1, "faults": ["crash:point=scheduler.step,step=3"],
               "expect": "no-signature"}],
}


@pytest.mark.slow
def test_merged_shards_equal_the_unsharded_run(tmp_path: Path) -> None:
    from cli import app

    spec = CampaignSpec.model_validate(SPEC)
    whole = run_campaign(spec, bundle_root=tmp_path / "whole")
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps(SPEC))
    runner = CliRunner()
    outs = []
    for i in (1, 2):
        out = tmp_path / f"shard{i}.json"
        res = runner.invoke(app, ["campaign", str(path), "--shard", f"{i}/2", "--json",
                                  "--bundle-dir", str(tmp_path / f"b{i}")])
        assert res.exit_code == 0, res.output
        out.write_text(res.stdout)
        outs.append(str(out))
    merged_path = tmp_path / "all.json"
    from cli import main

    with pytest.raises(SystemExit) as done:
        main(["campaign", "merge", *outs, "-o", str(merged_path),
              "--junit", str(tmp_path / "all.xml")])
    assert done.value.code == 0
    merged = CampaignResult.model_validate_json(merged_path.read_text())
    assert [(c.id, c.observed, c.passed) for c in merged.cells] == \
        [(c.id, c.observed, c.passed) for c in whole.cells]
    assert "<testcase" in (tmp_path / "all.xml").read_text()


def test_failing_cells_are_listed_once_per_way_of_failing() -> None:
    from faults.campaign.reports import markdown

    def failed(cid: str, fp: str | None, observed: str) -> CellResult:
        return CellResult(id=cid, expect="healthy", observed=observed, passed=False,
                          outcome="crash", wall_s=1.0, fingerprint=fp, detail="expected "
                          "healthy", bundle=f"/b/{cid.replace('/', '-')}")

    result = CampaignResult(name="c", started_at="t", wall_s=1.0, cells=[
        failed("a/seed0", "fp-1", "write-ack-pop-empty"), _result(None, ["ok"], []).cells[0],
        failed("a/seed1", "fp-1", "write-ack-pop-empty"),
        failed("b/seed0", None, "no-signature"), failed("a/seed2", "fp-1",
                                                        "write-ack-pop-empty")])
    groups = result.failure_groups()
    assert [(k, [c.id for c in g]) for k, g in groups] == [
        ("fp-1", ["a/seed0", "a/seed1", "a/seed2"]), ("crash: no-signature", ["b/seed0"])]
    page = markdown(result)
    assert "`a/seed0` (and 2 more: `a/seed1`, `a/seed2`; `fp-1`)" in page
    assert page.count("— bundle ") == 2
