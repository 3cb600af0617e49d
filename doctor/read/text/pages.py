"""What users paste: evidence inside issue pages, chat messages and log-collector exports.

Two layers, both before any parser sees a line:

* :class:`HtmlText` turns an HTML page (a saved GitHub issue, a wiki page, a mail) into its text,
  streaming: tags go (block-level ones end a line), entities are decoded (``&quot;`` becomes
  ``"`` again, so ``File &quot;x.py&quot;`` is a traceback frame), ``<script>``/``<style>``
  bodies are dropped. Memory stays one chunk.
* :func:`clean_line` undoes per-line wrapping: CR of CRLF files, Markdown code fences and block
  quotes (``> ``), lines that are only ``<details>``/``<summary>``/``<pre>`` markup, and the
  table rows of Grafana/Loki exports (``  |   | 2026-06-12 12:13:18.902 | <text> |``), whose
  middle column is the log line.
"""

from __future__ import annotations

import html
import io
import re
from typing import Any, BinaryIO

_FENCE = re.compile(r"^\s{0,3}(?:```|~~~)[\w+.-]*\s*$")
_QUOTE = re.compile(r"^(?:> ?){1,4}")
# Repetitions of a group are possessive ("++", "*+") wherever giving an iteration back cannot
# make a match: Python's engine otherwise keeps a backtracking frame for every iteration, tens
# of bytes of memory per character of the line. Each parse here is unique (a tag ends at its
# first ">", blanks run to the next "<"), so the possessive forms match exactly the same lines.
_MARKUP_ONLY = re.compile(r"^\s*(?:</?(?:details|summary|pre|code|p|div|br|span|kbd|sub|sup|"
                          r"blockquote|tt)\b[^>]{0,200}>\s*)++$", re.IGNORECASE)
#: Any tags, then ``<summary>text</summary>`` to end the line: the summary is found first
#: (it can only start at the line's second-to-last "<") and the tags before it checked after,
#: since a possessive run of tags would take the ``<summary>`` too.
_SUMMARY_LAST = re.compile(r"<summary>[^<]{0,200}</summary>\s*$", re.IGNORECASE)
_TAGS = re.compile(r"\s*(?:<[^<>]{1,200}>\s*)*+")
# The row's head only; its text is the rest of the line, trailing blanks and pipe stripped in
# code (".*?\s*\|?\s*$" took cubic time on a long row of blanks)
_TABLE_ROW = re.compile(r"^[\s|]*(?P<ts>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?Z?)\s*\| ?")
_TABLE_RULE = re.compile(r"^\s*(?:-{2,}\s*\|\s*)+-{2,}\s*$|^[\s|]+$")


def clean_line(text: str) -> str:
    """One line without the page's wrapping (see the module docstring)."""
    if text.endswith("\r"):
        text = text.rstrip("\r")
    if not text:
        return text
    first = text.lstrip()[:1]
    if first in ("`", "~") and _FENCE.match(text):
        return ""
    if first == ">":
        text = _QUOTE.sub("", text, count=1)
        first = text.lstrip()[:1]
    if first == "<" and _markup_only(text):
        return ""
    if "|" in text:
        m = _TABLE_ROW.match(text)
        if m:
            row = text[m.end():].rstrip()
            return row[:-1].rstrip() if row.endswith("|") else row
        if _TABLE_RULE.match(text):
            return ""
    return text


def _markup_only(text: str) -> bool:
    if _MARKUP_ONLY.match(text):
        return True
    summary = _SUMMARY_LAST.search(text)
    return summary is not None and _TAGS.fullmatch(text, 0, summary.start()) is not None


_HTML_MARKERS = (b"<html", b"<!doctype html", b"<body", b"<div", b"<pre", b"<details",
                 b"<table", b"<p>", b"<br", b"<span", b"<code")


def looks_like_html(head: bytes) -> bool:
    """An HTML page (not a log that mentions a tag): markup early, or several markers."""
    low = head[:65536].lower()
    if low.lstrip()[:1] == b"<" and any(m in low[:2048] for m in _HTML_MARKERS):
        return True
    markers = sum(low.count(m) for m in _HTML_MARKERS)
    entities = low.count(b"&quot;") + low.count(b"&lt;") + low.count(b"&gt;") + low.count(b"&#")
    return markers >= 3 and markers + entities >= 6


# Tags end within 2000 characters and before the next "<": an unbounded "[^>]*" scanned the
# rest of the chunk from every "<p " of a page full of them
_BLOCK_END = re.compile(r"<br\s*/?>|</(?:p|div|li|tr|h\d|pre|summary|details|blockquote|table|"
                        r"ul|ol|dt|dd)\s*>|<(?:p|div|li|tr|pre|details|table|h\d)\b"
                        r"[^<>]{0,2000}>", re.IGNORECASE)
_TAG = re.compile(r"<[^<>]{0,2000}>")
_DROPPED = ("script", "style")
CHUNK = 1 << 20
_MAX_TAIL = 4096


class HtmlText(io.RawIOBase):
    """A byte stream of an HTML page's text (UTF-8), converted chunk by chunk."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._carry = ""
        self._out = b""
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # a writable buffer (bytearray or memoryview)
        while not self._out and not self._eof:
            self._fill()
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _fill(self) -> None:
        data = self._raw.read(CHUNK)
        if not data:
            self._eof = True
            text, self._carry = self._carry, ""
        else:
            text = self._carry + data.decode("utf-8", errors="replace")
            cut = _safe_cut(text)
            text, self._carry = text[:cut], text[cut:]
        self._out += _convert(text).encode("utf-8")


def _safe_cut(text: str) -> int:
    """Where to stop converting so that no tag, entity or script body is split."""
    cut = len(text)
    lt = text.rfind("<")
    if lt >= 0 and text.find(">", lt) < 0 and len(text) - lt <= _MAX_TAIL:
        cut = lt
    amp = text.rfind("&", 0, cut)
    if amp >= 0 and cut - amp <= 10 and ";" not in text[amp:cut]:
        cut = amp
    low = text[:cut].lower()
    for tag in ("script", "style"):
        opened = low.rfind(f"<{tag}")
        if opened >= 0 and low.find(f"</{tag}", opened) < 0 and cut - opened <= 1 << 20:
            cut = opened
    return cut


def _drop_scripts(text: str) -> str:
    """``text`` without its ``<script>``/``<style>`` elements, in one pass: each opening
    tag is looked for once, and so is its end (a regex ``<script>.*?</script>`` rescanned
    the rest of the text from every opening of a page of unclosed ones). An element that
    does not end here is dropped to the end of the text."""
    low = text.lower()
    out: list[str] = []
    pos = 0
    while True:
        opens = [(i, tag) for tag in _DROPPED if (i := low.find(f"<{tag}", pos)) >= 0]
        if not opens:
            break
        start, tag = min(opens)
        after = start + 1 + len(tag)
        if after < len(low) and (low[after].isalnum() or low[after] in "_-"):
            out.append(text[pos:after])  # <scripted> or <style-x>: another tag
            pos = after
            continue
        out.append(text[pos:start])
        close = low.find(f"</{tag}", after)
        if close < 0:
            return "".join(out)
        end = low.find(">", close)
        pos = len(text) if end < 0 else end + 1
    out.append(text[pos:])
    return "".join(out)


def _convert(text: str) -> str:
    text = _drop_scripts(text)
    text = _BLOCK_END.sub("\n", text)
    text = _TAG.sub("", text)
    return html.unescape(text)
