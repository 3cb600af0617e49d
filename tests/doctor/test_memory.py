"""Memory stays flat on large logs: peak RSS of the doctor does not grow with input size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = ("import json, sys\nfrom doctor.diagnose import diagnose\n"
         "from tests.doctor.hostile import own_peak_rss_mb\n"
         "d = diagnose([sys.argv[1]])\n"
         "print(json.dumps({'rss': own_peak_rss_mb(),"
         " 'verdict': d.verdicts[0].signature if d.verdicts else None}))")


def _peak_rss_mb(path: Path) -> tuple[float, str | None]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                         text=True, check=True, cwd=REPO, timeout=300)
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["rss"], data["verdict"]


@pytest.mark.slow
def test_peak_rss_is_flat_from_16_to_160_mb(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from doctor_throughput import generate

    generate(tmp_path / "small", 16)
    generate(tmp_path / "big", 160)
    small, v1 = _peak_rss_mb(tmp_path / "small")
    big, v2 = _peak_rss_mb(tmp_path / "big")
    assert v1 == v2 == "collective-order-deadlock"
    assert big - small < 32, f"peak RSS grew from {small:.0f} MB to {big:.0f} MB"
