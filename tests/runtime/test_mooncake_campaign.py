"""The Mooncake campaign (``faults/campaigns/mooncake.yaml``), how a campaign skips cells whose
L3 backend this machine cannot run (with the reason, neither passed nor failed), and what a
replay of a Mooncake bundle runs against."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from importlib import resources
from pathlib import Path

import pytest

from faults.campaign.cells import run_campaign
from faults.campaign.plan import CampaignSpec, CellSpec, load_campaign
from faults.campaign.replay_guard import guard_config
from faults.campaign.reports import junit_xml, markdown
from hicache_runtime.config import StorageConfig
from hicache_runtime.contracts import l3_backends
from hicache_runtime.l3.backends import mooncake_client as mc
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.registry import unavailable

ABSENT = "the absent client is not installed (pip install absent-client)"


class AbsentClientBackend(FileBackend):
    """A backend whose client library this machine lacks (as Mooncake's may be)."""

    name = "absent-client"

    @staticmethod
    def unavailable(cfg: StorageConfig) -> str | None:
        return ABSENT


def mooncake_campaign() -> CampaignSpec:
    return load_campaign(Path(str(resources.files("faults.campaigns") / "mooncake.yaml")))


def test_cells_of_a_backend_this_machine_lacks_are_skipped(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Registered for this test only (the registry has no public way to forget a name).
    monkeypatch.setitem(l3_backends._registered, "absent-client",
                        f"{__name__}:AbsentClientBackend")
    spec = CampaignSpec(name="absent", defaults={"storage.backend": "absent-client",
                                                 "workload.requests": 4},
                        cells=[CellSpec(id="a/tp1"), CellSpec(id="a/pp2", pp=2, warm=True)])
    result = run_campaign(spec, bundle_root=tmp_path / "bundles")
    assert (result.passed, result.failed, result.skipped) == (0, 0, 2)
    assert all(c.skipped == ABSENT and c.outcome == "skipped" for c in result.cells)
    assert not (tmp_path / "bundles").exists()  # nothing ran
    suite = ET.fromstring(junit_xml(result))
    assert (suite.get("skipped"), suite.get("failures")) == ("2", "0")
    assert [e.get("message") for e in suite.iter("skipped")] == [ABSENT, ABSENT]
    assert "2 skipped on this machine" in markdown(result)


def test_mooncake_cells_need_the_client_and_say_why() -> None:
    cfg = StorageConfig(backend="mooncake")
    why = unavailable(cfg)
    assert why is None if mc.mooncake_installed() else "Mooncake client" in (why or "")
    spec = mooncake_campaign()
    cells = spec.expand()
    assert len(cells) == 6
    assert {c.expect for c in cells} == {"healthy", "prefix-length-mismatch|write-ack-pop-empty",
                                         "prefetch-abort-ack-starvation"}
    assert spec.defaults["storage.backend"] == "mooncake"


@pytest.mark.slow
@pytest.mark.multiproc
def test_mooncake_campaign_behaves_as_expected(tmp_path: Path) -> None:
    """The cells under a fault, each on a private Mooncake store (the two legacy switches and
    their fixed twins); a machine without the client skips them all. The two fault-free cells
    are what test_l3_mooncake.py runs at the same topologies (tp1, tp2 x pp2), so CI does not
    pay for them twice (``hicache campaign faults/campaigns/mooncake.yaml`` runs all six)."""
    result = run_campaign(mooncake_campaign(), bundle_root=tmp_path / "bundles",
                          only="mooncake/*/*/*:*")
    assert len(result.cells) == 4
    if not mc.mooncake_installed():
        assert result.skipped == len(result.cells)
        return
    assert result.skipped == 0
    assert result.failed == 0, [(c.id, c.detail, c.error) for c in result.cells if not c.passed]


def test_replaying_a_mooncake_bundle_uses_a_file_store_or_the_given_master() -> None:
    url = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata"
    raw = {"storage": {"backend": "mooncake", "url": url}, "cache": {"host_tokens": 768}}
    plain = guard_config(raw)
    assert plain.cfg.storage.backend == "file"
    assert any("used a mooncake store at mooncake://127.0.0.1:50051" in n for n in plain.notes)
    given = guard_config(raw, storage_url=url.replace("50051", "50061"))
    assert (given.cfg.storage.backend, given.cfg.storage.url) == (
        "mooncake", url.replace("50051", "50061"))
    assert given.storage.startswith("mooncake at mooncake://127.0.0.1:50061")
