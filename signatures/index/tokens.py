"""Templates and tokens: the one representation the miner writes and the matcher reads.

A *template* is a message as upstream's source builds it, with every value it formats in
replaced by a typed wildcard: ``raise RuntimeError(f"shape {x} vs {y:.2f}")`` becomes
``shape {*} vs {f}``. Wildcards are ``{*}`` (anything), ``{d}`` (an integer), ``{f}`` (a
number) and ``{x}`` (a hexadecimal number); literal braces are doubled, as ``str.format`` does.

Matching works on *tokens*, not characters, so a line that differs from a template by a word
(another release's wording, a stripped prefix) still matches, with a lower similarity: words are
lower-cased, split at every non-word character and at ``camelCase`` humps, and reduced by a
crude stemmer (``failed``, ``fails`` and ``failure`` are one token). Numbers, hex and single
letters are never tokens: they are the values that change from one report to the next.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

WILDCARDS = {"*": r".*?", "d": r"[-+]?\d+", "f": r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|inf|nan)",
             "x": r"(?:0[xX])?[0-9a-fA-F]+"}
_FIELD = re.compile(r"\{\{|\}\}|\{([*dfx])\}")
#: A wildcard not preceded by an escaping brace (``{{*}`` is a literal ``{*}``... rare enough
#: that a token split on it costs nothing)
_WILD_SPLIT = re.compile(r"\{[*dfx]\}")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])|_+")
_SUFFIXES = ("ions", "ion", "ings", "ing", "ures", "ure", "ied", "ies", "ed")
_STEM: dict[str, str] = {}
MAX_STEMS = 1 << 16


def escape(literal: str) -> str:
    """``literal`` as template text (braces doubled)."""
    return literal.replace("{", "{{").replace("}", "}}")


def pieces(template: str) -> Iterator[tuple[str, str]]:
    """The template as ``("lit", text)`` and ``("any"|"d"|"f"|"x", "")`` pieces, in order."""
    pos, buf = 0, []
    for m in _FIELD.finditer(template):
        buf.append(template[pos:m.start()])
        pos = m.end()
        if m[0] in ("{{", "}}"):
            buf.append(m[0][0])
            continue
        if buf and "".join(buf):
            yield "lit", "".join(buf)
        buf = []
        yield ("any" if m[1] == "*" else m[1]), ""
    buf.append(template[pos:])
    if "".join(buf):
        yield "lit", "".join(buf)


def literal_text(template: str) -> str:
    """The template's literal text, a space where each wildcard stands."""
    return " ".join(t for kind, t in pieces(template) if kind == "lit")


def to_regex(template: str) -> str:
    """A regex that matches a message built from the template (searched, not anchored)."""
    out = []
    for kind, text in pieces(template):
        if kind == "lit":
            # white space in a message is re-wrapped by loggers and pasting: any run matches any
            out.append(r"\s+".join(re.escape(w) for w in text.split(" ")) if text.strip()
                       else r"\s*")
        else:
            out.append(WILDCARDS["*" if kind == "any" else kind])
    return "".join(out)


def stem(word: str) -> str:
    """A crude stem: lower case without a common English suffix, so that ``failed``,
    ``fails`` and ``failure`` are one token, and ``allocate``, ``allocating`` and
    ``allocation`` another."""
    hit = _STEM.get(word)
    if hit is not None:
        return hit
    low = word.lower()
    out = low
    if len(out) > 3:
        for suf in _SUFFIXES:
            if out.endswith(suf) and len(out) - len(suf) >= 3:
                out = out[:-len(suf)]
                break
        else:
            if out.endswith(("sses", "ches", "shes", "xes", "zes")):
                out = out[:-2]
            elif out.endswith("s") and not out.endswith(("ss", "us", "is")):
                out = out[:-1]
        if len(out) > 4 and out.endswith("e"):
            out = out[:-1]
    if len(_STEM) < MAX_STEMS:
        _STEM[word] = out
    return out


def words(text: str) -> list[str]:
    """The tokens of ``text``: stemmed words of two or more letters, identifiers split at
    underscores and humps (``batch_get_into`` and ``BatchGetInto`` give the same three)."""
    out: list[str] = []
    for w in _WORD.findall(text):
        if "_" not in w and (w.islower() or w.isupper() or w.istitle()):
            if len(w) >= 2:
                out.append(stem(w))  # the common case: one plain word
            continue
        for part in _HUMP.split(w):
            if len(part) >= 2 and not part.isdigit():
                out.append(stem(part))
    return out


def template_words(template: str) -> list[str | None]:
    """The template's tokens in order, ``None`` where a wildcard stands (a gap the matcher
    lets any number of line tokens fill)."""
    out: list[str | None] = []
    for i, seg in enumerate(_WILD_SPLIT.split(template)):
        if i and (not out or out[-1] is not None):
            out.append(None)
        if seg:
            out += words(seg)
    return out


def literal_chars(template: str) -> int:
    """How many letters the template fixes: a measure of how specific it is."""
    return sum(c.isalpha() for kind, text in pieces(template) if kind == "lit" for c in text)


def join(parts: Iterable[tuple[str, str]]) -> str:
    """Template text from pieces (``("lit", text)`` or a wildcard kind), wildcards merged."""
    out: list[str] = []
    last_wild = False
    for kind, text in parts:
        if kind == "lit":
            if text:
                out.append(escape(text))
                last_wild = False
        elif not last_wild:
            out.append("{" + ("*" if kind == "any" else kind) + "}")
            last_wild = True
        elif kind == "any":  # two adjacent fields: the gap may hold anything
            out[-1] = "{*}"
    return "".join(out)
