"""Which rank wrote a line or a file.

Line prefixes, possibly stacked (torchrun's prefix before SGLang's):

* torchrun / torch: ``[rank3]:``, ``[default3]:`` (role + local rank), ``[trainer3]:``;
* SGLang: ``[2026-01-15 05:44:28 TP0 PP1 DP0] `` (tags in any order, any subset; EP/CP
  ignored); without tags the line comes from the launcher or tokenizer manager;
* inside NCCL messages: ``[Rank 3]``, ``[PG 0 Rank 3]``.

File names: ``rank3.log``, ``rank_3/``, ``nccl_trace_rank_3``, ``tp1_pp0.log``, ``TP1-PP0``...
"""

from __future__ import annotations

import re

from doctor.evidence import RankHint

_TORCH = re.compile(r"^\[(?:rank|default|trainer|worker|local_rank)(?P<n>\d{1,6})\]:(?: (?=\S))?")
_SGLANG = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d[ T_]\d\d:\d\d:\d\d(?:[.,]\d+)?)"
                     r"(?P<tags>(?: [A-Z][A-Z_]*\d+)*)\] ?")
#: Per-line prefixes that carry no rank (vLLM ``ERROR 02-12 03:41:17 engine.py:135] ``, glog
#: ``E0611 15:51:22.003000 9921 torch/.../api.py:869] ``): stripped so multi-line records parse.
_GENERIC = re.compile(r"^(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "
                      r"[\w.]+:\d+\] ?|[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w./-]+:\d+\] ?)")
_TAG = re.compile(r"(TP|PP|DP)(\d{1,6})\b")
_NCCL_RANK = re.compile(r"\[(?:PG [^\]]*?)?Rank (?P<n>\d{1,6})\]")
_PATH_RANK = re.compile(r"(?:^|[^a-z])(?:rank|nccl_trace_rank|trace_rank|local_rank)[_-]?"
                        r"(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)
_RANK_DIR = re.compile(r"(?i)(rank[_-]?\d+|(tp[_-]?\d+)?[_-]?(pp[_-]?\d+)?|dp\d+[_-]tp\d+)")
_PATH_TP = re.compile(r"(?:^|[^a-z])tp[_-]?(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)
_PATH_PP = re.compile(r"(?:^|[^a-z])pp[_-]?(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)


def strip_prefixes(line: str) -> tuple[str, RankHint, str]:
    """``(rest, hint, style)``: the line without its rank/log prefixes, what they said, and the
    prefix style: ``"torch"`` (every line of a rank carries it), ``"sglang"`` (a log record
    starts here; unprefixed lines that follow continue it), ``"generic"`` (a per-line logger
    prefix without rank) or ``""`` (no prefix)."""
    rank: int | None = None
    tp = pp = dp = None
    style = ""
    for _ in range(3):  # prefixes can stack: [default0]:[2026-... TP0] ...
        m = _TORCH.match(line)
        if m:
            rank = int(m["n"]) if rank is None else rank
            line, style = line[m.end():], "torch"
            continue
        m = _GENERIC.match(line)
        if m:
            line, style = line[m.end():], style or "generic"
            continue
        m = _SGLANG.match(line)
        if m:
            style = style or "sglang"
            for tag, num in _TAG.findall(m["tags"]):
                if tag == "TP":
                    tp = int(num)
                elif tag == "PP":
                    pp = int(num)
                else:
                    dp = int(num)
            line = line[m.end():]
            continue
        break
    if rank is None and tp is None and pp is None:
        m = _NCCL_RANK.search(line)
        if m and ("NCCL" in line or "Watchdog" in line):
            rank = int(m["n"])
    return line, RankHint(rank=rank, tp=tp, pp=pp, dp=dp), style


def path_hint(path: str) -> RankHint:
    """What a file path says about its rank: the file name (``rank3.log``, ``pyspy-tp0.txt``,
    ``nccl_trace_rank_3``) or a directory named after the rank (``rank3/stacks.txt``,
    ``tp1_pp0/``); other directory names (``run-tp8/``) never count."""
    rank = tp = pp = None
    parts = re.split(r"[/\\!]", path)
    dirs = [p for p in parts[:-1] if _RANK_DIR.fullmatch(p)][-1:]
    for part in [*dirs, parts[-1]]:
        m = _PATH_RANK.search(part)
        if m:
            rank = int(m["n"])
        m_tp, m_pp = _PATH_TP.search(part), _PATH_PP.search(part)
        if m_tp:
            tp = int(m_tp["n"])
        if m_pp:
            pp = int(m_pp["n"])
    return RankHint(rank=rank, tp=tp, pp=pp)
