"""Triage runs where torch is not installed (a laptop, a support machine): the doctor, the
catalog and runbooks import nothing that needs it, and name the same signatures as here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "doctor"

_BLOCK_TORCH = """\
import importlib.abc, sys

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def _no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose interpreters cannot import torch (sitecustomize runs before
    anything else)."""
    site = tmp_path / "no_torch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_BLOCK_TORCH)
    return {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "TERMINAL_WIDTH": "120",
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``hicache ARGS`` in an interpreter where importing torch fails."""
    return subprocess.run([sys.executable, str(ROOT / "cli.py"), *args], cwd=ROOT,
                          env=_no_torch_env(tmp_path), capture_output=True, text=True,
                          timeout=120, check=False)


_DOCTOR_EACH = """\
import json, sys
from typer.testing import CliRunner
from cli import app

runner, out = CliRunner(), {}
for case in sys.argv[1:]:
    res = runner.invoke(app, ["doctor", "--json", case])
    out[case] = {"exit": res.exit_code, "stdout": res.stdout,
                 "error": repr(res.exception) if res.exit_code not in (0, 1) else ""}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """``hicache doctor --json`` on every case, in one interpreter where importing torch
    fails (one start-up and one index load, not one per case)."""
    env = _no_torch_env(tmp_path_factory.mktemp("doctor_each"))
    proc = subprocess.run([sys.executable, "-c", _DOCTOR_EACH, *map(str, _cases())], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ModuleNotFoundError" not in proc.stderr, proc.stderr[-2000:]
    result: dict[str, dict[str, object]] = json.loads(proc.stdout)
    return result


def _cases() -> list[Path]:
    """One case per expected signature folder (bundles, logs, FR dumps), plus no-fit."""
    return sorted(next(iter(sorted(p for p in d.iterdir() if not p.name.startswith("."))))
                  for d in FIXTURES.iterdir() if d.is_dir())


def test_torch_is_really_blocked(tmp_path: Path) -> None:
    res = _cli(tmp_path, "run", "--requests", "1")
    assert res.returncode != 0
    assert "torch" in res.stdout + res.stderr


@pytest.mark.parametrize("case", _cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_doctor_names_the_same_signature_without_torch(
        without_torch: dict[str, dict[str, object]], case: Path) -> None:
    without = without_torch[str(case)]
    assert without["exit"] in (0, 1), without["error"]
    # in this interpreter: with torch where the session has it
    with_torch = CliRunner().invoke(app, ["doctor", "--json", str(case)])

    def named(stdout: str) -> tuple[str, list[object]]:
        d = json.loads(stdout)
        return d["status"], [(v["signature"], v["confidence"]) for v in d["verdicts"][:1]]

    assert named(str(without["stdout"])) == named(with_torch.stdout)


def test_signatures_and_runbooks_without_torch(tmp_path: Path) -> None:
    listing = _cli(tmp_path, "signatures", "list")
    assert listing.returncode == 0, listing.stderr[-2000:]
    assert "write-ack-pop-empty" in listing.stdout
    book = _cli(tmp_path, "runbook", "-s", "write-ack-pop-empty", "-o", str(tmp_path / "rb"))
    assert book.returncode == 0, book.stderr[-2000:]
    assert list((tmp_path / "rb").iterdir())
