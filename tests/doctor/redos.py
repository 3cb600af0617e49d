"""Worst cases for regular expressions, generated from the patterns themselves.

For a pattern, the inputs are long runs of each character (and pair of characters) its
character classes and literals use, after each of its longest literals (a literal prefix is how
a pattern reaches the repetition that backtracks): ``"| " + "-" * n`` for an exception-group box,
``"resident" + "\\t " * n`` for a memory reading. ``python -m tests.doctor.redos`` measures every
pattern the doctor applies to untrusted text with Python's engine (each compiled module-level
pattern of ``doctor``, ``signatures`` and ``render``, every literal pattern their functions
hand to ``re``) at two sizes, then its slowest shape at a megabyte; it names every pattern
compiled with RE2 (the catalog's, as the doctor compiles them) without timing it, RE2 being
linear in its input by construction. It prints one JSON line per pattern whose time grows
faster than its input, or whose memory does (:func:`memory_growth`; checked before the
megabyte, which such a pattern's memory would time instead), each pattern's name first, so a
run stopped by a timeout names the pattern it hung on.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import json
import pkgutil
import re
import re._constants as C
import re._parser as sp
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from signatures.linear import linear

_RE2 = type(linear("x"))
"""What :func:`signatures.linear.linear` compiles to."""
SMALL, LARGE = 1000, 8000
MID, HUGE = 1 << 17, 1 << 20
"""Each pattern's slowest shape at LARGE is searched again at 128 KB and at a megabyte: growth
that only shows past 8000 characters (or a constant that hid it) shows there. The megabyte is
compared with 128 KB, not with 8000 characters, which stay in the CPU's caches (a linear
pattern took 0.04 us a character at 8000 and 0.11-0.18 beyond 64 KB)."""
_CATEGORY = {C.CATEGORY_DIGIT: "7", C.CATEGORY_SPACE: " \t", C.CATEGORY_WORD: "a_",
             C.CATEGORY_NOT_SPACE: "x", C.CATEGORY_NOT_DIGIT: "x", C.CATEGORY_NOT_WORD: "-"}


def _walk(parsed: Any, lits: set[str], chars: set[str], cur: list[str],
          leads: set[str]) -> None:
    """Collect the pattern's literals, the characters it can take, and (in ``leads``) the
    literals that lead straight into a repetition."""
    for op, av in parsed:
        if op is C.LITERAL:
            cur.append(chr(av))
            chars.add(chr(av))
            continue
        if len(cur) >= 2:
            lits.add("".join(cur))
            if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
                leads.add("".join(cur))
        cur.clear()
        if op is C.IN:
            for o, a in av:
                if o is C.LITERAL:
                    chars.add(chr(a))
                elif o is C.RANGE:
                    chars.update((chr(a[0]), chr(a[1])))
                elif o is C.CATEGORY:
                    chars.update(_CATEGORY.get(a, ""))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
            _walk(av[2], lits, chars, [], leads)
        elif op is C.SUBPATTERN:
            _walk(av[-1], lits, chars, [], leads)
        elif op is C.BRANCH:
            for b in av[1]:
                _walk(b, lits, chars, [], leads)
        elif op in (C.ASSERT, C.ASSERT_NOT):
            _walk(av[1], lits, chars, [], leads)
        elif op is C.ANY:
            chars.add("x")
    if len(cur) >= 2:
        lits.add("".join(cur))


_ENDS = ("x", "\x01", " ", "-")
"""Characters that end a run in :func:`adversarial`: a letter, a control character (outside
every printable class), a blank and a separator."""


def adversarial(pattern: str, flags: int, n: int) -> Iterator[str]:
    """Inputs of about ``n`` characters aimed at ``pattern``'s repetitions."""
    return (shape(n) for shape in shapes(pattern, flags))


Shape = Callable[[int], str]
"""An adversarial input of about ``n`` characters, made on demand (a megabyte each)."""


