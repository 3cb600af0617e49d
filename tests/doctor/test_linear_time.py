"""Matching in linear time: every pattern the doctor applies to untrusted text, and the
inputs that once stalled it.

The catalog's patterns (and the component map's) are compiled with RE2 and a pattern RE2
refuses is refused at load; the readers' own patterns are measured on worst cases generated
from each pattern (``tests/doctor/redos.py``) and must not grow faster than their input. The
inputs of the second hardening round's findings go through the whole doctor under the memory
cap and must finish."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from signatures.linear import PatternSet, UnsafePattern, any_of, linear
from signatures.models import LogPattern, Marker
from tests.doctor.hostile import run_capped

ROOT = Path(__file__).resolve().parents[2]


def test_every_pattern_grows_linearly_with_its_input() -> None:
    """Reader patterns with Python's engine, catalog patterns as the doctor compiles them.
    One subprocess, each pattern named before it is tried: a hang names its pattern."""
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.doctor.redos"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        last = [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1:]
        pytest.fail(f"a pattern did not finish on its worst case: {last}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    slow = [x for x in lines if "superlinear" in x]
    assert not slow, slow
    assert lines[-1] == {"done": True, "superlinear_count": 0}
    assert sum("checking" in x for x in lines) > 400  # every module and the whole catalog


def test_the_measure_tells_a_quadratic_pattern_from_a_linear_one() -> None:
    """The check above, on a pattern known to be quadratic on a run of blanks with Python's
    engine (each start position scans to the end) and on a linear one."""
    import re

    from tests.doctor.redos import superlinear

    quadratic = re.compile(r"\s*x")
    assert superlinear(quadratic, quadratic.pattern, 0, False) is not None
    plain = re.compile(r"x\s*y")
    assert superlinear(plain, plain.pattern, 0, False) is None


def test_a_pattern_that_cannot_run_in_linear_time_is_refused() -> None:
    with pytest.raises(UnsafePattern, match="lookaround"):
        linear(r"CUDA error: (?!out of memory)")
    with pytest.raises(UnsafePattern):
        linear(r"(a)\1")
    with pytest.raises(ValueError, match="linear time"):
        LogPattern(id="x", triggers=["ab"], regex=r"(?<=a)b", meaning="m", examples=["ab"])
    with pytest.raises(ValueError, match="linear time"):
        Marker(kind="log", text=r"(x+)\1", where="somewhere")
    # what RE2 runs, it runs in linear time: the classic exponential case is instant
    assert linear(r"(a+)+b").search("a" * 100_000) is None
    assert linear(r"(?:\w+\.)*ResourceLeak").search("_." * 200_000) is None


def test_pattern_sets_find_every_pattern_in_one_pass() -> None:
    s = PatternSet([any_of(["Timed out", "pop from"]), any_of(["a.b"]), "(?i)error|failed"])
    assert sorted(s.found("x pop from y FAILED")) == [0, 2]
    assert s.found("axb") == []  # any_of takes literals, not patterns
    assert s.found("no trigger here") == []
    with pytest.raises(UnsafePattern):
        PatternSet([r"(x+)\1"])


FINDINGS = {
    # an exception group's box: "|" and a run of dashes with no space after it
    "box.log": "  + Exception Group Traceback (most recent call last):\n  |"
               + "-" * 60 + "x\n",
    # one 8 KB Markdown table row with a long run of blanks
    "table.md": "| 2026-01-01 00:00:00 |" + " " * 8000 + "x\n",
    # 1 MB of script openings, 900 KB of paragraph openings, as HTML pages
    "scripts.html": "<html><body>" + "<script>" * 131_072,
    "paragraphs.html": "<html><body><p>x</p>" + "<p " * 300_000,
    # 1 MB of long lines a catalog pattern's triggers pull into matching
    "memory.log": ("host memory usage" + "\t " * 4000 + "\n") * 128,
    # package-listing lines whose blanks around a name and a version overlap (4 s a 612-byte
    # line; 64 lines of 1900), and long messages of paths and dashed ids to fingerprint
    "versions.log": ("torch" + " " * 900 + "1.2" + " " * 900 + "x y\n") * 64,
    "paths.log": "RuntimeError: " + "/a" * 4000 + "-1" * 3000 + "\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FINDINGS)
def test_the_inputs_that_stalled_the_doctor_finish(name: str, tmp_path: Path) -> None:
    """Each took from a minute to past two minutes before (some never finished)."""
    path = tmp_path / name
    path.write_text(FINDINGS[name])
    run = run_capped(["doctor", "--json", str(path)], tmp_path, timeout_s=120)
    assert run.rc in (0, 1), run.stderr[-2000:]
    assert run.wall_s < 60, f"{name}: {run.wall_s:.1f} s"
    json.loads(run.stdout)
