"""The built-in campaign end to end, and replay/shrink of a multi-rank bundle."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from faults.campaign.cells import run_campaign
from faults.campaign.plan import load_campaign
from faults.campaign.replay import replay
from faults.campaign.reports import junit_xml
from faults.campaign.shrink import shrink_bundle

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_default_campaign_every_cell_behaves(bundle_root: Path) -> None:
    """Every legacy switch shows its signature (named by the doctor from the bundle) under its
    fault; every fixed twin stays healthy with outputs identical to the cache-disabled run."""
    spec = load_campaign()
    result = run_campaign(spec, bundle_root=bundle_root)
    failed = {c.id: f"{c.detail} {c.error or ''}" for c in result.cells if not c.passed}
    assert not failed, failed
    assert len(result.cells) == len(spec.expand())
    root = ET.fromstring(junit_xml(result))
    assert root.attrib["failures"] == "0"


def test_replay_and_shrink_a_pipeline_crash(bundle_root: Path, tmp_path: Path) -> None:
    """A crash that needs no race: host allocations fail on stage 1, so it skips its writing
    check and its loading check pops the write count stage 0 sent for the other (0.5.13's
    skip-empty-sync). The test is about replay and shrink; with a racy cell (local-ack-drain's
    dma-lag) the smaller candidate now and then missed under load, and the shrink with it."""
    spec = load_campaign()
    first = run_campaign(spec, bundle_root=bundle_root, only="pp2/skip-empty-sync/*").cells[0]
    assert first.passed, first.detail
    bundle = Path(first.bundle or "")

    again = replay(bundle, work=tmp_path / "w", bundle_root=tmp_path / "rb")
    assert again.reproduced, again.trial
    assert again.signature == first.verdict

    shrunk = shrink_bundle(bundle, tmp_path / "shrunk", max_runs=3, confirm=2)
    assert shrunk.reproduced
    assert shrunk.runs == 3 + 2  # the search's budget, then the final case's confirmation
    assert shrunk.flaky == (shrunk.confirmed < 2)
    # halving the 48 requests keeps the crash: every host allocation on stage 1 fails
    assert shrunk.shrunk.requests < shrunk.original.requests
    assert (tmp_path / "shrunk" / "cell.yaml").exists()
