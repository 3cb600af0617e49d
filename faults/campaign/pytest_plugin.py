"""The pytest plugin (entry point ``pytest11``: ``hicache``): campaign cells as test items, and
a fixture that runs a config with faults.

* ``pytest --hicache-campaign default`` (or a spec path; ``--hicache-only GLOB`` to select)
  adds one test item per campaign cell, its id ``hicache/<campaign>/<cell id>``: ``-k``, ``-x``,
  ``--junitxml`` and pytest-xdist's ``-n`` work as on any test. A cell passes as it does in
  ``hicache campaign``; a failure shows the doctor's verdict, the run's outcome and the bundle.
  ``--hicache-bundle-dir DIR`` keeps the bundles (default: under pytest's temporary directory).
* the ``hicache_run`` fixture runs a config (a mapping of dotted keys, as a config file
  holds) with fault specs and returns the typed :class:`RunSummary`; its bundles go under the
  test's temporary directory.

Nothing of the runtime (torch) is imported until a cell or a run starts, so having the plugin
installed costs a pytest session nothing.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from faults.campaign.cells import CellResult
    from faults.campaign.plan import CampaignSpec, CellSpec
    from hicache_runtime.launch.run import RunSummary

ROOT_NAME = "hicache"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hicache", "hicache-doctor campaign cells")
    group.addoption("--hicache-campaign", default=None, metavar="SPEC",
                    help="add the cells of this campaign as test items: 'default' (the "
                         "built-in campaign) or a spec file")
    group.addoption("--hicache-only", default=None, metavar="GLOB",
                    help="only the cells whose id matches this glob")
    group.addoption("--hicache-bundle-dir", default=None, metavar="DIR",
                    help="where the cells' crash bundles go (default: under pytest's "
                         "temporary directory, kept as long as pytest keeps it)")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -k/-m deselection, which then sees them
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    spec_arg = config.getoption("--hicache-campaign")
    if not spec_arg:
        return
    from faults.campaign.cells import select
    from faults.campaign.plan import load_campaign

    spec = load_campaign(None if spec_arg == "default" else Path(spec_arg))
    parent = CampaignCollector.from_parent(session, name=f"{ROOT_NAME}/{spec.name}")
    parent.spec = spec
    items.extend(CampaignCell.from_parent(parent, name=c.id, cell=c)
                 for c in select(spec, config.getoption("--hicache-only")))


class CampaignCollector(pytest.Collector):
    """The campaign the cells belong to (a node of the collection tree, not a file)."""

    spec: CampaignSpec

    def collect(self) -> list[pytest.Item]:  # the cells are made by the collection hook
        return []


class CellFailed(Exception):
    """A campaign cell that did not end as it had to."""

    def __init__(self, result: CellResult) -> None:
        super().__init__(result.detail)
        self.result = result


class CampaignCell(pytest.Item):
    """One campaign cell: runs it (its warm-up first) and judges it as the campaign does."""

    def __init__(self, *, cell: CellSpec, **kw: Any) -> None:
        super().__init__(**kw)
        self.cell = cell
        self.add_marker(pytest.mark.hicache_cell)

    def runtest(self) -> None:
        from faults.campaign.cells import run_cell

        parent = self.parent
        assert isinstance(parent, CampaignCollector)
        bundle_dir = self.config.getoption("--hicache-bundle-dir")
        # pytest's own base temporary directory: kept for the last few sessions (a failed
        # cell's bundle is still there to read), removed after, as every tmp_path is
        root = Path(bundle_dir) if bundle_dir else \
            self.config._tmp_path_factory.mktemp("hicache-bundles")  # type: ignore[attr-defined]
        with tempfile.TemporaryDirectory(prefix="hicache-cell-") as work:
            result = run_cell(parent.spec, self.cell, Path(work), root)
        self.user_properties.append(("observed", result.observed))
        if result.bundle:
            self.user_properties.append(("bundle", result.bundle))
        if result.skipped is not None:
            pytest.skip(result.skipped)
        if not result.passed:
            raise CellFailed(result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str:
        if isinstance(excinfo.value, CellFailed):
            r = excinfo.value.result
            lines = [f"campaign cell {r.id}: {r.detail}",
                     f"  expected: {r.expect}",
                     f"  observed: {r.observed} (outcome {r.outcome}"
                     + (f", the doctor names {r.verdict} at {r.confidence:.2f}"
                        if r.verdict and r.confidence is not None else "") + ")"]
            if r.error:
                lines.append(f"  error: {r.error}")
            if r.bundle:
                lines += [f"  bundle: {r.bundle}",
                          f"  hicache doctor {r.bundle}; hicache inject --replay {r.bundle}"]
            return "\n".join(lines)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[str, int | None, str]:
        return (f"{ROOT_NAME}/{self.cell.id}", None, f"campaign cell {self.cell.id}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "hicache_cell: a hicache campaign cell (the plugin)")


RunFn = Callable[..., "RunSummary"]


@pytest.fixture
def hicache_run(tmp_path: Path) -> RunFn:
    """``hicache_run(config, faults=[...], compare=True) -> RunSummary``: run ``config`` (dotted
    keys, e.g. ``{"topology.tp": 2, "profile": "sglang-0.5.23"}``) with the fault specs, its
    bundles under the test's temporary directory."""
    from faults.spec import parse_faults
    from hicache_runtime.config import check_run_limits, load_config
    from hicache_runtime.launch.run import run

    def go(config: Mapping[str, Any] | None = None, *, faults: list[str] | None = None,
           compare: bool = True) -> RunSummary:
        data = dict(config or {})
        if faults:
            data["faults"] = tuple(parse_faults(faults))
        cfg = load_config(data)
        check_run_limits(cfg)
        return run(cfg, compare=compare, bundle_root=tmp_path / "hicache-bundles")

    return go
