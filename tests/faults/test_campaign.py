"""Campaign specs (parsing, expansion, cell ids, the built-in default) and their reports."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from faults.campaign.cells import CampaignResult, CellResult, cell_config, select
from faults.campaign.plan import CampaignSpec, CellSpec, cell_from_config, cell_id, load_campaign
from faults.campaign.reports import junit_xml, markdown
from hicache_runtime.contracts.errors import ConfigError
from hicache_runtime.contracts.legacy import LegacySwitch
from signatures.loader import load_catalog

SPEC_YAML = """
name: small
defaults: {workload.requests: 12}
cells:
  - tp: 2
    legacy: [skip-empty-sync]
    faults: ["host-alloc-fail:tp=1"]
    expect: collective-order-deadlock
matrix:
  - topologies: [{pp: 2}, {tp: 2, pp: 2}]
    legacy: [[], [local-ack-drain]]
    faults: [["dma-lag:ms=30,pp=1"]]
    seeds: [0, 1]
    config: {cache.device_tokens: 256}
    expect: {fixed: healthy, local-ack-drain: prefix-length-mismatch|write-ack-pop-empty}
"""


def test_matrix_expands_to_the_cross_product_with_stable_ids(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(SPEC_YAML)
    spec = load_campaign(path)
    cells = spec.expand()
    assert len(cells) == 1 + 2 * 2 * 1 * 2
    assert cells[0].id == "tp2/skip-empty-sync/host-alloc-fail:tp=1"
    ids = [c.id for c in cells[1:]]
    # fault keys in canonical order, whatever order the spec wrote them in; seeds in the id
    assert "pp2/fixed/dma-lag:pp=1,ms=30/seed0" in ids
    assert "tp2pp2/local-ack-drain/dma-lag:pp=1,ms=30/seed1" in ids
    by_id = {c.id: c for c in cells}
    assert by_id["pp2/fixed/dma-lag:pp=1,ms=30/seed1"].expected == {"healthy"}
    assert by_id["pp2/local-ack-drain/dma-lag:pp=1,ms=30/seed0"].expected == {
        "prefix-length-mismatch", "write-ack-pop-empty"}
    assert by_id["tp2pp2/fixed/dma-lag:pp=1,ms=30/seed1"].seed == 1


def test_toml_and_json_specs(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('name = "t"\n[[cells]]\ntp = 2\nfaults = ["stage-lag:tp=1"]\n')
    assert [c.id for c in load_campaign(toml).expand()] == ["tp2/fixed/stage-lag:tp=1"]
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"name": "j", "cells": [{"pp": 2, "expect": "healthy"}]}))
    assert [c.id for c in load_campaign(js).expand()] == ["pp2/fixed/none"]


@pytest.mark.parametrize(("text", "field"), [
    ("cells: [{legacy: [no-such-switch]}]", "campaign.cells.0"),
    ("cells: [{faults: ['warp-drive:ms=1']}]", "campaign.cells.0"),
    ("cells: [{tp: 0}]", "campaign.cells.0.tp"),
    ("cells: [{tp: 2, colour: red}]", "campaign.cells.0.colour"),
    ("- just a list", "campaign"),
    ("cells: [{tp: 2}, {tp: 2}]", "cells"),
])
def test_bad_specs_are_one_clear_error(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_campaign(path).expand()
    assert info.value.field == field, str(info.value)


def test_unparsable_spec_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("cells: [unclosed")
    with pytest.raises(ConfigError, match=r"bad\.yaml"):
        load_campaign(path)


def test_default_campaign_covers_every_legacy_switch_with_a_fixed_twin() -> None:
    spec = load_campaign()
    cells = spec.expand()
    catalog_ids = {s.id for s in load_catalog().signatures}
    by_id = {c.id: c for c in cells}
    assert {s for c in cells for s in c.legacy} == {s.value for s in LegacySwitch}
    for cell in cells:
        if not cell.legacy:
            assert cell.expected == {"healthy"}, cell.id
            continue
        assert cell.expected <= catalog_ids, cell.id
        twin = cell.id.replace(f"/{'+'.join(sorted(cell.legacy))}/", "/fixed/", 1)
        assert by_id[twin].expected == {"healthy"}, twin


def test_only_selects_by_glob() -> None:
    spec = load_campaign()
    assert {c.id.split("/")[0] for c in select(spec, "pp2/*")} == {"pp2"}
    assert all("/fixed/" in c.id for c in select(spec, "*/fixed/*"))
    assert select(spec, "nothing/*") == []


def test_seeds_multiply_cells() -> None:
    cells = select(load_campaign(), "tp1/*", [3, 4])
    assert [c.id.rsplit("/", 1)[1] for c in cells] == ["seed3", "seed4"] * 2
    assert [c.seed for c in cells] == [3, 4, 3, 4]


def test_a_cell_round_trips_through_its_config(tmp_path: Path) -> None:
    spec = load_campaign()
    for cell in spec.expand():
        cfg = cell_config(spec, cell, tmp_path, tmp_path / "b")
        again = cell_from_config(cfg, expect=cell.expect, warm=cell.warm)
        assert again.id == cell.id
        cfg2 = cell_config(CampaignSpec(name="x"), again, tmp_path, tmp_path / "b")
        assert cfg2 == cfg, cell.id


def test_cell_id_shapes() -> None:
    assert cell_id(1, 1, [], []) == "tp1/fixed/none"
    assert cell_id(2, 2, ["b-switch", "a-switch"], ["stage-lag:ms=5,pp=1"], 3) == \
        "tp2pp2/a-switch+b-switch/stage-lag:pp=1,ms=5/seed3"


def _result() -> CampaignResult:
    return CampaignResult(name="demo", started_at="2026-11-29T10:00:00+00:00", wall_s=12.5,
                          cells=[
        CellResult(id="tp2/fixed/host-alloc-fail:tp=1", expect="healthy", observed="healthy",
                   passed=True, outcome="healthy", output_match=True, wall_s=3.0,
                   detail="healthy, outputs identical to the cache-disabled run"),
        CellResult(id="tp2/skip-empty-sync/host-alloc-fail:tp=1",
                   expect="collective-order-deadlock", observed="no-signature", passed=False,
                   outcome="hang", wall_s=9.5, bundle="/b/1 <&>", error="Timed out <x>",
                   detail="expected collective-order-deadlock, got hang / no-signature"),
    ])


def test_junit_xml_has_one_testcase_per_cell_and_failures() -> None:
    root = ET.fromstring(junit_xml(_result()))
    assert root.tag == "testsuite"
    assert root.attrib["tests"] == "2"
    assert root.attrib["failures"] == "1"
    cases = root.findall("testcase")
    assert [c.attrib["name"] for c in cases] == [c.id for c in _result().cells]
    assert cases[0].find("failure") is None
    failure = cases[1].find("failure")
    assert failure is not None
    assert failure.attrib["type"] == "no-signature"
    assert "bundle: /b/1 <&>" in (failure.text or "")


def test_markdown_report_lists_cells_and_failures() -> None:
    text = markdown(_result())
    assert "1 of 2 cells behaved as expected" in text
    assert "| `tp2/skip-empty-sync/host-alloc-fail:tp=1` | collective-order-deadlock |" in text
    assert "## Cells that did not behave" in text


def test_a_cell_that_ran_again_says_so_in_every_report(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """The Ray executor's reruns (a worker or node died under the cell) in the terminal
    summary, the Markdown page and the JUnit case, not only in the JSON."""
    import render

    result = _result()
    result.cells[0].reruns, result.cells[0].node = 1, "node-b"
    note = "ran again 1 time(s): the Ray worker or node running it died; its verdict is from node-b"
    assert result.cells[0].rerun_note == note
    assert result.cells[1].rerun_note is None
    assert f"- `tp2/fixed/host-alloc-fail:tp=1`: {note}" in markdown(result)
    case = ET.fromstring(junit_xml(result)).findall("testcase")[0]
    assert note in (case.findtext("system-out") or "")
    render.campaign_summary(result)
    assert "node-b" in " ".join(capsys.readouterr().out.split())


def test_a_ray_task_reserves_a_cpu_per_rank_and_per_busy_helper() -> None:
    """The launcher beside several ranks, the DP controller beside DP groups; a single rank
    runs in its launcher (the function only: no cluster needed)."""
    from faults.campaign.ray_executor import _cpus

    spec = CampaignSpec(name="x")
    assert _cpus(spec, CellSpec(tp=1)) == 1
    assert _cpus(spec, CellSpec(tp=2)) == 3
    assert _cpus(spec, CellSpec(tp=2, pp=2)) == 5
    assert _cpus(spec, CellSpec(tp=2, config={"topology.dp": 2})) == 6


def test_cellspec_rejects_unknown_switch() -> None:
    with pytest.raises(ValueError, match="no-such"):
        CellSpec(legacy=["no-such"])


def test_the_matrix_places_cells_by_their_parts_not_by_splitting_ids() -> None:
    """Named cells (a prefix, a fault with slashes in a glob) sit in their topology x fault row
    and their mode's column, like generated ones; a second seed gets its own row."""
    from faults.campaign.cells import identity
    from faults.campaign.plan import matrix_place
    from faults.campaign.reports import html_pages

    cells = [CellSpec(id="mooncake/tp2/abort-early-exit/mid-prefetch-abort:batch=1", tp=2,
                      legacy=["abort-early-exit"], faults=["mid-prefetch-abort:batch=1"],
                      expect="prefetch-abort-ack-starvation"),
             CellSpec(id="mooncake/tp2/fixed/mid-prefetch-abort:batch=1", tp=2,
                      faults=["mid-prefetch-abort:batch=1"]),
             CellSpec(tp=2, pp=2, legacy=["skip-empty-sync", "local-ack-drain"], seed=3)]
    assert matrix_place(cells[0]) == ("tp2 mid-prefetch-abort:batch=1", "abort-early-exit")
    assert matrix_place(cells[1]) == ("tp2 mid-prefetch-abort:batch=1", "fixed")
    assert matrix_place(cells[2]) == ("tp2pp2 none seed3", "local-ack-drain+skip-empty-sync")
    result = CampaignResult(name="m", started_at="2026-12-01T00:00:00+00:00", wall_s=1.0,
                            cells=[CellResult(**identity(c), observed=c.expect, passed=True,
                                              outcome="hang", wall_s=1.0) for c in cells])
    page = html_pages(result)["index.html"]
    body = page[page.index("<tbody>"):]
    assert body.count("<tr><th>") == 2  # two rows: the mooncake pair shares one
    assert "<th>tp2 mid-prefetch-abort:batch=1</th>" in page
    assert "<th>mooncake" not in page