def shapes(pattern: str, flags: int) -> list[Shape]:
    """The input shapes aimed at ``pattern``'s repetitions, in a fixed order."""
    lits: set[str] = set()
    leads: set[str] = set()
    chars = set(" x-|.:/=")
    with contextlib.suppress(re.error, RecursionError, ValueError):
        _walk(sp.parse(pattern, flags), lits, chars, [], leads)
    alphabet = sorted(c for c in chars if c.isprintable() or c == "\t")[:20]
    anchors = ["", *sorted(lits, key=len, reverse=True)[:3]]
    out: list[Shape] = []
    for anchor in anchors:
        for c in alphabet:
            out.append(functools.partial(_run, anchor, c, ""))
            if anchor == anchors[-1]:
                # a run the repetition takes whole, then one character its continuation
                # refuses: `[-_ ]?\d+$` retries the run from every start (quadratic)
                out += [functools.partial(_run, anchor, c, end) for end in _ENDS if end != c]
        if anchor in anchors[:2]:  # pairs after the longest literal and after none only
            out += [functools.partial(_pairs, anchor, c1 + c2) for c1 in alphabet[:8]
                    for c2 in alphabet[:8] if c1 != c2]
        out.append(functools.partial(_pairs, anchor, "| " + " " * 60))
    # a literal that leads into a repetition, over and over: where the repetition can also
    # take it (`_prefetch_\w+_loop` on "_prefetch_" * n) every occurrence starts a match
    # that runs to the end before it fails (quadratic)
    out += [functools.partial(_pairs, "", lead) for lead in sorted(leads, key=len)[-4:]]
    return out


def _run(anchor: str, c: str, end: str, n: int) -> str:
    return anchor + c * (n - len(end)) + end


