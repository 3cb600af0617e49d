"""Which rank wrote a file, from its path.

File names: ``rank3.log``, ``rank_3/``, ``nccl_trace_rank_3``, ``tp1_pp0.log``, ``TP1-PP0``...
(Per-line rank prefixes are :mod:`doctor.read.text.prefixes`.)
"""

from __future__ import annotations

import re

from doctor.model.evidence import RankHint

_PATH_RANK = re.compile(r"(?:^|[^a-z])(?:rank|nccl_trace_rank|trace_rank|local_rank)[_-]?"
                        r"(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)
_RANK_DIR = re.compile(r"(?i)(rank[_-]?\d+|(tp[_-]?\d+)?[_-]?(pp[_-]?\d+)?|dp\d+[_-]tp\d+)")
_PATH_TP = re.compile(r"(?:^|[^a-z])tp[_-]?(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)
_PATH_PP = re.compile(r"(?:^|[^a-z])pp[_-]?(?P<n>\d{1,6})(?!\d)", re.IGNORECASE)


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
