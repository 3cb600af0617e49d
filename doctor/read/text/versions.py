"""The upstream versions a report states: package pins (``sglang==0.5.5``), installed-package
listings (``sglang: 0.5.5``, ``sglang   0.5.5``, SGLang's ``check_env``), wheel and dist-info
paths (``sglang-0.5.5.dist-info``), version banners (``SGLang v0.5.5``, ``LMCache version
0.3.6``) and the version field of a server-argument echo.

The doctor asks the upstream index which releases hold each template a line matched; a template
absent from the release the report runs weakens the match.
"""

from __future__ import annotations

from signatures.linear import linear

#: System names as the index knows them, and how reports spell their packages.
PACKAGES = {"sglang": "sglang", "lmcache": "lmcache", "mooncake-transfer-engine": "mooncake",
            "mooncake_transfer_engine": "mooncake", "mooncake": "mooncake", "nixl": "nixl",
            "torch": "torch", "pytorch": "torch"}
#: ASCII digits only: a version number is (``\d`` would take any script's digits, which
#: no package index accepts)
_VER = r"(?P<ver>[0-9]+\.[0-9]+(?:\.[0-9]+)?(?:\.?post[0-9]+|rc[0-9]+|\.dev[0-9]+)?)"
_NAMES = (r"(?P<pkg>sglang|lmcache|mooncake[-_]transfer[-_]engine(?:[-_]non[-_]cuda)?|mooncake|"
          r"nixl|torch|pytorch)")
#: Compiled with RE2: the listing form's runs of spaces around the name and the version
#: overlap, which a backtracking engine tried in cubic time (a 612-byte line of spaces took
#: 4 s; lines go up to 2000 characters).
_PATTERNS = [
    linear(rf"(?i)\b{_NAMES}(?:\[[\w,]+\])?\s*==\s*v?{_VER}\b"),
    linear(rf"(?i)\b{_NAMES}-{_VER}(?:\+\w+)?(?:\.dist-info|-py3|-cp3|\.tar\.gz|/)"),
    linear(rf"(?i)^\s*{_NAMES}\s*(?::|\s{{2,}}|\bversion\s*[:=]?)\s*v?{_VER}\s*(?:\S+\s*)?$"),
    linear(rf"(?i)\b{_NAMES}\s+(?:version\s*[:=]?\s*)?v{_VER}\b"),
    linear(rf"(?i)\b{_NAMES}\s+version\s*[:=]?\s*v?{_VER}\b"),
]
_NAMED = ("sglang", "lmcache", "mooncake", "nixl", "torch")
#: Any of the names, in any case: one automaton pass instead of a lower-cased copy and a scan
#: per name.
NAMED_PATTERN = "(?i)" + "|".join(_NAMED)
_ANY_NAMED = linear(NAMED_PATTERN)
#: Every pattern above needs a version number.
NUMBER_PATTERN = r"[0-9]\.[0-9]"
_NUMBER = linear(NUMBER_PATTERN)
TRIGGERS = ("==", "dist-info", "ersion", "sglang ", "sglang:", "SGLang ", "lmcache ", "lmcache:",
            "LMCache ", "nixl ", "nixl:", "torch ", "torch:", "mooncake")


def _canonical(pkg: str) -> str:
    low = pkg.lower().replace("_", "-")
    if low.startswith("mooncake"):
        return "mooncake"
    return PACKAGES.get(low, low)


def stated_versions(line: str, gated: bool = False) -> list[tuple[str, str]]:
    """``(system, version)`` pairs ``line`` states (at most a few). ``gated``: the caller
    has found :data:`NAMED_PATTERN` and :data:`NUMBER_PATTERN` in the line."""
    if len(line) > 2000:
        line = line[:2000]
    if not gated and (_ANY_NAMED.search(line) is None or _NUMBER.search(line) is None):
        return []  # most lines: five regexes spared
    out: list[tuple[str, str]] = []
    for rx in _PATTERNS:
        for m in rx.finditer(line):
            pair = (_canonical(m["pkg"]), m["ver"])
            if pair not in out:
                out.append(pair)
            if len(out) >= 4:
                return out
    return out
