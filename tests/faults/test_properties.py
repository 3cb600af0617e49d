"""Property campaigns: the shipped spec covers every survivable fault on every topology with
five seeds; a property campaign runs fixed protocols only; each cell is judged on each
property and the reports (terminal, JSON, JUnit, Markdown) carry a table per property. The
campaign itself, one seed, is run in tests/multirank/test_property_campaign.py."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

import render
from cli import app
from faults.campaign.cells import (
    CampaignResult,
    CellResult,
    DiagnosedRun,
    judge_properties,
    property_results,
    run_campaign,
    select,
)
from faults.campaign.plan import Property, load_campaign
from faults.campaign.reports import junit_xml, markdown
from faults.kinds.builtin import BUILTIN
from faults.spec import FaultKind, parse_faults
from hicache_runtime.contracts.errors import ConfigError
from tests.test_presentation import _check_tables

SPEC = Path(__file__).resolve().parents[2] / "faults" / "campaigns" / "properties.yaml"
TOPOLOGIES = {"tp1", "tp2", "pp2", "tp2pp2"}
STORAGE = {FaultKind.STORAGE_SHORTFALL, FaultKind.STORAGE_LATENCY, FaultKind.STORAGE_ERROR,
           FaultKind.STORAGE_CORRUPT, FaultKind.MID_PREFETCH_ABORT}


def test_the_spec_covers_every_survivable_fault_on_every_topology_with_five_seeds() -> None:
    spec = load_campaign(SPEC)
    assert spec.properties == list(Property)
    cells = spec.expand()
    covered: dict[str, set[str]] = {}
    seeds: dict[str, set[int]] = {}
    for c in cells:
        assert not c.legacy
        assert c.expect == "healthy"
        assert c.compare
        kinds = {f.kind for f in parse_faults(c.faults)}
        assert len(kinds) == 1, c.id  # one kind a cell: a violation names its fault
        kind = kinds.pop()
        covered.setdefault(kind, set()).add(c.id.split("/")[0])
        seeds.setdefault(c.id.removesuffix(f"/seed{c.seed}"), set()).add(c.seed)
        if kind in STORAGE:
            assert c.warm, f"{c.id}: a storage fault needs a store to read"
    survivable = {k.name for k in BUILTIN if k.survivable}
    assert set(covered) == survivable  # a new fault kind must join the property campaign
    for kind, topos in covered.items():
        assert topos == TOPOLOGIES, (kind, topos)
    assert all(s == {0, 1, 2, 3, 4} for s in seeds.values())
    assert spec.defaults["storage.backend"] == "file"


def test_one_seed_replaces_the_matrix_seeds() -> None:
    spec = load_campaign(SPEC)
    every = spec.expand()
    one = select(spec, None, [0])
    assert len(one) * 5 == len(every)
    assert {c.seed for c in one} == {0}
    assert [c.id for c in one] == [c.id for c in every if c.seed == 0]
    # a cell without seeds of its own still gets one run per seed
    default = load_campaign()
    assert len(select(default, None, [0, 1])) == 2 * len(default.expand())


@pytest.mark.parametrize(("body", "message"), [
    ("    legacy: [[], [skip-empty-sync]]\n", "no legacy switch"),
    ("    expect: {fixed: collective-order-deadlock}\n", "expects healthy"),
    ("    faults: [['crash:point=scheduler.step,step=3']]\n", "failure itself"),
])
def test_a_property_campaign_runs_fixed_protocols_that_must_stay_healthy(
        body: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text("properties: [no-crash]\nmatrix:\n  - topologies: [{tp: 2}]\n" + body)
    with pytest.raises(ConfigError, match=message):
        load_campaign(path)
    path.write_text("properties: [no-hang, no-hang]\n")
    with pytest.raises(ConfigError, match="twice"):
        load_campaign(path)
    path.write_text("properties: [no-deadlock]\n")
    with pytest.raises(ConfigError, match="properties"):
        load_campaign(path)


def _obs(**kw: object) -> DiagnosedRun:
    base: dict[str, object] = {"outcome": "healthy", "output_match": True, "bundle": None,
                               "error": None, "faults_fired": 1, "leaked_pages": 0,
                               "leaks_complete": True}
    return DiagnosedRun.model_validate({**base, **kw})


def test_each_property_is_held_violated_or_unchecked() -> None:
    props = list(Property)
    names = [p.value for p in props]
    assert judge_properties(props, _obs()) == dict.fromkeys(names, True)
    crashed = judge_properties(props, _obs(outcome="crash", output_match=None,
                                           leaked_pages=None, leaks_complete=False))
    assert crashed == {"no-crash": False, "no-hang": True, "no-wrong-token": None,
                       "no-leaked-page": None}
    hung = judge_properties(props, _obs(outcome="hang", output_match=None, leaked_pages=None))
    assert hung["no-hang"] is False
    assert hung["no-crash"] is True
    wrong = judge_properties(props, _obs(outcome="wrong-output", output_match=False))
    assert wrong["no-wrong-token"] is False
    assert wrong["no-leaked-page"] is True
    # the drain's check failed: a crash, and a leak the accounting names
    leaked = judge_properties(props, _obs(outcome="crash", output_match=None, leaked_pages=2))
    assert leaked["no-leaked-page"] is False
    assert leaked["no-crash"] is False
    # one rank drained clean, another never got there: not enough to say nothing leaked
    partial = judge_properties(props, _obs(outcome="crash", leaked_pages=0,
                                           leaks_complete=False, output_match=None))
    assert partial["no-leaked-page"] is None


def _result() -> CampaignResult:
    spec = load_campaign(SPEC)
    ok = CellResult(id="tp2/fixed/dma-lag:rank=1,ms=30/seed0", expect="healthy",
                    observed="healthy", passed=True, outcome="healthy", wall_s=3.0,
                    output_match=True, faults=["dma-lag:rank=1,ms=30"], leaked_pages=0,
                    properties=dict.fromkeys([p.value for p in Property], True))
    bad = CellResult(id="pp2/fixed/storage-latency:pp=1,ms=1500/seed3", expect="healthy",
                     observed="collective-order-deadlock", verdict="collective-order-deadlock",
                     passed=False, outcome="hang", wall_s=30.0,
                     faults=["storage-latency:pp=1,ms=1500"], error="rank 0: timed out",
                     bundle="hicache-bundles/20260101-000000-hang-pp2-abcdef",
                     properties={"no-crash": True, "no-hang": False, "no-wrong-token": None,
                                 "no-leaked-page": None})
    return CampaignResult(name=spec.name, started_at="2026-01-01T00:00:00Z", wall_s=33.0,
                          cells=[ok, bad], properties=property_results(spec, [ok, bad]))


def test_property_results_name_the_violating_cells_and_bundles() -> None:
    result = _result()
    by = {p.property: p for p in result.properties}
    assert [p.property for p in result.properties] == [p.value for p in Property]
    assert (by["no-hang"].checked, by["no-hang"].violations) == (2, 1)
    v = by["no-hang"].violating[0]
    assert v.cell.startswith("pp2/")
    assert v.bundle
    assert v.faults == ["storage-latency:pp=1,ms=1500"]
    assert "collective-order-deadlock" in v.detail
    assert "timed out" in v.detail
    assert by["no-wrong-token"].checked == 1
    assert by["no-wrong-token"].unchecked == [v.cell]
    assert by["no-crash"].holds
    assert not by["no-hang"].holds


def test_reports_carry_a_table_per_property(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    result = _result()
    root = ET.fromstring(junit_xml(result))
    assert root.tag == "testsuites"
    assert root.attrib["failures"] == "2"
    cells, props = root.findall("testsuite")
    assert len(cells.findall("testcase")) == 2
    assert props.attrib["name"].endswith(".properties")
    failing = {c.attrib["name"]: c.find("failure") for c in props.findall("testcase")}
    assert set(failing) == {p.value for p in Property}
    hang = failing["no-hang"]
    assert hang is not None
    assert "hang-pp2-abcdef" in (hang.text or "")
    assert failing["no-crash"] is None
    md = markdown(result)
    assert "## Properties" in md
    assert "`no-hang` **VIOLATED** |" in md
    assert "### `no-hang`: 1 violation(s)" in md
    assert "hang-pp2-abcdef" in md
    data = json.loads(result.model_dump_json())
    assert data["properties"][1]["violating"][0]["bundle"].endswith("abcdef")
    # the terminal: every table whole and headed at 80 columns
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    render.campaign_summary(result)
    text = capsys.readouterr().out
    _check_tables(text, 80, tables=2)
    assert "3 of 4 properties held" in text
    assert "no-hang violated in 1 cell(s)" in text
    assert "hang-pp2-abcdef" in text


def test_a_violation_on_a_real_run_is_reported_with_its_bundle(tmp_path: Path,
                                                              bundle_root: Path) -> None:
    """A step that takes longer than the watchdog allows is a hang, whatever caused it: the
    property table names the cell, its fault and the bundle the hang left."""
    path = tmp_path / "p.yaml"
    path.write_text("""
