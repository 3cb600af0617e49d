"""A disk that fills while a crash bundle is written: the run still ends with its summary and
the exit status of its failure (not 2, the usage-error code, with a 4 KB shutil.Error), says
why there is no bundle, and leaves no folder without a manifest that would pass for one.

The full disk is a real one: an 8 KiB tmpfs mounted for the test (root, as CI runs); where
mounting is not allowed the test skips and says so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


#: A wrong-output run on one rank (the sum-hit-pages cell): its bundle is written by the
#: output judge, not by a rank's crash handler. Its L3 is warmed first, off the full disk.
WRONG_OUTPUT = ["--requests", "24", "--device-tokens", "512", "--host-tokens", "768",
                "--sidecar-pools", "all_pages", "--storage", "file"]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "outcome"), [
    (["--tp", "2", "--fault", "crash:rank=1,point=scheduler.step,step=3"], "crash"),
    (["--fault", "crash:point=scheduler.step,step=3"], "crash"),
    (["--dp", "2", "--fault", "crash:point=scheduler.step,step=3"], "crash"),
    ([*WRONG_OUTPUT, "--legacy", "sum-hit-pages", "--fault",
      "storage-shortfall:mode=holes,pages=1,at=1,pool=sidecar"], "wrong-output"),
], ids=["tp2", "one-rank", "dp2", "wrong-output"])
def test_a_full_disk_leaves_the_summary_and_no_half_bundle(
        full_disk: Path, tmp_path: Path, args: list[str], outcome: str) -> None:
    """Every bundle writer: a rank's (one rank, TP), the DP controller's, and the output
    judge's for a wrong answer."""
    hicache = Path(sys.executable).with_name("hicache")
    if outcome == "wrong-output":
        args = [*args, "--storage-path", str(tmp_path / "l3")]
        warm = subprocess.run([str(hicache), "run", *WRONG_OUTPUT, "--storage-path",
                               str(tmp_path / "l3"), "--json"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, check=False)
        assert json.loads(warm.stdout)["outcome"] == "healthy", warm.stderr[-2000:]
    else:
        args = ["--requests", "8", *args]
    proc = subprocess.run([str(hicache), "run", *args, "--bundle-dir",
                           str(full_disk / "bundles"), "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the run failed: unhealthy, not usage
    summary = json.loads(proc.stdout)
    assert summary["outcome"] == outcome
    assert summary["bundle"] is None
    assert "No space left on device" in summary["bundle_error"]
    assert len(summary["bundle_error"]) < 300
    left = list((full_disk / "bundles").rglob("*"))
    assert left == [], f"half-written bundle left behind: {left[:5]}"
    assert "Traceback" not in proc.stderr
