"""What one rank reports at its end (``<run>/rank<N>.result.json``): outcome, outputs, counters.

Each rank process writes its :class:`RankResult` (atomically); the launcher reads it back with
:func:`read_rank_result`, bounded and validated, so a truncated or foreign file is a clear
:class:`~hicache_runtime.contracts.errors.DumpFormatError` instead of a ``KeyError`` later on.
A single-rank run builds the same model in process, so both paths are summarised alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hicache_runtime.contracts.bundle import FiredFaultRecord, RunOutcome
from hicache_runtime.contracts.errors import DumpFormatError, first_problem

MAX_RESULT_BYTES = 256 << 20
"""A result holds every request's tokens: tens of MB for the largest workloads; a file larger
than this is not a result."""


class RequestResult(BaseModel):
    """One request as the rank finished it."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[int]
    output_ids: list[int]
    status: str
    """A ``ReqStatus`` value (``finished``, ``aborted``...)."""
    abort_reason: str | None = None
    cached: dict[str, int] = {}
    """Prompt tokens served from each tier (device, host, storage)."""


class RankResult(BaseModel):
    """One rank's end of run. ``stats`` are the raw cache counters (``RankCacheStats`` reads
    them); ``drain`` the page accounting (``DrainAccount``) when the rank got to its drain."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    tp_rank: int
    pp_rank: int
    outcome: RunOutcome
    error: str | None = None
    steps: int = 0
    wall_s: float | None = None
    requests: dict[str, RequestResult] = {}
    stats: dict[str, Any] = {}
    faults_fired: list[FiredFaultRecord] = []
    drain: dict[str, int] | None = None


def write_rank_result(path: Path, result: RankResult) -> None:
    """Write ``result`` atomically (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(result.model_dump_json(), encoding="utf-8")
    os.replace(tmp, path)


def read_rank_result(path: Path, limit: int = MAX_RESULT_BYTES) -> RankResult | None:
    """The result at ``path``; ``None`` when there is none (the rank never got to write it).
    A file that is too large, not JSON or not a result raises ``DumpFormatError``."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DumpFormatError(f"{path.name}: unreadable: {exc}") from exc
    if len(raw) > limit:
        raise DumpFormatError(f"{path.name}: larger than {limit} bytes")
    try:
        return RankResult.model_validate_json(raw)
    except ValidationError as exc:
        where, what = first_problem(exc)
        raise DumpFormatError(f"{path.name}: not a rank result ({where or 'file'}: {what}; "
                              f"{exc.error_count()} error(s))") from exc
