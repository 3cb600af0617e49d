"""Structured dumps: PyTorch Flight Recorder pickles, the runtime's flight_recorder.json and
``py-spy dump --json``.

PyTorch FR (format "2.x", NCCL or gloo): ``{version, pg_config, pg_status, entries: [...]}``;
each entry has ``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``,
``profiling_name`` (``gloo:all_reduce``, ``nccl:send 1->2``), ``state``, ``input_sizes`` and
``frames`` (innermost first). gloo dumps key ``pg_config`` differently from the entries' group
names (torch's own analyzer fails on them with a ``KeyError``); here groups are keyed by the
entries' own ``process_group`` and ``pg_config`` is only used for the member list.

Everything tolerates missing or mistyped fields: a bad entry is skipped and counted.
"""

from __future__ import annotations

import ast
from typing import Any

from doctor.evidence import Collective, Frame, RankHint, SourceRef, ThreadStack
from doctor.ranks.builder import EvidenceBuilder
from doctor.ranks.frames import FrameClassifier
from hicache_runtime.errors import DumpFormatError


def read_torch_fr(data: Any, name: str, hint: RankHint, sink: EvidenceBuilder,
                  frames: FrameClassifier) -> int:
    """File one rank's PyTorch FR dump; returns the entries read. ``hint`` must name the rank
    (FR dumps do not say which rank wrote them; the file name does)."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise DumpFormatError("not a Flight Recorder dump (no 'entries' list)")
    slot = sink.slot(hint)
    slot.kinds.add("fr")
    _fr_members(data.get("pg_config"), sink)
    for pg, status in _dict(data.get("pg_status")).items():
        if isinstance(status, dict):
            slot.last_seq[f"pg{pg}"] = {k.replace("_collective", ""): v for k, v in status.items()
                                        if isinstance(v, int)}
    read = 0
    for i, e in enumerate(data["entries"]):
        c = _torch_entry(e, i, SourceRef(name, None), frames)
        if c is not None:
            slot.add_collective(c)
            read += 1
    if read < len(data["entries"]):
        sink.problem(f"{name}: skipped {len(data['entries']) - read} malformed FR entries")
    return read


def _torch_entry(e: Any, index: int, src: SourceRef,
                 frames: FrameClassifier) -> Collective | None:
    if not isinstance(e, dict):
        return None
    pg = e.get("process_group")
    group = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(e.get("pg_id", "?"))
    is_p2p = bool(e.get("is_p2p"))
    seq = e.get("p2p_seq_id" if is_p2p else "collective_seq_id")
    if not isinstance(seq, int):
        return None
    op = str(e.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    stack = [Frame(str(f.get("name", "?")), str(f.get("filename", "?")),
                   f.get("line") if isinstance(f.get("line"), int) else None)
             for f in e.get("frames") or [] if isinstance(f, dict)]
    site = frames.call_site(stack) or frames.innermost_in_app(stack)
    return Collective(group=("p2p:" if is_p2p else "") + group, seq=seq, op=op,
                      state=str(e.get("state", "?")), sizes=_sizes(e.get("input_sizes")),
                      site=site, source=src, thread=str(e.get("thread_name", "")),
                      order=rid if isinstance(rid := e.get("record_id"), int) else index)


_MAX_SIZES_CHARS = 200


def _sizes(value: Any) -> str:
    """``input_sizes`` as text, bounded: a dump may nest shared lists so that ``str()`` of it
    would expand to gigabytes; this walks at most a few hundred items."""
    out: list[str] = []
    budget = [_MAX_SIZES_CHARS]

    def walk(v: Any, depth: int) -> None:
        if budget[0] <= 0:
            return
        if isinstance(v, (list, tuple)) and depth < 4:
            out.append("[")
            budget[0] -= 1
            for i, item in enumerate(v):
                if budget[0] <= 0:
                    break
                if i:
                    out.append(", ")
                walk(item, depth + 1)
            out.append("]")
            return
        text = str(v) if isinstance(v, (int, float, bool)) or v is None else "?"
        out.append(text)
        budget[0] -= len(text) + 2

    walk(value, 0)
    text = "".join(out)
    return text if budget[0] > 0 else text[:_MAX_SIZES_CHARS] + "..."


def _fr_members(pg_config: Any, sink: EvidenceBuilder) -> None:
    """The largest group's member list tells which ranks the job has."""
    for cfg in _dict(pg_config).values():
        ranks = cfg.get("ranks") if isinstance(cfg, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = ast.literal_eval(ranks)
            except (ValueError, SyntaxError):
                ranks = None
        if isinstance(ranks, (list, tuple)) and all(isinstance(r, int) for r in ranks):
            sink.expected_ranks |= {r for r in ranks if 0 <= r < 1 << 16}


def read_runtime_fr(data: Any, name: str, hint: RankHint, sink: EvidenceBuilder) -> int:
    """The runtime's ``flight_recorder.json`` (a list of ``bundle.FlightRecord``)."""
    if not isinstance(data, list):
        raise DumpFormatError("flight_recorder.json must hold a list")
    slot = sink.slot(hint)
    slot.kinds.add("fr")
    read = 0
    for i, e in enumerate(data):
        if not isinstance(e, dict) or not isinstance(e.get("seq"), int):
            continue
        site = _site(str(e.get("site", "")))
        shapes = e.get("shapes", [])
        slot.add_collective(Collective(
            group=str(e.get("group", "?")), seq=e["seq"], op=str(e.get("op", "?")),
            state=str(e.get("state", "?")), sizes=str(shapes), site=site,
            source=SourceRef(name, i + 1), thread=str(e.get("thread", "")),
            peer=_peer(e.get("peer")), order=i))
        read += 1
    return read


def _peer(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 16
    return value if ok else None


def _site(text: str) -> Frame | None:
    """``file.py:123:func`` (the runtime's form), ``file.py:123 func``, ``func (file.py:123)``
    or ``func``."""
    text = text.strip()
    if not text or text == "?":
        return None
    parts = text.split(":")
    if len(parts) >= 3 and parts[-2].isdigit() and len(parts[-2]) <= 9:
        return Frame(parts[-1], ":".join(parts[:-2]), int(parts[-2]))
    if "(" in text and text.endswith(")"):
        func, _, loc = text[:-1].partition(" (")
        file, _, line = loc.rpartition(":")
        return Frame(func, file or loc, int(line) if line.isdigit() and len(line) <= 9 else None)
    loc, _, func = text.partition(" ")
    file, _, line = loc.rpartition(":")
    if line.isdigit() and len(line) <= 9:
        return Frame(func or "?", file, int(line))
    return Frame(text, "?", None)


def read_pyspy_json(data: Any, name: str, hint: RankHint, sink: EvidenceBuilder) -> int:
    """``py-spy dump --json``: a list of threads with frames innermost first."""
    if not isinstance(data, list):
        raise DumpFormatError("py-spy JSON must hold a list of threads")
    slot = sink.slot(hint)
    slot.kinds.add("pyspy")
    read = 0
    for t in data:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        frames = [Frame(str(f.get("name", "?")), str(f.get("filename") or f.get(
            "short_filename") or "?"), f.get("line") if isinstance(f.get("line"), int)
            and f.get("line") > 0 else None) for f in t["frames"] if isinstance(f, dict)]
        pid = t.get("pid") if isinstance(t.get("pid"), int) else None
        slot.threads.append(ThreadStack(
            name=str(t.get("thread_name") or ""), tid=str(t.get("os_thread_id") or
                                                         t.get("thread_id") or "?"),
            frames=frames, source=SourceRef(name, None), origin="pyspy",
            idle=not bool(t.get("active", False)), pid=pid))
        if pid is not None and slot.pid is None:
            slot.pid = pid
        read += 1
    return read


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
