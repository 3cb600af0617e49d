"""Release data in the catalog and the doctor's use of it: ``affected.yaml`` as a release
matrix writes it, attached by the loader, printed in runbooks, and a verdict weakened when the
input states a release on whose profile the signature's fault ran clean."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from doctor.diagnose import diagnose
from doctor.report.releases import CLEAN_FACTOR, profile_for
from doctor.report.runbook import signature_runbook
from hicache_runtime.contracts.errors import ConfigError
from signatures.loader import load_catalog
from tests.doctor.conftest import FIXTURES

CATALOG = Path(__file__).resolve().parents[2] / "signatures" / "catalog"
LOG = FIXTURES / "write-ack-pop-empty" / "sglang-pp2-classic" / "server.log"
PROFILES = ["sglang-0.5.13", "sglang-0.5.16", "sglang-0.5.20", "sglang-0.5.23"]


def _catalog_with(tmp_path: Path, entry: dict[str, object]) -> Path:
    root = tmp_path / "catalog"
    shutil.copytree(CATALOG, root)
    (root / "affected.yaml").write_text(yaml.safe_dump({
        "campaign": "default", "command": "hicache campaign --profiles " + ",".join(PROFILES),
        "run_at": "2026-12-01T00:00:00+00:00", "profiles": PROFILES,
        "signatures": {"write-ack-pop-empty": entry}}))
    return root


def test_a_stated_version_maps_to_its_profile_or_the_nearest_release_below() -> None:
    assert profile_for("0.5.23", PROFILES) == ("sglang-0.5.23", True)
    assert profile_for("v0.5.21", PROFILES) == ("sglang-0.5.20", False)
    assert profile_for("0.5.13.post1", PROFILES) == ("sglang-0.5.13", True)
    assert profile_for("0.5.5", PROFILES) is None  # older than every release the matrix ran
    assert profile_for("0.6.0", PROFILES) is None  # newer: nothing is known of it
    assert profile_for("main", PROFILES) is None


def test_the_loader_attaches_release_data_and_the_runbook_names_the_first_clean_release(
        tmp_path: Path) -> None:
    root = _catalog_with(tmp_path, {
        "reproduces": ["sglang-0.5.13"], "row": "pp2 host-alloc-fail:pp=1",
        "clean": ["sglang-0.5.16", "sglang-0.5.20"], "cells": []})
    sig = load_catalog(root).get("write-ack-pop-empty")
    assert sig.affected is not None
    assert sig.affected.reproduces == ["sglang-0.5.13"]
    assert sig.affected.no_longer_from(PROFILES) == "sglang-0.5.16"
    book = signature_runbook(sig)
    assert "## Releases" in book
    assert "It no longer reproduces from `sglang-0.5.16` on." in book
    assert load_catalog(root).get("prefix-length-mismatch").affected is None


def test_a_signature_file_may_not_carry_release_data(tmp_path: Path) -> None:
    root = _catalog_with(tmp_path, {"reproduces": [], "row": None, "clean": [], "cells": []})
    path = root / "write-ack-pop-empty.yaml"
    path.write_text(path.read_text() + "\naffected: {}\n")
    with pytest.raises(ConfigError, match="generated"):
        load_catalog(root)


def test_a_verdict_whose_fault_ran_clean_on_the_stated_release_loses_confidence(
        tmp_path: Path) -> None:
    plain = diagnose([str(LOG)])
    assert plain.verdicts[0].signature == "write-ack-pop-empty"
    stated = tmp_path / "server.log"
    stated.write_text("sglang==0.5.23\n" + LOG.read_text())
    clean = load_catalog(_catalog_with(tmp_path, {
        "reproduces": ["sglang-0.5.13"], "row": "pp2 host-alloc-fail:pp=1",
        "clean": ["sglang-0.5.20", "sglang-0.5.23"], "cells": []}))
    d = diagnose([str(stated)], catalog=clean)
    v = next(v for v in d.verdicts if v.signature == "write-ack-pop-empty")
    base = next(v for v in plain.verdicts if v.signature == "write-ack-pop-empty")
    assert v.confidence == round(base.confidence * CLEAN_FACTOR, 2)
    assert "sglang 0.5.23" in v.release_note
    assert "clean on sglang-0.5.23" in v.release_note
    # the same input on a release where it reproduced keeps its confidence
    older = tmp_path / "older.log"
    older.write_text("sglang==0.5.13\n" + LOG.read_text())
    kept = next(v for v in diagnose([str(older)], catalog=clean).verdicts
                if v.signature == "write-ack-pop-empty")
    assert kept.confidence == base.confidence
    assert kept.release_note == ""
