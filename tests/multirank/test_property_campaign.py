"""The property campaign (faults/campaigns/properties.yaml), one seed: every survivable fault
on every topology it applies to, fixed protocols, and no crash, hang, wrong token or leaked
page anywhere. The five-seed run is the same spec without ``seeds``."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from faults.campaign.cells import run_campaign
from faults.campaign.plan import Property, load_campaign
from faults.campaign.reports import junit_xml

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

SPEC = Path(__file__).resolve().parents[2] / "faults" / "campaigns" / "properties.yaml"


def test_every_property_holds_under_every_fault_one_seed(bundle_root: Path) -> None:
    spec = load_campaign(SPEC)
    result = run_campaign(spec, bundle_root=bundle_root, seeds=[0])
    cells = result.cells
    assert len(cells) * 5 == len(spec.expand())
    violated = {p.property: [f"{v.cell}: {v.detail} ({v.bundle})" for v in p.violating]
                for p in result.properties if not p.holds}
    assert not violated, violated
    failed = {c.id: f"{c.detail} {c.error or ''}" for c in cells if not c.passed}
    assert not failed, failed
    # Every property was read in every cell: outputs compared, every rank drained.
    assert [p.property for p in result.properties] == [p.value for p in Property]
    assert all(p.checked == len(cells) for p in result.properties), result.properties
    assert all(c.leaked_pages == 0 for c in cells)
    # A fault that never fired would leave its cell healthy while testing nothing.
    assert [c.id for c in cells if c.faults_fired == 0] == []
    # Cells share their cache-disabled references and their warm-ups.
    assert result.references_reused > 0
    assert result.warmups_reused > 0
    root = ET.fromstring(junit_xml(result))
    assert root.attrib["failures"] == "0"
