"""Structured dumps: PyTorch Flight Recorder pickles, the runtime's flight_recorder.json and
``py-spy dump --json``.

PyTorch FR (format "2.x", NCCL or gloo): ``{version, pg_config, pg_status, entries: [...]}``;
each entry has ``process_group`` (name, desc), ``collective_seq_id``, ``p2p_seq_id``,
``profiling_name`` (``gloo:all_reduce``, ``nccl:send 1->2``), ``state``, ``input_sizes`` and
``frames`` (innermost first). gloo dumps key ``pg_config`` differently from the entries' group
names (torch's own analyzer fails on them with a ``KeyError``); here groups are keyed by the
entries' own ``process_group`` and ``pg_config`` is only used for the member list.

Everything tolerates missing or mistyped fields: a bad entry is skipped and counted.

A dump is untrusted input and a pickle can share one object many times (a list of a thousand
references to a list of a thousand references...), so nothing here calls ``str()`` on a value
of unknown shape: scalars are formatted, strings are cut (:func:`_text`), sizes are walked with a
budget (:func:`_sizes`), and entries and frames are read up to fixed counts (``MAX_FR_ENTRIES``,
``MAX_FRAMES``), so the work per dump is bounded whatever it holds.
"""

from __future__ import annotations

from typing import Any

from doctor.model.builder import MAX_WORLD, EvidenceBuilder
from doctor.model.evidence import (
    MAX_THREADS,
    Collective,
    Frame,
    RankHint,
    SourceRef,
    ThreadStack,
    clip,
)
from doctor.model.frames import FrameClassifier
from hicache_runtime.contracts.errors import DumpFormatError

MAX_FR_ENTRIES = 20_000
"""Entries read per dump (torch keeps 2,000 by default); the newest are read."""
MAX_FRAMES = 128
"""Frames read per entry or thread, innermost first."""
MAX_TEXT = 512
"""Characters kept of a name, state, group or file name."""
MAX_RANKS_TEXT = 1 << 20
"""Longest ``pg_config`` ranks string parsed (65,536 ranks written out fit in well under it)."""
_MAX_SIZES_CHARS = 200


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
    entries = data["entries"]
    skip = max(0, len(entries) - MAX_FR_ENTRIES)
    if skip:
        sink.problem(f"{name}: {len(entries)} FR entries; the oldest {skip} were not read")
    read = 0
    for i in range(skip, len(entries)):
        c = _torch_entry(entries[i], i, SourceRef(name, None), frames)
        if c is not None:
            slot.add_collective(c)
            read += 1
    if read < len(entries) - skip:
        sink.problem(f"{name}: skipped {len(entries) - skip - read} malformed FR entries")
    return read


def _torch_entry(e: Any, index: int, src: SourceRef,
                 frames: FrameClassifier) -> Collective | None:
    if not isinstance(e, dict):
        return None
    pg = e.get("process_group")
    group = _text(pg[0]) if isinstance(pg, (list, tuple)) and pg else _text(e.get("pg_id", "?"))
    is_p2p = bool(e.get("is_p2p"))
    seq = e.get("p2p_seq_id" if is_p2p else "collective_seq_id")
    if not isinstance(seq, int):
        return None
    op = _text(e.get("profiling_name", "?")).split(":", 1)[-1].split(" ", 1)[0]
    raw_frames = e.get("frames")
    stack = [_frame(f.get("name"), f.get("filename"), f.get("line"))
             for f in (raw_frames[:MAX_FRAMES] if isinstance(raw_frames, list) else ())
             if isinstance(f, dict)]
    site = frames.call_site(stack) or frames.innermost_in_app(stack)
    return Collective(group=("p2p:" if is_p2p else "") + group, seq=seq, op=op,
                      state=_text(e.get("state", "?")), sizes=_sizes(e.get("input_sizes")),
                      site=site, source=src,
                      order=rid if isinstance(rid := e.get("record_id"), int) else index)


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    """A string field as text, bounded; a scalar formatted; anything else ``?`` (``str()`` of a
    container with shared references can expand a few bytes of pickle into gigabytes)."""
    if isinstance(value, str):
        return clip(value, limit)
    if value is None or isinstance(value, (bool, int, float)):
        text = str(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else "?"
        return text[:limit]
    return "?"


def _frame(name: Any, filename: Any, line: Any) -> Frame:
    ok = isinstance(line, int) and not isinstance(line, bool) and 0 < line < 1 << 31
    return Frame(_text(name if name is not None else "?"),
                 _text(filename if filename is not None else "?"), line if ok else None)


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
        text = _text(v, 32) if not isinstance(v, str) else "?"
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
            ranks = parse_rank_list(ranks)
        if isinstance(ranks, (list, tuple)) and len(ranks) <= MAX_WORLD \
                and all(isinstance(r, int) for r in ranks):
            for r in ranks:
                sink.add_expected_rank(r)


def parse_rank_list(text: str) -> list[int] | None:
    """``"[0, 1, 2]"`` (how torch writes ``pg_config.ranks``) as a list of ints, else ``None``.
    Only a bracketed, comma-separated list of non-negative decimal ints is accepted, of bounded
    length: never an expression (``ast.literal_eval`` of ``"1+1+..."`` runs out of memory)."""
    if len(text) > MAX_RANKS_TEXT:
        return None
    body = text.strip()
    if len(body) < 2 or body[0] + body[-1] not in ("[]", "()"):
        return None
    body = body[1:-1].strip()
    if not body:
        return []
    items = body.split(",")
    if len(items) > 1 and not items[-1].strip():  # "(0,)"
        items.pop()
    if len(items) > MAX_WORLD:
        return None
    out: list[int] = []
    for item in items:
        item = item.strip()
        if not (item.isascii() and item.isdigit()) or len(item) > 9:
            return None
        out.append(int(item))
    return out


def read_runtime_fr(data: Any, name: str, hint: RankHint, sink: EvidenceBuilder) -> int:
    """The runtime's ``flight_recorder.json`` (a list of ``bundle.FlightRecord``)."""
    if not isinstance(data, list):
        raise DumpFormatError("flight_recorder.json must hold a list")
    slot = sink.slot(hint)
    slot.kinds.add("fr")
    read = 0
    skip = max(0, len(data) - MAX_FR_ENTRIES)
    for i in range(skip, len(data)):
        e = data[i]
        if not isinstance(e, dict) or not isinstance(e.get("seq"), int):
            continue
        site = _site(_text(e.get("site", "")))
        slot.add_collective(Collective(
            group=_text(e.get("group", "?")), seq=e["seq"], op=_text(e.get("op", "?")),
            state=_text(e.get("state", "?")), sizes=_sizes(e.get("shapes", [])), site=site,
            source=SourceRef(name, i + 1), peer=_peer(e.get("peer")), order=i))
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
    for t in data[:MAX_THREADS]:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        frames = [_frame(f.get("name"), f.get("filename") or f.get("short_filename"),
                         f.get("line")) for f in t["frames"][:MAX_FRAMES] if isinstance(f, dict)]
        pid = t.get("pid") if _is_id(t.get("pid")) else None
        tid = t.get("os_thread_id") or t.get("thread_id") or "?"
        slot.threads.append(ThreadStack(
            name=_text(t.get("thread_name") or ""), tid=_text(tid, 64), frames=frames,
            source=SourceRef(name, None), origin="pyspy", idle=not bool(t.get("active", False)),
            pid=pid))
        if pid is not None and slot.pid is None:
            slot.pid = pid
        read += 1
    return read


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
