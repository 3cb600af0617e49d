"""One grammar for campaign cell ids (``hicache_runtime.contracts.legacy.py``): every id a
campaign writes reads back into the parts it was made of, and the catalog reads cells with
several switches, seeds and a ``/`` inside a fault as the campaign writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults.campaign.plan import cell_id, load_campaign
from hicache_runtime.contracts.legacy import CellId, parse_cell_id
from signatures.models import CampaignCell, cell_not_a_release

SPECS = Path(__file__).resolve().parents[1] / "faults" / "campaigns"


@pytest.mark.parametrize("spec", [None, SPECS / "properties.yaml"], ids=["default", "properties"])
def test_every_campaign_id_reads_back_into_its_parts(spec: Path | None) -> None:
    cells = load_campaign(spec).expand()
    assert cells
    for c in cells:
        parsed = parse_cell_id(c.id)
        assert parsed is not None, c.id
        assert str(parsed) == c.id
        assert parsed.switches == tuple(sorted(c.legacy))
        assert parsed.seed == c.seed or (parsed.seed is None and not c.seed), c.id


def test_several_switches_a_seed_and_a_slash_in_a_fault() -> None:
    text = cell_id(2, 2, ["sum-hit-pages", "abort-frees-in-flight"],
                   ["mid-prefetch-abort:rid=req/1*,batch=0"], seed=3)
    assert text == ("tp2pp2/abort-frees-in-flight+sum-hit-pages/"
                    "mid-prefetch-abort:rid=req/1*,batch=0/seed3")
    assert parse_cell_id(text) == CellId("tp2pp2", ("abort-frees-in-flight", "sum-hit-pages"),
                                         "mid-prefetch-abort:rid=req/1*,batch=0", 3)
    cell = CampaignCell(cell=text, expect="healthy")
    assert cell.parts == ("tp2pp2", "abort-frees-in-flight+sum-hit-pages",
                          "mid-prefetch-abort:rid=req/1*,batch=0")
    assert cell.fixed_twin == "tp2pp2/fixed/mid-prefetch-abort:rid=req/1*,batch=0/seed3"


def test_each_synthetic_switch_of_a_cell_is_named() -> None:
    """Every switch of a combined cell is looked up (the old grammar took one switch only and
    read a combined cell as no cell at all)."""
    both = cell_not_a_release("tp2/sum-hit-pages+wallclock-lru/none")
    assert set(both) == {"sum-hit-pages", "wallclock-lru"}
    assert cell_not_a_release("tp2/fixed/none") == {}


@pytest.mark.parametrize("text", [
    "tp2", "tp2/fixed", "tp2/fixed/", "x2/fixed/none", "tp2/Fixed/none", "tp2/b+a/none",
    "tp2/fixed+a/none", "tp2/fixed/dma lag", "/fixed/none",
])
def test_what_is_no_cell_id(text: str) -> None:
    assert parse_cell_id(text) is None
