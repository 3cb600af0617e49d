"""The signature catalog: every SPEC id, valid data, sound cross-references, reachable scores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from faults.spec import parse_fault
from hicache_runtime.contracts.legacy import LegacySwitch
from signatures.fact_names import Fact
from signatures.loader import load_catalog
from signatures.models import Catalog, Signature

SPEC_IDS = [
    "write-ack-pop-empty", "collective-order-deadlock", "prefix-length-mismatch",
    "collective-shape-mismatch", "prefetch-gap-overcount", "prefetch-abort-ack-starvation",
    "pp-sync-send-leak", "host-capacity-divergence", "lru-clock-divergence",
    "prefetch-reservation-leak", "prefetch-abort-use-after-free", "host-pool-exhausted",
    "host-memory-growth", "storage-backend-failure", "rank-divergence-detected",
    "tree-invariant-violation",
]
CATALOG_DIR = Path(__file__).resolve().parents[2] / "signatures" / "catalog"


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def test_every_spec_id_is_in_the_catalog_in_order(catalog: Catalog) -> None:
    assert [s.id for s in catalog.signatures] == SPEC_IDS
    assert re.fullmatch(r"\d+\.\d+\.\d+", catalog.version)


def test_unknown_id_lists_the_known_ones(catalog: Catalog) -> None:
    with pytest.raises(KeyError, match="write-ack-pop-empty"):
        catalog.get("no-such-signature")


@pytest.mark.parametrize("sig_id", SPEC_IDS)
def test_entry_is_complete(catalog: Catalog, sig_id: str) -> None:
    sig = catalog.get(sig_id)
    assert sig.title
    assert sig.meaning.strip()
    assert sig.root_cause.strip()
    assert sig.upstream_fix
    assert all(f.ref.startswith("sgl-project/sglang#") for f in sig.upstream_fix)
    assert sig.mitigations
    assert sig.runbook.confirm
    assert sig.runbook.diagnosis_path
    assert sig.recognisers.stack_shape
    assert sig.recognisers.trace_evidence


@pytest.mark.parametrize("sig_id", SPEC_IDS)
def test_can_be_named_only_with_structure(catalog: Catalog, sig_id: str) -> None:
    """The threshold is reachable, and not by exception messages alone."""
    sig = catalog.get(sig_id)
    structural, messages = _max_weights(sig, catalog)
    assert structural > 0, "needs at least one structural recogniser"
    assert structural + messages >= sig.threshold
    assert messages < sig.threshold, "a message alone must never reach the threshold"


def _max_weights(sig: Signature, catalog: Catalog) -> tuple[float, float]:
    rec = sig.recognisers
    outcome = {Fact.HANG, Fact.CRASH, Fact.WRONG_OUTPUT, Fact.OOM_KILLED}
    structural = sum(f.weight for f in rec.facts if f.weight > 0 and f.fact not in outcome)
    structural += sum(leg.weight for leg in rec.legacy)
    structural += rec.frames.weight if rec.frames else 0
    structural += sum(lg.weight for lg in rec.logs
                      if lg.weight > 0 and catalog.pattern(lg.pattern).specific)
    messages = sum(e.weight for e in rec.exceptions)
    messages += sum(lg.weight for lg in rec.logs
                    if lg.weight > 0 and not catalog.pattern(lg.pattern).specific)
    messages += sum(f.weight for f in rec.facts if f.weight > 0 and f.fact in outcome)
    return structural, messages


WITH_CELLS = [s.id for s in load_catalog().signatures if s.campaign is not None]


@pytest.mark.parametrize("sig_id", WITH_CELLS)
def test_campaign_cell_parses(catalog: Catalog, sig_id: str) -> None:
    sig = catalog.get(sig_id)
    assert sig.campaign is not None
    topo, legacy, fault = sig.campaign.parts
    assert re.fullmatch(r"(tp\d+)?(pp\d+)?", topo)
    assert legacy == "fixed" or LegacySwitch(legacy)
    if fault != "none":
        parse_fault(fault)
    assert sig.campaign.expect == sig_id
    assert sig.campaign.run_command() == f"hicache campaign --only '{sig.campaign.cell}'"
    assert "/fixed/" in sig.campaign.run_command(fixed=True)


@pytest.mark.parametrize("sig_id", WITH_CELLS)
def test_campaign_cell_is_a_default_campaign_cell(catalog: Catalog, sig_id: str) -> None:
    """The cell a signature cites exists in the built-in campaign and expects that signature;
    its fixed twin exists too and expects a healthy run."""
    from faults.campaign.plan import load_campaign

    cells = {c.id: c for c in load_campaign().expand()}
    sig = catalog.get(sig_id)
    assert sig.campaign is not None
    assert sig.campaign.cell in cells, sorted(cells)
    assert sig_id in cells[sig.campaign.cell].expected
    assert cells[sig.campaign.fixed_twin].expected == {"healthy"}


def test_every_legacy_switch_has_its_signature(catalog: Catalog) -> None:
    covered = {leg.switch for s in catalog.signatures for leg in s.recognisers.legacy}
    assert covered == {s.value for s in LegacySwitch}


def test_patterns_match_their_examples_and_triggers(catalog: Catalog) -> None:
    for p in catalog.patterns:
        for example in p.examples:
            assert any(t in example for t in p.triggers), (p.id, example)
            assert re.search(p.regex, example), (p.id, example)
        assert all(len(t) >= 2 for t in p.triggers), p.id


def test_yaml_has_no_plain_scalar_cut_by_a_comment() -> None:
    """`text: fixed in #123` silently loads as `fixed in`: such values must be quoted."""
    for path in CATALOG_DIR.glob("*.yaml"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r"^\s*(?:- )?[a-z_]+: ([^'\"|>].*)$", line)
            assert not (m and " #" in m.group(1)), f"{path.name}:{n}: quote this value"


def test_catalog_files_are_plain_yaml_mappings() -> None:
    for path in CATALOG_DIR.glob("*.yaml"):
        assert isinstance(yaml.safe_load(path.read_text()), dict), path.name


def test_every_fact_describes_itself() -> None:
    for fact in Fact:
        assert fact.describe(), fact
        assert fact.describe() != fact.value, fact


def test_broken_catalog_is_reported_with_its_file(tmp_path: Path) -> None:
    from hicache_runtime.contracts.errors import ConfigError

    for f in CATALOG_DIR.glob("*.yaml"):
        (tmp_path / f.name).write_text(f.read_text())
    bad = tmp_path / "collective-order-deadlock.yaml"
    bad.write_text(bad.read_text().replace("pattern: gloo-timeout", "pattern: no-such-pattern"))
    with pytest.raises(ConfigError, match="no-such-pattern"):
        load_catalog(tmp_path)
