"""Campaigns, replay and shrink on real runs (single-rank cells here; the multi-rank ones are in
tests/multirank/test_campaigns.py)."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from faults.campaign.cells import run_campaign
from faults.campaign.plan import load_campaign
from faults.campaign.replay import replay
from faults.campaign.shrink import shrink_bundle
from hicache_runtime.contracts.bundle import load_manifest
from tests.helpers import SUM_HIT_PAGES_CAMPAIGN

SPEC = SUM_HIT_PAGES_CAMPAIGN
BAD_EXPECTATIONS = """
name: wrong
defaults: {workload.requests: 12}
cells:
  - expect: collective-order-deadlock
  - faults: ["crash:point=scheduler.step,step=3"]
    expect: healthy
  - faults: ["crash:point=scheduler.step,step=99999"]
    expect: collective-order-deadlock
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "tp1.yaml"
    path.write_text(SPEC)
    return path


def test_cells_pass_by_production_shape(spec_file: Path, bundle_root: Path) -> None:
    started: list[str] = []
    result = run_campaign(load_campaign(spec_file), bundle_root=bundle_root,
                          hook=lambda c, r: started.append(c.id) if r is None else None)
    assert [c.passed for c in result.cells] == [True, True], result.model_dump_json(indent=1)
    fixed, legacy = result.cells
    assert started == [fixed.id, legacy.id]
    assert fixed.observed == "healthy"
    assert fixed.output_match is True
    assert fixed.bundle is None
    assert legacy.outcome == "wrong-output"
    assert legacy.verdict == "prefetch-gap-overcount"
    assert legacy.faults_fired > 0
    origin = load_manifest(Path(legacy.bundle or "")).origin
    assert origin is not None
    assert origin.cell == legacy.id
    assert origin.warm
    # the folder of a campaign's bundles says which cell left each
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", legacy.id)
    assert Path(legacy.bundle or "").name.endswith("-wrong-output-" + str(os.getpid()) + "-"
                                                   + slug), legacy.bundle


def test_cells_that_do_not_behave_fail(tmp_path: Path, bundle_root: Path) -> None:
    path = tmp_path / "wrong.yaml"
    path.write_text(BAD_EXPECTATIONS)
    result = run_campaign(load_campaign(path), bundle_root=bundle_root)
    healthy_but_expected_sig, crashed_but_expected_healthy, never_fired = result.cells
    assert not healthy_but_expected_sig.passed
    assert healthy_but_expected_sig.observed == "healthy"
    assert "no fault fired" not in healthy_but_expected_sig.detail  # it has none
    assert not crashed_but_expected_healthy.passed
    assert crashed_but_expected_healthy.outcome == "crash"
    assert "expected healthy, got crash" in crashed_but_expected_healthy.detail
    # the run ended before step 99999: a healthy run that never met its fault
    assert not never_fired.passed
    assert never_fired.faults_fired == 0
    assert "no fault fired" in never_fired.detail, never_fired.detail
    assert result.failed == 3


def test_cli_campaign_reports(spec_file: Path, tmp_path: Path) -> None:
    junit, md = tmp_path / "out.xml", tmp_path / "out.md"
    res = CliRunner().invoke(app, ["campaign", str(spec_file), "--json", "--junit", str(junit),
                                   "--markdown", str(md), "--bundle-dir",
                                   str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [c["passed"] for c in data["cells"]] == [True, True]
    assert ET.parse(junit).getroot().attrib["failures"] == "0"
    assert "2 of 2 cells behaved as expected" in md.read_text()


def test_cli_campaign_exit_codes(tmp_path: Path) -> None:
    path = tmp_path / "wrong.yaml"
    path.write_text(BAD_EXPECTATIONS)
    runner = CliRunner()
    res = runner.invoke(app, ["campaign", str(path), "--only", "tp1/fixed/none",
                              "--bundle-dir", str(tmp_path / "b")])
    assert res.exit_code == 1
    assert "0 of 1 cells behaved as expected" in res.output
    res = runner.invoke(app, ["campaign", "--only", "nothing/*"])
    assert res.exit_code == 2
    assert "no cell" in res.output
    res = runner.invoke(app, ["campaign", "--list", "--seeds", "1-2,5", "--only", "tp1/*"])
    assert res.exit_code == 0
    assert res.output.count("/seed") == 6
    assert runner.invoke(app, ["campaign", "--list", "--seeds", "5-1"]).exit_code == 2
    res = runner.invoke(app, ["campaign", "--list"])
    assert res.exit_code == 0
    assert "tp2/skip-empty-sync/host-alloc-fail:tp=1" in res.output
    # what the README says it shows: pool sizes, timeouts, the L3 warm-up
    for shown in ("cache.device_tokens=512", "observability.protocol_timeout_s=4.0",
                  "warm-up run first", "sets storage.backend=file"):
        assert shown in " ".join(res.output.split()), shown
    listed = json.loads(runner.invoke(app, ["campaign", "--list", "--json"]).output)
    assert listed[0]["settings"]["cache.device_tokens"] == 512


def test_replay_and_shrink_a_campaign_bundle(spec_file: Path, tmp_path: Path,
                                             bundle_root: Path) -> None:
    result = run_campaign(load_campaign(spec_file), bundle_root=bundle_root,
                          only="*/sum-hit-pages/*")
    bundle = Path(result.cells[0].bundle or "")

    again = replay(bundle, work=tmp_path / "w", bundle_root=tmp_path / "rb")
    assert again.reproduced
    assert again.signature == "prefetch-gap-overcount"
    assert again.cell == result.cells[0].id
    assert again.trial.bundle

    out = tmp_path / "shrunk"
    shrunk = shrink_bundle(bundle, out, max_runs=5)
    assert shrunk.reproduced
    assert shrunk.runs <= 5 + shrunk.confirm_runs  # the search budget, then confirmation
    assert shrunk.confirm_runs == 3
    assert shrunk.shrunk.requests < shrunk.original.requests
    assert all(t.reproduced for t in shrunk.trials if t.change.startswith("requests=")
               and t.requests == shrunk.shrunk.requests)
    assert (out / "bundle" / "manifest.json").exists()
    cell = yaml.safe_load((out / "cell.yaml").read_text())["cells"][0]
    assert cell["expect"] == "prefetch-gap-overcount"
    assert cell["config"]["workload.requests"] == shrunk.shrunk.requests
    # the written cell reruns and still shows the signature
    rerun = run_campaign(load_campaign(out / "cell.yaml"), bundle_root=tmp_path / "rr")
    assert rerun.cells[0].passed, rerun.cells[0].detail


def test_cli_inject_names_the_signature_and_replay_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["inject", "crash:point=scheduler.step,step=3", "--requests", "6",
                              "--bundle-dir", str(tmp_path / "b"), "--json"])
    assert res.exit_code == 1, res.output
    obs = json.loads(res.output)
    assert obs["outcome"] == "crash"
    assert obs["bundle"]
    assert obs["faults_fired"] == 1
    res = runner.invoke(app, ["inject", "--replay", obs["bundle"], "--json",
                              "--bundle-dir", str(tmp_path / "b2")])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["reproduced"] is True
    # not a bundle / nothing given: one line, exit 2
    res = runner.invoke(app, ["inject", "--replay", str(tmp_path)])
    assert res.exit_code == 2
    assert "no manifest.json" in res.output
    assert runner.invoke(app, ["inject"]).exit_code == 2
    res = runner.invoke(app, ["inject", "stage-lag", "--replay", obs["bundle"]])
    assert res.exit_code == 2
