"""Every command the README shows is run by a test.

Tests name the README lines they run through ``tests/readme_blocks.py`` (``readme_line`` for a
line, ``readme_block`` for a whole block) with a literal argument; this module reads those
calls in the test sources and holds every bash line of the README to one of them, or to
``NOT_RUN`` with the reason. The cheap lines of the campaign block run here; the multi-rank
ones in ``tests/multirank`` and beside the suites they belong to.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from tests.readme_blocks import (
    ROOT,
    bash_env,
    command,
    narrowed,
    readme_blocks,
    readme_line,
    run_line,
)

#: README lines no test runs as written, each with why and what stands for it.
NOT_RUN = {
    "python -m signatures.mine":
        "needs the reader's git mirrors and source checkouts and downloads every release "
        "(112 s); tests/signatures/test_index.py rebuilds the committed index from a pinned "
        "sample with the miner's own code",
    "pip install -e '.[mooncake]'":
        "CI installs the extra through '.[dev]'; the Mooncake lines after it run in "
        "tests/runtime/test_l3_mooncake.py",
}


def _claims() -> tuple[set[str], set[str]]:
    """The literal arguments of every ``readme_line`` and ``readme_block`` call in the tests."""
    lines: set[str] = set()
    blocks: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            if name == "readme_line":
                lines.add(node.args[0].value)
            elif name == "readme_block":
                blocks.add(node.args[0].value)
    return lines, blocks


def test_every_readme_line_is_run_by_a_test() -> None:
    claimed_lines, claimed_blocks = _claims()
    every = [ln for block in readme_blocks() for ln in block]
    assert len(every) >= 50
    for prefix in claimed_lines:  # each claim names one line (readme_line asserts as much)
        readme_line(prefix)
    uncovered = []
    for block in readme_blocks():
        if any(block[0].startswith(first) for first in claimed_blocks):
            continue
        for ln in block:
            claimed = any(command(ln) == p or ln.startswith(p) for p in claimed_lines)
            if not claimed and not any(ln.startswith(p) for p in NOT_RUN):
                uncovered.append(ln)
    assert uncovered == [], "README lines no test runs"
    for prefix in NOT_RUN:  # a reason for a line the README no longer shows goes too
        assert sum(ln.startswith(prefix) for ln in every) == 1, prefix


def _hicache(line: str) -> list[str]:
    return shlex.split(line)[1:]


def test_campaign_list_as_written() -> None:
    res = CliRunner().invoke(app, _hicache(readme_line("hicache campaign --list")))
    assert res.exit_code == 0, res.output
    assert "campaign 24 cells" in res.output
    assert "pp2/unbounded-pp-sends/stage-lag:pp=1,ms=10" in res.output


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_readme_spec_runs_as_its_own_matrix(tmp_path: Path) -> None:
    """The README's example spec, saved as the line names it, on one fixed cell and its
    legacy twin: the fixed protocol survives the failed allocation, the switch deadlocks."""
    import re

    spec = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    (tmp_path / "my-campaign.yaml").write_text(spec)
    line = narrowed(readme_line("hicache campaign my-campaign.yaml"),
                    "tp2/*/host-alloc-fail:tp=1/seed0", tmp_path)
    proc = run_line(line, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    cells = {c["id"]: c for c in json.loads(proc.stdout)["cells"]}
    assert set(cells) == {"tp2/fixed/host-alloc-fail:tp=1/seed0",
                          "tp2/skip-empty-sync/host-alloc-fail:tp=1/seed0"}
    assert all(c["passed"] for c in cells.values()), cells
    assert cells["tp2/skip-empty-sync/host-alloc-fail:tp=1/seed0"]["observed"] == \
        "collective-order-deadlock"


@pytest.mark.slow
@pytest.mark.multiproc
def test_flake_hunting_seeds_as_written(tmp_path: Path) -> None:
    """Five seeds of the fixed cells, narrowed to the single-rank one: five runs, all
    healthy."""
    proc = run_line(narrowed(readme_line("hicache campaign --only '*/fixed/*' --seeds"),
                        "tp1/fixed/*") + " --json", tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    cells = json.loads(proc.stdout)["cells"]
    assert [c["id"].rsplit("/", 1)[1] for c in cells] == [f"seed{s}" for s in range(5)]
    assert all(c["passed"] and c["observed"] == "healthy" for c in cells)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_shard_lines_and_their_merge_as_written(tmp_path: Path) -> None:
    """The CI-shard lines on the single-rank cells: one cell per shard, merged into the run
    of both with its JUnit."""
    for line in (readme_line("hicache campaign --shard 1/2"),
                 readme_line("hicache campaign --shard 2/2")):
        proc = run_line(narrowed(line, "tp1/*"), tmp_path)
        assert proc.returncode == 0, (line, proc.stdout[-2000:], proc.stderr[-2000:])
    ran = [c["id"] for s in ("s1", "s2")
           for c in json.loads((tmp_path / f"{s}.json").read_text())["cells"]]
    assert len(ran) == 2
    proc = run_line(readme_line("hicache campaign merge"), tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    merged = json.loads((tmp_path / "all.json").read_text())
    assert sorted(c["id"] for c in merged["cells"]) == sorted(ran)
    assert all(c["passed"] for c in merged["cells"])
    assert (tmp_path / "all.xml").read_text().count("<testcase") == 2


def _log_ids(log: Path) -> list[str]:
    if not log.exists():
        return []
    out = []
    for text in log.read_text().splitlines():
        try:
            row = json.loads(text)
        except ValueError:
            continue  # a line cut off by the interrupt is dropped on resume
        if isinstance(row, dict) and "id" in row:
            out.append(row["id"])
    return out


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_nightly_line_resumes_where_it_was_stopped(tmp_path: Path) -> None:
    """The nightly line (narrowed to the single-rank fixed cell: 100 seeds), stopped with
    SIGINT after its first cell, then run again as the README says and stopped after one
    more: the second run keeps the first one's result and does not run that cell again.
    (tests/faults/test_resume.py runs a small campaign through to its end.)"""
    line = narrowed(readme_line("hicache campaign --seeds 0-99"), "tp1/fixed/*")
    log = tmp_path / "nightly.jsonl"
    for total in (1, 2):
        proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=tmp_path, env=bash_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        deadline = time.monotonic() + 300
        while len(_log_ids(log)) < total and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
        ids = _log_ids(log)
        assert len(ids) >= total, err[-2000:]
        assert len(ids) == len(set(ids)), ids  # no cell ran twice
    assert ids[:2] == [f"tp1/fixed/storage-shortfall:mode=holes,pages=1,at=1,pool=sidecar/"
                       f"seed{s}" for s in range(2)]
