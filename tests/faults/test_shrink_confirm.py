"""Shrink on real runs: the final case is rerun and how often it reproduced is reported; a case
that did not reproduce every time is marked flaky, down to the campaign cell written for it.

The runs are real (a one-rank crash, a few requests). To make a real case flaky on demand, one
confirmation run is made without its fault, so that run really ends healthy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import app
from faults.campaign.cells import DiagnosedRun, run_and_diagnose
from faults.campaign.replay import TrialRecord, load_case, run_trial
from faults.campaign.shrink import shrink, shrink_bundle, write_cell_spec
from hicache_runtime.config import RuntimeConfig
from tests.helpers import small_config

CRASH = "crash:point=scheduler.step,step=3"


@pytest.fixture
def crash_bundle(bundle_root: Path) -> Path:
    from faults.spec import parse_faults

    cfg = small_config(**{"workload.requests": 4, "faults": parse_faults([CRASH])})
    obs = run_and_diagnose(cfg, warm=False, compare=True, bundle_root=bundle_root)
    assert obs.outcome == "crash", obs
    assert obs.bundle
    return Path(obs.bundle)


def test_a_real_case_failing_one_confirmation_run_is_flaky_and_so_is_its_cell(
        crash_bundle: Path, tmp_path: Path) -> None:
    case, _ = load_case(crash_bundle)

    def trial(cfg: RuntimeConfig, change: str) -> tuple[TrialRecord, DiagnosedRun]:
        if change == "confirm 2/3":
            cfg = cfg.with_overrides(faults=())  # this run really does not crash
        return run_trial(case, cfg, work=tmp_path / "w", bundle_root=tmp_path / "b",
                         change=change)

    first, obs = trial(case.cfg, "replay")
    assert first.reproduced
    result = shrink(case, first, obs, trial=trial, max_runs=1, confirm=3)
    assert (result.confirmed, result.confirm_runs, result.flaky) == (2, 3, True)
    assert [t.reproduced for t in result.trials if t.confirm] == [True, False, True]

    path = write_cell_spec(tmp_path / "cell.yaml", case, result, origin="test")
    text = path.read_text()
    assert text.startswith("# flaky: reproduced 2/3 confirmation runs")
    spec = yaml.safe_load(text)
    assert spec["name"].endswith("-flaky")
    assert "reproduced 2/3" in spec["description"]
    assert spec["cells"][0]["faults"] == result.shrunk.faults


def test_a_real_deterministic_case_is_confirmed_through_the_cli(
        crash_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "shrunk"
    res = CliRunner().invoke(app, ["inject", "--replay", str(crash_bundle), "--shrink",
                                   "--max-runs", "1", "--confirm", "2", "--out", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output
    result = json.loads(res.output[res.output.index("{"):])
    assert (result["confirmed"], result["confirm_runs"], result["flaky"]) == (2, 2, False)
    assert result["runs"] == 3
    cell = out / "cell.yaml"
    assert cell.read_text().startswith("# reproduced 2/2 confirmation runs\n")
    assert not yaml.safe_load(cell.read_text())["name"].endswith("-flaky")


def test_shrink_bundle_confirms_by_default(crash_bundle: Path, tmp_path: Path) -> None:
    result = shrink_bundle(crash_bundle, tmp_path / "s", max_runs=1)
    assert (result.confirmed, result.confirm_runs, result.flaky) == (3, 3, False)


def test_shrink_shows_each_run_as_it_ends(crash_bundle: Path, tmp_path: Path) -> None:
    """inject --shrink used to show nothing until its final table: each run is now one line
    on stderr as it ends (stdout stays the result)."""
    res = CliRunner().invoke(app, ["inject", "--replay", str(crash_bundle), "--shrink",
                                   "--max-runs", "2", "--confirm", "1",
                                   "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    steps = [ln for ln in res.stderr.splitlines() if ln.startswith("run ")]
    assert steps[0].startswith("run 1/3 replay: same failure"), res.stderr
    assert len(steps) == 3, res.stderr
    assert "confirm 1/1" in steps[-1]
    assert "run 1/" not in res.stdout


def test_shrink_reports_every_run_to_its_hook(crash_bundle: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    result = shrink_bundle(crash_bundle, tmp_path / "s", max_runs=2, confirm=1,
                           on_trial=lambda t, n, total: seen.append((t.change, n, total)))
    assert [n for _, n, _ in seen] == list(range(1, result.runs + 1))
    assert {total for _, _, total in seen} == {3}
