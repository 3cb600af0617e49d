"""The rank entry point runs under torchrun (env:// rendezvous) just as under the built-in
launcher, and a failure still leaves a complete bundle (rank 0 writes the manifest)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from hicache_runtime.contracts.bundle import RunOutcome, load_manifest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _torchrun(run_dir: Path, extra: list[str]) -> subprocess.CompletedProcess[str]:
    res = CliRunner().invoke(app, ["run", "--tp", "2", "--requests", "12",
                                   "--device-tokens", "512", "--protocol-timeout", "4",
                                   "--torchrun-dir", str(run_dir), *extra])
    assert res.exit_code == 0, res.output
    cmd = res.stdout.strip().split()
    assert cmd[0] == "torchrun"
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    return subprocess.run([torchrun, "--standalone", *cmd[1:]], capture_output=True, text=True,
                          timeout=300, check=False)


def test_healthy_under_torchrun(tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, [])
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads((tmp_path / f"rank{r}.result.json").read_text()) for r in (0, 1)]
    assert all(r["outcome"] == "healthy" for r in results)
    assert results[0]["requests"] == results[1]["requests"], "TP ranks agree on every output"


def test_failure_under_torchrun_leaves_a_bundle(tmp_path: Path) -> None:
    proc = _torchrun(tmp_path, ["--fault", "crash:rank=1,point=model.forward,step=6"])
    assert proc.returncode != 0
    manifest = load_manifest(tmp_path / "bundle")
    assert manifest.outcome is RunOutcome.CRASH
    assert {e.rank for e in manifest.ranks if e.files.stacks} == {0, 1}
    culprit = next(e for e in manifest.ranks if e.rank == 1)
    assert culprit.error is not None
    assert culprit.error.startswith("InjectedFault")
