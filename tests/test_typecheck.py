"""The code base type-checks with mypy at the strictness ``pyproject.toml`` sets per layer
(run as a test so CI enforces it, like ruff)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_clean(tmp_path: Path) -> None:
    mypy = shutil.which("mypy") or str(Path(sys.executable).with_name("mypy"))
    if not Path(mypy).exists():
        pytest.skip("mypy is not installed (install the dev extra)")
    res = subprocess.run([mypy, "--cache-dir", str(tmp_path / "cache"), "--no-color-output"],
                         cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
