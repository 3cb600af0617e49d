"""Release profiles without running anything: the registry derived from the switch registry,
the config's folding of a profile, the command line's profile commands and options, and the
release matrix's spec (``contracts/profiles.py``, ``faults/campaign/releases.py``)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from faults.campaign.cells import CellResult
from faults.campaign.plan import load_campaign
from faults.campaign.releases import parse_profiles, release_spec
from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.legacy import REGISTRY, Fidelity, LegacySwitch
from hicache_runtime.contracts.profiles import DEFAULT_PROFILE, PROFILES, HostAlloc, synthetic
from tests.readme_blocks import readme_line


def test_the_default_runtime_is_0_5_23_and_allocates_per_rank() -> None:
    cfg = load_config({})
    assert DEFAULT_PROFILE == "sglang-0.5.23"
    assert cfg.profile == DEFAULT_PROFILE
    assert cfg.legacy == frozenset()
    assert cfg.host_alloc is HostAlloc.PER_RANK
    assert load_config({"profile": "proposed"}).host_alloc is HostAlloc.AGREED
    # set explicitly, the allocation wins over the profile's
    assert load_config({"cache.host_alloc": "agreed"}).host_alloc is HostAlloc.AGREED


def test_a_profile_turns_on_the_switches_its_release_ran() -> None:
    cfg = load_config({"profile": "sglang-0.5.13", "legacy": ["wallclock-lru"]})
    assert cfg.legacy == {LegacySwitch.SKIP_EMPTY_SYNC, LegacySwitch.LOCAL_PREFETCH_PROGRESS,
                          LegacySwitch.UNBOUNDED_PP_SENDS, LegacySwitch.LOCAL_HOST_CAPACITY,
                          LegacySwitch.WALLCLOCK_LRU}
    assert load_config(cfg.model_dump(mode="python")) == cfg  # folding is idempotent
    assert load_config({"profile": "sglang-0.5.5"}).legacy == {
        LegacySwitch.LOCAL_ACK_DRAIN, LegacySwitch.SKIP_EMPTY_SYNC,
        LegacySwitch.LOCAL_PREFETCH_PROGRESS, LegacySwitch.LOCAL_HOST_CAPACITY}
    for name in ("sglang-0.5.20", "sglang-0.5.23", "proposed"):
        assert load_config({"profile": name}).legacy == frozenset(), name
    # the cache-disabled twin runs no switch of the profile
    assert cfg.reference().legacy == frozenset()


def test_profiles_are_derived_from_the_switch_registry() -> None:
    for p in PROFILES.values():
        for switch in p.switches:
            entry = REGISTRY[switch]
            assert p.release in entry.broken_in
            assert entry.fidelity is Fidelity.RELEASE
        for switch, why in p.left_out.items():
            assert REGISTRY[switch].fidelity is not Fidelity.RELEASE
            assert why.startswith(REGISTRY[switch].fidelity.value)
    assert PROFILES["proposed"].release is None
    assert PROFILES["proposed"].host_alloc is HostAlloc.AGREED
    assert all(p.host_alloc is HostAlloc.PER_RANK for n, p in PROFILES.items()
               if n != "proposed"), "no release votes on host allocation"
    assert synthetic(frozenset({LegacySwitch.WALLCLOCK_LRU, LegacySwitch.LOCAL_ACK_DRAIN})) == [
        LegacySwitch.WALLCLOCK_LRU]


def test_an_unknown_profile_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown profile 'sglang-9'.*sglang-0\.5\.23"):
        load_config({"profile": "sglang-9"})
    with pytest.raises(ConfigError, match="unknown or no profile"):
        parse_profiles("sglang-0.5.23,nope")
    assert parse_profiles(" sglang-0.5.13, proposed,sglang-0.5.13") == ["sglang-0.5.13",
                                                                        "proposed"]


def test_the_release_spec_keeps_the_fixed_cells_on_the_profile() -> None:
    spec = load_campaign()
    assert spec.defaults["profile"] == "proposed"  # the built-in cells: strongest protocols
    on = release_spec(spec, "sglang-0.5.13")
    cells = on.expand()
    assert cells
    assert all(not c.legacy for c in cells)
    assert all(c.expected == {"healthy"} for c in cells)
    assert on.defaults["profile"] == "sglang-0.5.13"
    assert {c.id for c in cells} == {c.id for c in spec.expand() if not c.legacy}


def test_profiles_list_and_show() -> None:
    from cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["profiles", "list", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == list(PROFILES)
    assert [r["name"] for r in rows if r["default"]] == [DEFAULT_PROFILE]
    shown = runner.invoke(app, ["profiles", "show", "sglang-0.5.16", "--json"])
    assert shown.exit_code == 0, shown.output
    row = json.loads(shown.stdout)
    assert [s["switch"] for s in row["switches"]] == ["local-prefetch-progress"]
    assert row["switches"][0]["fixed_by"] == ["#27010"]
    assert "wallclock-lru" in row["left_out"]
    assert row["not_modelled"]
    text = runner.invoke(app, ["profiles", "show", "proposed"])
    assert text.exit_code == 0
    assert "#31425" in " ".join(text.stdout.split())
    bad = runner.invoke(app, ["profiles", "show", "0.5.23"])
    assert bad.exit_code == 2
    assert "unknown profile" in bad.output
    # the README's two lines, as written
    listed = runner.invoke(app, shlex.split(readme_line("hicache profiles list"))[1:])
    assert listed.exit_code == 0, listed.output
    assert all(name in listed.stdout for name in PROFILES)
    readme = runner.invoke(app, shlex.split(readme_line("hicache profiles show"))[1:])
    assert readme.exit_code == 0, readme.output
    assert "sglang-0.5.13" in readme.stdout


def test_campaign_profile_options_are_checked_before_anything_runs() -> None:
    from cli import app

    runner = CliRunner()
    both = runner.invoke(app, ["campaign", "--profile", "proposed", "--profiles", "proposed"])
    assert both.exit_code == 2
    assert "not both" in both.output
    unknown = runner.invoke(app, ["campaign", "--profile", "sglang-1", "--list"])
    assert unknown.exit_code == 2
    assert "unknown profile" in unknown.output
    listed = runner.invoke(app, ["campaign", "--profiles", "sglang-0.5.13,sglang-0.5.23",
                                 "--list"])
    assert listed.exit_code == 0, listed.output
    assert "/fixed/" in listed.stdout
    assert "skip-empty-sync" not in listed.stdout.split("profile=")[1].split("\n", 1)[1]


def test_campaign_output_marks_cells_that_are_no_evidence_about_a_release() -> None:
    from faults.campaign.cells import CampaignResult, CellResult, identity
    from faults.campaign.reports import markdown

    spec = load_campaign()
    by_id = {c.id: c for c in spec.expand()}
    synthetic_cell = identity(by_id["tp2/wallclock-lru/dma-lag:rank=1,hold=3"])
    assert synthetic_cell["not_a_release"] == {"wallclock-lru": "synthetic"}
    assert identity(by_id["tp2/skip-empty-sync/host-alloc-fail:tp=1"])["not_a_release"] == {}
    result = CampaignResult(name="c", started_at="now", wall_s=1.0, cells=[
        CellResult(**synthetic_cell, observed="lru-clock-divergence", passed=True,
                   outcome="crash", wall_s=1.0)])
    page = markdown(result)
    assert "## Cells that are no evidence about a release" in page
    assert "`wallclock-lru` synthetic" in page


def test_the_catalog_marks_cells_that_are_no_evidence_about_a_release(tmp_path: Path) -> None:
    """A signature whose campaign cell needs a grafted or synthetic switch says so wherever
    the cell is shown: signatures show and list --json, its runbook and the campaign's JUnit;
    a release switch's cell says nothing of the kind."""
    from xml.etree import ElementTree as ET

    from cli import app
    from faults.campaign.cells import CampaignResult, identity
    from faults.campaign.reports import junit_xml
    from signatures.loader import load_catalog

    cat = {s.id: s for s in load_catalog().signatures}
    weak = {sid for sid, s in cat.items() if s.campaign and s.campaign.not_a_release}
    assert "lru-clock-divergence" in weak  # wallclock-lru: synthetic
    assert "collective-order-deadlock" not in weak  # skip-empty-sync: a release's own code
    for sid in weak:
        switch = cat[sid].campaign.parts[1]  # type: ignore[union-attr]
        assert not REGISTRY[LegacySwitch(switch)].in_profiles, sid
    runner = CliRunner()
    shown = runner.invoke(app, ["signatures", "show", "lru-clock-divergence"])
    assert "no evidence about a release" in " ".join(shown.stdout.split())
    plain = runner.invoke(app, ["signatures", "show", "collective-order-deadlock"])
    assert "no evidence about a release" not in " ".join(plain.stdout.split())
    listed = json.loads(runner.invoke(app, ["signatures", "list", "--json"]).stdout)
    marks = {r["id"]: r["campaign_cell_not_a_release"] for r in listed["signatures"]}
    assert set(marks["lru-clock-divergence"]) == {"wallclock-lru"}
    assert marks["collective-order-deadlock"] == {}
    res = runner.invoke(app, ["runbook", "-s", "lru-clock-divergence", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "Not evidence about a release: `wallclock-lru` is synthetic" in \
        (tmp_path / "lru-clock-divergence.md").read_text()
    cell = next(c for c in load_campaign().expand() if c.id == cat["lru-clock-divergence"]
                .campaign.cell)  # type: ignore[union-attr]
    result = CampaignResult(name="c", started_at="now", wall_s=1.0, cells=[
        CellResult(**identity(cell), observed="lru-clock-divergence", passed=True,
                   outcome="crash", wall_s=1.0)])
    out = ET.fromstring(junit_xml(result)).findall("testcase")[0].findtext("system-out")
    assert "not evidence about a release: wallclock-lru (synthetic)" in (out or "")


def _matrix_cell(profile: str, cell: str, observed: str) -> CellResult:
    topology, _mode, fault = cell.split("/", 2)
    clean = observed == "healthy"
    return CellResult(id=f"{profile}/{cell}", expect="healthy", observed=observed,
                      passed=clean, outcome="healthy" if clean else "crash", wall_s=1.0,
                      verdict=None if clean else observed, row=f"{topology} {fault}",
                      column=profile)


def test_a_matrix_becomes_verified_release_data_only_where_a_release_switch_exposes_it(
        tmp_path: Path) -> None:
    from faults.campaign.affected import affected, write_affected
    from faults.campaign.releases import ReleaseMatrix
    from signatures.loader import load_catalog

    profiles = ["sglang-0.5.13", "sglang-0.5.23"]
    cells = [_matrix_cell("sglang-0.5.13", "pp2/fixed/stage-lag:pp=1,ms=10",
                          "pp-sync-send-leak"),
             _matrix_cell("sglang-0.5.23", "pp2/fixed/stage-lag:pp=1,ms=10", "healthy"),
             _matrix_cell("sglang-0.5.13", "tp2/fixed/chunked-abort:chunk=0", "healthy"),
             _matrix_cell("sglang-0.5.23", "tp2/fixed/chunked-abort:chunk=0", "healthy")]
    matrix = ReleaseMatrix(campaign="default", profiles=profiles, started_at="t", wall_s=1.0,
                           cells=cells)
    doc = affected(matrix, load_catalog(), "cmd")
    leak = doc["signatures"]["pp-sync-send-leak"]
    assert leak["reproduces"] == ["sglang-0.5.13"]
    assert leak["row"] == "pp2 stage-lag:pp=1,ms=10"
    assert leak["clean"] == ["sglang-0.5.23"]
    # collective-shape-mismatch is exposed by a synthetic switch no profile turns on: its
    # fault running clean says nothing about a release, and nothing else saw it
    assert "collective-shape-mismatch" not in doc["signatures"]
    out = tmp_path / "affected.yaml"
    bad = tmp_path / "not-a-matrix.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match="not a release matrix"):
        write_affected(bad, out)
    good = tmp_path / "m.json"
    good.write_text(matrix.model_dump_json())
    assert write_affected(good, out) == (out, 1)
    assert out.read_text().startswith("# Generated")
