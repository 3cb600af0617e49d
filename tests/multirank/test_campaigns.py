"""The built-in campaign end to end, and replay/shrink of a multi-rank bundle."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from faults.campaign.cells import run_campaign
from faults.campaign.plan import load_campaign
from tests.readme_blocks import readme_block, readme_line, run_line

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_default_campaign_every_cell_behaves(tmp_path: Path) -> None:
    """Every legacy switch shows its signature (named by the doctor from the bundle) under its
    fault; every fixed twin stays healthy with outputs identical to the cache-disabled run.
    Run as the README's main job is written (the last command of its first line), in one
    process, where cells share their cache-disabled references and warm-ups. (The README's
    CI-shard lines run the same cells in two processes that reuse none of each other's, 0 in
    either shard when tried: tests/faults/test_shards.py checks sharding on a smaller
    campaign.)"""
    main_job = readme_block("python3 -m venv .venv && . .venv/bin/activate && pip install "
                            "-c constraints/cpu.txt -e '.[runtime,capture]'")[0].split(" && ")[-1]
    assert main_job == readme_line("hicache campaign") == "hicache campaign"
    proc = run_line(main_job, tmp_path, timeout=1500)
    # the cells that failed first: pytest cuts a long message, and the table comes before them
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAIL ")]
    assert proc.returncode == 0, (failed, proc.stdout[-3000:], proc.stderr[-2000:])
    n = len(load_campaign().expand())
    assert f"{n} of {n} cells behaved as expected" in proc.stdout, proc.stdout[-4000:]
    assert list((tmp_path / "hicache-bundles").iterdir())  # the signature cells' bundles


def test_replay_and_shrink_a_pipeline_crash(tmp_path: Path) -> None:
    """The README's replay, shrink and regression-cell lines, as written, on a crash that
    needs no race: host allocations fail on stage 1, so it skips its writing check and its
    loading check pops the write count stage 0 sent for the other (0.5.13's skip-empty-sync).
    With a racy cell (local-ack-drain's dma-lag) the smaller candidate now and then missed
    under load, and the shrink with it."""
    first = run_campaign(load_campaign(), bundle_root=tmp_path / "hicache-bundles",
                         only="pp2/skip-empty-sync/*").cells[0]
    assert first.passed, first.detail
    bundle = Path(first.bundle or "")

    def sh(line: str) -> subprocess.CompletedProcess[str]:
        line = line.replace("<bundle>", bundle.name)
        proc = run_line(line, tmp_path, timeout=900)
        assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-3000:])
        return proc

    again = sh(readme_line("hicache inject --replay hicache-bundles/<bundle>"))
    assert first.verdict in " ".join(again.stdout.split()), again.stdout  # exit 0: the same
    shrunk = " ".join(sh(readme_line("hicache inject --replay hicache-bundles/<bundle> "
                                     "--shrink")).stdout.split())
    assert first.verdict in shrunk, shrunk
    cell = tmp_path / "shrunk" / "cell.yaml"
    # halving the 48 requests keeps the crash: every host allocation on stage 1 fails
    requests = int(re.search(r"workload\.requests: (\d+)", cell.read_text()).group(1))
    assert requests < 48, cell.read_text()
    regression = sh(readme_line("hicache campaign shrunk/cell.yaml")).stdout
    assert "1 of 1 cells behaved as expected" in " ".join(regression.split()), regression
