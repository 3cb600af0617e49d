"""The built-in campaign end to end, and replay/shrink of a multi-rank bundle."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from faults.campaign.cells import run_campaign
from faults.campaign.plan import load_campaign
from faults.campaign.replay import replay
from faults.campaign.shrink import shrink_bundle
from tests.readme_blocks import bash_env, readme_block

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_default_campaign_every_cell_behaves(tmp_path: Path) -> None:
    """Every legacy switch shows its signature (named by the doctor from the bundle) under its
    fault; every fixed twin stays healthy with outputs identical to the cache-disabled run.
    Run as the README's main job is written (the last command of its first line), in one
    process, where cells share their cache-disabled references and warm-ups. (The README's
    CI-shard lines run the same cells in two processes that reuse none of each other's, 0 in
    either shard when tried: tests/faults/test_shards.py checks sharding on a smaller
    campaign.)"""
    main_job = readme_block("python3 -m venv .venv")[0].split(" && ")[-1]
    assert main_job == "hicache campaign"
    proc = subprocess.run(["bash", "-c", main_job], cwd=tmp_path, env=bash_env(),
                          capture_output=True, text=True, timeout=1500, check=False)
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-3000:])
    n = len(load_campaign().expand())
    assert f"{n} of {n} cells behaved as expected" in proc.stdout, proc.stdout[-4000:]
    assert list((tmp_path / "hicache-bundles").iterdir())  # the signature cells' bundles


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
