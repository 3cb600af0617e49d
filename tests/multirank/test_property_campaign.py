"""The property campaign (faults/campaigns/properties.yaml) as the README runs it: one seed of
every cell (every survivable fault on every topology it applies to, fixed protocols: no crash,
hang, wrong token or leaked page anywhere), and the five-seed line narrowed to one cell's
five seeds. Both run in a folder holding the spec where the README's path names it."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from faults.campaign.plan import Property, load_campaign
from tests.readme_blocks import ROOT, narrowed, readme_line, run_line

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SPEC = ROOT / "faults" / "campaigns" / "properties.yaml"


def _run(line: str, cwd: Path) -> dict[str, Any]:
    (cwd / "faults" / "campaigns").mkdir(parents=True)
    shutil.copy(SPEC, cwd / "faults" / "campaigns")
    proc = run_line(line, cwd, timeout=1500)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-3000:])
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_every_property_holds_under_every_fault_one_seed(tmp_path: Path) -> None:
    line = readme_line("hicache campaign faults/campaigns/properties.yaml --seeds 0")
    result = _run(f"{line} --json --junit out.xml", tmp_path)
    cells = result["cells"]
    assert len(cells) * 5 == len(load_campaign(SPEC).expand())
    violated = {p["property"]: [f"{v['cell']}: {v['detail']} ({v['bundle']})"
                                for v in p["violating"]]
                for p in result["properties"] if p["violations"]}
    assert not violated, violated
    failed = {c["id"]: f"{c['detail']} {c['error'] or ''}" for c in cells if not c["passed"]}
    assert not failed, failed
    # Every property was read in every cell: outputs compared, every rank drained.
    assert [p["property"] for p in result["properties"]] == [p.value for p in Property]
    assert all(p["checked"] == len(cells) for p in result["properties"]), result["properties"]
    assert all(c["leaked_pages"] == 0 for c in cells)
    # A fault that never fired would leave its cell healthy while testing nothing.
    assert [c["id"] for c in cells if c["faults_fired"] == 0] == []
    # Cells share their cache-disabled references and their warm-ups.
    assert result["references_reused"] > 0
    assert result["warmups_reused"] > 0
    root = ET.fromstring((tmp_path / "out.xml").read_text())
    assert root.attrib["failures"] == "0"


def test_five_seeds_of_a_cell(tmp_path: Path) -> None:
    line = narrowed(readme_line("hicache campaign faults/campaigns/properties.yaml"),
                    "tp1/fixed/dma-lag:ms=30/*")
    result = _run(f"{line} --json", tmp_path)
    assert [c["id"].rsplit("/", 1)[1] for c in result["cells"]] == \
        [f"seed{s}" for s in range(5)]
    assert all(c["passed"] and c["faults_fired"] > 0 for c in result["cells"])
    assert all(p["checked"] == 5 and p["violations"] == 0 for p in result["properties"])