def _pairs(anchor: str, unit: str, n: int) -> str:
    return anchor + unit * (n // len(unit))


def worst(rx: Any, pattern: str, flags: int, as_bytes: bool, tries: tuple[int, int]
          ) -> tuple[float, float]:
    """The slowest adversarial inputs' search times at SMALL and at LARGE characters, in
    this thread's CPU time: time spent waiting for a CPU is not the pattern's (on two cores
    shared with two test workers and their subprocesses every search of a few milliseconds
    was preempted, and a linear pattern at 0.003 s measured 0.04 s of wall time, best of
    five).

    Each input shape is timed at both sizes back to back (``tries`` times at each size), the
    fastest of each kept: on a shared machine preemption only ever adds time, and a load
    that lasts seconds (two test workers and their subprocesses on two cores) slows both
    sizes of one shape alike, so it leaves their ratio alone; timing every small input first
    and every large one after let such a load fall on the large ones only and read a linear
    pattern as quadratic."""
    return _worst(rx, pattern, flags, as_bytes, tries)[:2]


def _worst(rx: Any, pattern: str, flags: int, as_bytes: bool, tries: tuple[int, int]
           ) -> tuple[float, float, int]:
    """:func:`worst`, and which shape was slowest at LARGE."""
    small_out = large_out = 0.0
    slowest = 0
    for shape, (small_s, large_s) in enumerate(zip(adversarial(pattern, flags, SMALL),
                                                   adversarial(pattern, flags, LARGE),
                                                   strict=True)):
        data = [x.encode("latin-1", "replace") if as_bytes else x for x in (small_s, large_s)]
        best = [float("inf"), float("inf")]
        for round_ in range(max(tries)):
            for i, d in enumerate(data):
                if round_ >= tries[i]:
                    continue
                t = time.thread_time()
                rx.search(d)
                best[i] = min(best[i], time.thread_time() - t)
        if best[1] > large_out:
            slowest = shape
        small_out, large_out = max(small_out, best[0]), max(large_out, best[1])
    return small_out, large_out, slowest


def at_a_megabyte(rx: Any, pattern: str, flags: int, as_bytes: bool, shape: int
                  ) -> tuple[float, float] | None:
    """(MID, HUGE) search times of adversarial ``shape`` when the megabyte grows faster than
    its input from MID (the ratio :func:`_superlinear` allows), else None. One search of
    each first; a first look that seems superlinear is measured again, best of three."""
    make = shapes(pattern, flags)[shape]
    texts = [make(n) for n in (MID, HUGE)]
    data = [t.encode("latin-1", "replace") if as_bytes else t for t in texts]

    def best_of(tries: int) -> tuple[float, float]:
        best = [float("inf"), float("inf")]
        for _ in range(tries):
            for i, d in enumerate(data):
                t = time.thread_time()
                rx.search(d)
                best[i] = min(best[i], time.thread_time() - t)
        return best[0], best[1]

    def grows(mid: float, huge: float) -> bool:
        return huge > 0.05 and huge / max(mid, 1e-5) > 24

    mid, huge = best_of(1)
    if grows(mid, huge):
        mid, huge = best_of(3)
    return (mid, huge) if grows(mid, huge) else None


def superlinear(rx: Any, pattern: str, flags: int, as_bytes: bool
                ) -> tuple[float, float] | None:
    """(small, large) search times when ``rx`` grows faster than its input on its worst
    cases, else None. A first look that seems superlinear is measured again, each input's
    fastest of five kept: one preempted search is not a finding. The first look times each
    small input thrice (cheap): one preempted small search would hide a quadratic pattern."""
    return check(rx, pattern, flags, as_bytes)[0]


def check(rx: Any, pattern: str, flags: int, as_bytes: bool
          ) -> tuple[tuple[float, float] | None, int]:
    """:func:`superlinear`'s answer, and the shape slowest at LARGE."""
    small, large, shape = _worst(rx, pattern, flags, as_bytes, tries=(3, 1))
    if _superlinear(small, large):
        small, large = worst(rx, pattern, flags, as_bytes, tries=(5, 5))
    return ((small, large) if _superlinear(small, large) else None), shape


def _superlinear(small: float, large: float) -> bool:
    # linear: about 8x the time for 8x the input; quadratic would be 64x. The floor keeps
    # microsecond timings out; it is well below what a quadratic search of LARGE characters
    # takes (Python's `\s*x` on 8000 blanks: 0.05-0.12 s, which a 0.05 floor made a coin toss)
    return large > 0.02 and large / max(small, 1e-5) > 24


def memory_growth(rx: Any, pattern: str, flags: int, as_bytes: bool) -> tuple[int, int] | None:
    """(SMALL, LARGE) peak bytes a search allocates on the adversarial shape that needs the
    most at SMALL, when that grows with the input, else None.

    Python's engine keeps a backtracking frame for every iteration of a repeated group
    (``(?:[|+] )+``: about 140 bytes a character); a possessive repetition (``++``) keeps
    none. Such a pattern is linear in time but not in memory, and its timings are the
    machine's memory, not the pattern: at a megabyte it touches 150 MB, and whether that
    reads as superlinear depended on the load (a 16x and a 30x growth for 8x the input in
    two runs). Allocations are counted, not timed: the same on every run."""
    import tracemalloc

    def peak(data: str | bytes) -> int:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        rx.search(data)
        return tracemalloc.get_traced_memory()[1] - before

    def text(make: Shape, n: int) -> str | bytes:
        return make(n).encode("latin-1", "replace") if as_bytes else make(n)

    made = shapes(pattern, flags)
    tracemalloc.start()
    try:
        small, shape = max((peak(text(make, SMALL)), i) for i, make in enumerate(made))
        large = peak(text(made[shape], LARGE))
    finally:
        tracemalloc.stop()
    return (small, large) if large > 16 << 10 and large > 4 * small else None


def patterns() -> dict[str, tuple[Any, str, int, bool]]:
    """name -> (compiled as the doctor applies it, source, flags, bytes?)."""
    import doctor
    import signatures
    from signatures.linear import linear

    out: dict[str, tuple[Any, str, int, bool]] = {}
    modules = [m.name for pkg in (doctor, signatures)
               for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
               if ".mine" not in m.name] + ["render"]
    for name in modules:
        for key, value in vars(importlib.import_module(name)).items():
            for where, rx in _held(key, value):
                src = rx.pattern
                as_bytes = isinstance(src, bytes)
                text = src.decode("latin-1") if as_bytes else src
                out[f"{name}.{where}"] = (rx, text, rx.flags & ~re.UNICODE, as_bytes)
    for name, src in catalog_patterns():
        out[f"catalog {name}: {src[:60]}"] = (linear(src), src, 0, False)
    for name, (src, flags) in inline_patterns().items():
        as_bytes = isinstance(src, bytes)
        text = src.decode("latin-1") if as_bytes else src
        out[name] = (re.compile(src, flags), text, flags, as_bytes)
    return out


#: The ``re`` functions that take a pattern first, with the position of their ``flags``.
_RE_CALLS = {"compile": 1, "search": 2, "match": 2, "fullmatch": 2, "findall": 2,
             "finditer": 2, "split": 3, "sub": 4, "subn": 4}
SOURCES = ("doctor", "signatures", "render.py", "cli.py")
"""Where the doctor's code lives (the source of :func:`inline_patterns`)."""


def inline_patterns(root: Path | None = None) -> dict[str, tuple[str | bytes, int]]:
    """``file:line:column`` -> (pattern, flags) for every literal pattern the doctor's code
    hands to ``re`` inside a function (``re.search(r"...", text)``), which no module-level
    name holds. Flags given as ``re.X | re.Y`` are read."""
    out: dict[str, tuple[str | bytes, int]] = {}
    for where, call in _calls_in_functions(root):
        src = call.args[0]
        if isinstance(src, ast.Constant) and isinstance(src.value, (str, bytes)):
            out[where] = (src.value, _flags(call))
    return out


def runtime_built_patterns(root: Path | None = None) -> list[str]:
    """``file: call`` (the call as source, so that edits elsewhere in the file leave it
    alone) for every ``re`` call inside a function whose pattern is built at run time (not a
    literal, not ``re.escape``): what neither :func:`inline_patterns` nor the module-level
    collection can measure, so each one is reviewed by hand."""
    return [f"{where.split(':', 1)[0]}: {ast.unparse(call)}"
            for where, call in _calls_in_functions(root)
            if not isinstance(call.args[0], ast.Constant)
            and call.func.attr != "escape"]  # type: ignore[attr-defined]


def _calls_in_functions(root: Path | None) -> Iterator[tuple[str, ast.Call]]:
    root = root or Path(__file__).resolve().parents[2]
    for path in _source_files(root):
        seen: set[int] = set()
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                call = _re_call(node)
                if call is not None and id(call) not in seen:  # nested functions: once
                    seen.add(id(call))
                    yield (f"{path.relative_to(root).as_posix()}:{call.lineno}:"
                           f"{call.col_offset}"), call


def _source_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for name in SOURCES:
        top = root / name
        files += [top] if top.is_file() else sorted(p for p in top.rglob("*.py")
                                                    if "/mine/" not in p.as_posix())
    return files


def _re_call(node: ast.AST) -> ast.Call | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "re" \
            and node.func.attr in (*_RE_CALLS, "escape") and node.args:
        return node
    return None


def _flags(call: ast.Call) -> int:
    attr = call.func.attr  # type: ignore[attr-defined]
    given = next((k.value for k in call.keywords if k.arg == "flags"), None)
    if given is None and len(call.args) > _RE_CALLS.get(attr, 99):
        given = call.args[_RE_CALLS[attr]]
    value = 0
    for part in ast.walk(given) if given is not None else ():
        if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) \
                and part.value.id == "re":
            value |= int(getattr(re, part.attr, 0))
    return value