name: slow
properties: [no-crash, no-hang, no-wrong-token, no-leaked-page]
defaults: {workload.requests: 4}
matrix:
  - faults: [["stage-lag:ms=2000,steps=3-3"]]
    config: {observability.watchdog_timeout_s: 0.5}
  - faults: [["stage-lag:ms=1,steps=3-3"]]
""")
    result = run_campaign(load_campaign(path), bundle_root=bundle_root)
    hung, fine = result.cells
    assert hung.outcome == "hang"
    assert not hung.passed
    assert fine.passed, fine
    assert fine.leaked_pages == 0
    by = {p.property: p for p in result.properties}
    assert by["no-hang"].violations == 1
    assert by["no-crash"].violations == 0
    assert by["no-leaked-page"].checked == 1
    assert by["no-leaked-page"].unchecked == [hung.id]
    v = by["no-hang"].violating[0]
    assert v.cell == hung.id
    assert v.faults == ["stage-lag:ms=2000,steps=3-3"]
    assert v.bundle is not None
    assert Path(v.bundle).is_dir()
    res = CliRunner().invoke(app, ["campaign", str(path), "--json", "--bundle-dir",
                                   str(tmp_path / "b"), "--only", "*,ms=1"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [p["violations"] for p in data["properties"]] == [0, 0, 0, 0]
    assert [p["checked"] for p in data["properties"]] == [1, 1, 1, 1]


def test_the_seed_cap_counts_the_runs_seeds_make() -> None:
    """Ten seeds of the five-seed property campaign are 10 runs per cell (350 in all), not
    10 × its 175 expanded cells: accepted (the listing runs nothing)."""
    res = CliRunner().invoke(app, ["campaign", str(SPEC), "--seeds", "0-9", "--list", "--json"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)) == 10 * len(select(load_campaign(SPEC), None, [0]))
