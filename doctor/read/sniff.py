"""What kind of artifact a file is, from its name and its first bytes.

Content wins over names where content is unambiguous (a pickle, a gzip stream, a tar header,
NUL bytes); names decide between JSON shapes; everything else is text and goes to the log
scanner, which recognises tracebacks, thread dumps and log patterns inside any text.
"""

from __future__ import annotations

import re
from enum import Enum

from doctor.read.text.pages import looks_like_html

HEAD_BYTES = 64 << 10


class Kind(str, Enum):
    """Artifact kinds the doctor reads. One line per member says what it is."""

    MANIFEST = "bundle-manifest"
    """A crash bundle's manifest.json (``hicache-crash-bundle``)."""
    CAPTURE = "capture-manifest"
    """``hicache capture``'s capture.json: which pid is which rank."""
    STATE = "state"
    """A rank's state.json snapshot."""
    EVENTS = "trace"
    """An events.jsonl trace (the event ring or a --trace file)."""
    RUNTIME_FR = "flight-recorder"
    """The runtime's flight_recorder.json."""
    TORCH_FR = "torch-flight-recorder"
    """A PyTorch Flight Recorder dump (pickle, or its JSON form)."""
    PYSPY_JSON = "pyspy-json"
    """``py-spy dump --json`` output."""
    DIAGNOSIS = "diagnosis"
    """A doctor report (skipped: it is an output, not evidence)."""
    TAR = "tar"
    """A tar archive (optionally gzip/bz2/xz compressed)."""
    GZIP = "gzip"
    """A gzip-compressed single file."""
    HTML = "html"
    """An HTML page (a saved issue or mail): its text is scanned like a log."""
    TEXT = "text"
    """Logs, tracebacks, faulthandler and py-spy text dumps (also pasted in Markdown)."""
    BINARY = "binary"
    """Anything else that is not text."""


_FR_NAME = re.compile(r"(nccl_trace_rank_|fr_trace|flight_recorder_rank|torch_fr)", re.I)


def sniff(name: str, head: bytes) -> Kind:
    """Classify by content first, then by name."""
    lower = name.lower().rsplit("/", 1)[-1].rsplit("!", 1)[-1]
    if head[:2] == b"\x1f\x8b":
        return Kind.TAR if _tar_name(lower) else Kind.GZIP
    if len(head) > 262 and head[257:262] == b"ustar":
        return Kind.TAR
    if head[:3] in (b"BZh", b"\xfd7z") and _tar_name(lower):
        return Kind.TAR
    if head[:1] == b"\x80" and len(head) > 1 and 2 <= head[1] <= 5:
        return Kind.TORCH_FR
    if b"\x00" in head[:8192]:
        return Kind.BINARY
    text = head.lstrip()[:1]
    if text in (b"{", b"["):
        return _json_kind(lower, head)
    if looks_like_html(head):
        return Kind.HTML
    return Kind.TEXT


def _tar_name(lower: str) -> bool:
    return lower.endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".txz"))


def _json_kind(lower: str, head: bytes) -> Kind:
    if b'"hicache-crash-bundle"' in head:
        return Kind.MANIFEST
    if b'"hicache-capture"' in head:
        return Kind.CAPTURE
    if b'"hicache-diagnosis"' in head:
        return Kind.DIAGNOSIS
    if lower.endswith(".jsonl") or (b'"t_ns"' in head and b'"kind"' in head):
        return Kind.EVENTS
    if (b'"entries"' in head and (b'"pg_config"' in head or b'"version"' in head)) \
            or _FR_NAME.search(lower):
        return Kind.TORCH_FR
    if b'"thread_name"' in head and b'"frames"' in head:
        return Kind.PYSPY_JSON
    if lower == "flight_recorder.json" or (b'"seq"' in head and b'"group"' in head):
        return Kind.RUNTIME_FR
    if lower == "state.json" or (b'"tp_rank"' in head and b'"scheduler"' in head):
        return Kind.STATE
    return Kind.TEXT
