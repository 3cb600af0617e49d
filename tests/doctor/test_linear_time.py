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
from collections.abc import Callable
from pathlib import Path

import pytest

from signatures.linear import PatternSet, UnsafePattern, any_of, linear
from signatures.models import LogPattern, Marker
from tests.doctor.hostile import run_capped

ROOT = Path(__file__).resolve().parents[2]


def test_every_pattern_grows_linearly_with_its_input() -> None:
    """Reader patterns with Python's engine, timed; catalog patterns as the doctor compiles
    them, with RE2 (linear by construction). One subprocess, each pattern named before it is
    tried: a hang names its pattern."""
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.doctor.redos"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        last = [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1:]
        pytest.fail(f"a pattern did not finish on its worst case: {last}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    slow = [x for x in lines if "superlinear" in x or "memory_grows" in x]
    assert not slow, slow
    assert lines[-1] == {"done": True, "found": 0}
    assert sum("checking" in x for x in lines) > 400  # every module and the whole catalog
    assert sum("engine" in x for x in lines) > 300  # the catalog's, compiled with RE2
    assert sum("checking" in x and "engine" not in x for x in lines) > 100  # timed


def test_patterns_written_inside_functions_are_measured_too() -> None:
    """A literal handed to ``re`` inside a function (``re.search(r"...", text)``) is held by
    no module-level name: the harness reads them from the source and measures them with the
    rest. A pattern built at run time cannot be measured that way; the one there is searches
    an empty string (a catalog frame pattern's check at load), never untrusted text, and a
    new one must be reviewed and added here."""
    from tests.doctor.redos import inline_patterns, patterns, runtime_built_patterns

    inline = inline_patterns()
    assert len(inline) >= 15
    measured = patterns()
    assert set(inline) <= set(measured)
    # a pattern with flags keeps them (re.M on a capture's backtrace split, re.I elsewhere)
    assert any(flags for _, flags in inline.values())
    assert runtime_built_patterns() == ["signatures/models.py: re.search(part, '')"]


class _Scan:
    """A function in the place of a compiled pattern, for the measure."""

    def __init__(self, fn: Callable[[str], str]) -> None:
        self.search = fn


@pytest.mark.parametrize(("fn", "was"), [
    ("doctor.model.frames._without_number", r"[-_ ]?\d+$"),
    ("signatures.index.matcher._without_call_site", r"(?:\s*\([^()]{1,200}\))?\s*$"),
], ids=["thread-number", "call-site"])
def test_the_scans_that_replaced_quadratic_patterns_grow_linearly(fn: str, was: str) -> None:
    """Measured on the worst cases of the pattern each replaced (which the measure finds
    quadratic: a run of digits or blanks ended by a letter)."""
    import importlib

    from tests.doctor.redos import superlinear

    module, _, name = fn.rpartition(".")
    scan = getattr(importlib.import_module(module), name)
    assert superlinear(_Scan(scan), was, 0, False) is None


def test_the_collector_reads_inline_literals_and_their_flags(tmp_path: Path) -> None:
    import re

    from tests.doctor.redos import inline_patterns, runtime_built_patterns

    pkg = tmp_path / "doctor"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import re\n"
        "TOP = re.compile(r'module level')\n"
        "def f(text, word):\n"
        "    if re.search(r'(a+)+b', text, re.I | re.M):\n"
        "        return re.sub(rb'x\\s*y', b'', text, flags=re.S)\n"
        "    return re.match(re.escape(word) + 'z', text)\n")
    found = inline_patterns(tmp_path)
    assert found == {"doctor/m.py:4:7": ("(a+)+b", re.I | re.M),
                     "doctor/m.py:5:15": (rb"x\s*y", re.S)}
    assert runtime_built_patterns(tmp_path) == ["doctor/m.py: re.match(re.escape(word) + 'z', "
                                                "text)"]


def test_the_measure_tells_a_quadratic_pattern_from_a_linear_one() -> None:
    """The check above, on a pattern known to be quadratic on a run of blanks with Python's
    engine (each start position scans to the end) and on a linear one."""
    import re

    from tests.doctor.redos import superlinear

    quadratic = re.compile(r"\s*x")
    assert superlinear(quadratic, quadratic.pattern, 0, False) is not None
    plain = re.compile(r"x\s*y")
    assert superlinear(plain, plain.pattern, 0, False) is None
    # a literal that leads into a repetition which can also take it, on that literal over
    # and over: the shape of doctor.model.frames' old thread-role pattern (`_prefetch_\w+_loop`
    # on a frame name of "_prefetch_" repeated: 1.75 s at 60 KB), with a short literal so
    # that 8000 characters hold enough starts to time it well above the floor
    lead_in = re.compile(r"_p\w+_loop")
    assert superlinear(lead_in, lead_in.pattern, 0, False) is not None


def test_the_measure_tells_a_repetition_that_keeps_a_frame_per_iteration() -> None:
    """The exception-group box pattern as it was (a plain repeated group: 1.25 MB for 8000
    characters of " + + +") and as it is (possessive: no memory of its iterations)."""
    import re

    from tests.doctor.redos import memory_growth

    plain = re.compile(r"^\s*(?:[|+](?:-[-+]*)?(?: |$))+")
    small, large = memory_growth(plain, plain.pattern, 0, False) or (0, 0)
    assert large > 4 * small > 0
    possessive = re.compile(plain.pattern + "+")
    assert memory_growth(possessive, possessive.pattern, 0, False) is None


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
