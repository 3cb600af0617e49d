"""What the report may hold: texts cut with a marker, rank lists summarised as ranges.

The report is drawn from untrusted inputs (a 16 MB frame name, a one-line megabyte exception
message, a manifest claiming every rank of a huge job is missing). Readers already bound what
they keep; this is the last step before anything is printed, so the rich, Markdown and JSON
reports never carry a text over ``MAX_TEXT`` characters (rendering a huge text is what takes
minutes, not holding it) and never list more than ``MAX_LISTED_RANKS`` ranks.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from doctor.model.evidence import clip

MAX_TEXT = 4096
MAX_LISTED_RANKS = 256
MAX_RANGES = 16


def clip_texts(model: BaseModel, limit: int = MAX_TEXT) -> None:
    """Cut every string field of ``model`` (nested models, lists and dict values and keys
    included) to ``limit`` characters, in place."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        clipped = _clipped(value, limit)
        if clipped is not value:
            setattr(model, name, clipped)


def _clipped(value: Any, limit: int) -> Any:
    if isinstance(value, str):
        return clip(value, limit) if len(value) > limit else value
    if isinstance(value, BaseModel):
        clip_texts(value, limit)
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            new = _clipped(item, limit)
            if new is not item:
                value[i] = new
        return value
    if isinstance(value, dict):
        if any(isinstance(k, str) and len(k) > limit for k in value):
            return {_clipped(k, limit): _clipped(v, limit) for k, v in value.items()}
        for k, v in value.items():
            new = _clipped(v, limit)
            if new is not v:
                value[k] = new
        return value
    return value


def rank_ranges(ranks: list[int], max_ranges: int = MAX_RANGES) -> str:
    """Sorted ranks as ranges: ``0-3, 7, 9-65535``; after ``max_ranges`` runs, a count of the
    rest (``..., and 12 more ranks``)."""
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:max_ranges]]
    rest = sum(b - a + 1 for a, b in runs[max_ranges:])
    text = ", ".join(parts)
    if rest:
        text += f", and {rest} more rank(s)"
    total = sum(b - a + 1 for a, b in runs)
    # the count, unless the text already shows every rank one by one
    return text + (f" ({total} ranks)" if rest or len(runs) != total else "")