def _held(key: str, value: Any, depth: int = 0) -> Iterator[tuple[str, re.Pattern[Any]]]:
    """The compiled ``re`` patterns a module-level name holds: itself, or inside the lists,
    tuples and dicts it holds (a table of patterns with their replacements or names)."""
    if isinstance(value, re.Pattern):
        yield key, value
    elif depth < 3 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _held(f"{key}[{i}]", v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for k, v in value.items():
            yield from _held(f"{key}[{str(k)[:40]!r}]", v, depth + 1)


def catalog_patterns() -> list[tuple[str, str]]:
    """Every regular expression the catalog and the component map hold."""
    from signatures.index.components import load_rules
    from signatures.loader import load_catalog

    cat = load_catalog()
    out = [(f"pattern {p.id}", p.regex) for p in cat.patterns]
    for s in cat.signatures:
        for e in s.recognisers.exceptions:
            out += [(f"{s.id} exception type", e.type), (f"{s.id} exception", e.message)]
        if s.recognisers.frames:
            out += [(f"{s.id} frame", part) for x in s.recognisers.frames.any
                    for part in x.split("@", 1) if part]
        if s.upstream:
            out += [(f"{s.id} marker", m.regex)
                    for m in [*s.upstream.evidence_for, *s.upstream.evidence_against]]
    out += [(f"look-alike {lk.id} marker", m.regex) for lk in cat.lookalikes
            for m in lk.markers]
    for k in ("in_app", "collective", "comm_wrappers", "idle_waits"):
        for x in getattr(cat.frames, k):
            rule = x.partition(" ")[2] if k == "in_app" else x
            out += [(f"frame rule {k}", part) for part in rule.split("@", 1) if part]
    for r in load_rules():
        for p in r.paths:
            out += [(f"component {r.id}", p)] if isinstance(p, str) else [
                (f"component {r.id}", p.match), (f"component {r.id} unless", p.unless)]
    return out


def main() -> int:
    found = 0
    for name, (rx, src, flags, as_bytes) in sorted(patterns().items()):
        if isinstance(rx, _RE2):
            # RE2 runs in time linear in its input by construction (no backtracking): a
            # timing would measure RE2, not the pattern
            print(json.dumps({"checking": name, "engine": "re2"}), flush=True)
            continue
        print(json.dumps({"checking": name}), flush=True)
        growth, shape = check(rx, src, flags, as_bytes)
        if growth is not None:
            small, large = growth
            found += 1
            print(json.dumps({"superlinear": name, "small_s": round(small, 4),
                              "large_s": round(large, 4)}), flush=True)
            continue
        held = memory_growth(rx, src, flags, as_bytes)
        if held is not None:
            found += 1
            print(json.dumps({"memory_grows": name, "small_bytes": held[0],
                              "large_bytes": held[1]}), flush=True)
            continue
        far = at_a_megabyte(rx, src, flags, as_bytes, shape)
        if far is not None:
            found += 1
            print(json.dumps({"superlinear": name, "at": HUGE, "mid_s": round(far[0], 4),
                              "huge_s": round(far[1], 4)}), flush=True)
    print(json.dumps({"done": True, "found": found}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
