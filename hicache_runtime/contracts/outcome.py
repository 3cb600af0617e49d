"""How a rank ended, from what stopped it: an exception or a process exit code.

One classifier for the single-rank run (in the caller's process) and for rank processes:

* :class:`~hicache_runtime.contracts.errors.StepStalled` is a hang: the step watchdog (or the
  dump listener, through the same interrupt) stopped a scheduler that made no progress;
* a collective or point-to-point op that failed once it had waited its group's whole timeout
  is a hang too. gloo reports its timeout as a plain ``RuntimeError``, so the op is recognised
  by its flight record (attached to the exception by the communication layer: group, start and
  end), not by its message;
* anything else is a crash; a rank divergence always is.

Exceptions are followed through ``raise ... from`` (a worker thread's failure reaches the
scheduler as :class:`~hicache_runtime.contracts.errors.WorkerDied` caused by it).

Exit codes: a rank process exits with :data:`EXIT_OK`, :data:`EXIT_CRASH` or :data:`EXIT_HANG`;
a rank that left no dump and exited non-zero (a signal, an abort) is counted as a crash.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.errors import RankDivergence, StepStalled

EXIT_OK, EXIT_CRASH, EXIT_HANG = 0, 1, 3
FLIGHT_RECORD_ATTR = "flight_record"
"""Attribute a failed communication op's exception carries: its flight record (a dict with
``group``, ``t_start_ns`` and ``t_end_ns``)."""
_NS = 1e9
_CLOCK_SLACK_S = 1e-3


@dataclass(frozen=True)
class CommTimeouts:
    """How long each process group of a rank waits before it gives up, in seconds."""

    default_s: float
    by_group: Mapping[str, float] = field(default_factory=dict)

    def of(self, group: str) -> float:
        return self.by_group.get(group, self.default_s)


def classify(exc: BaseException, timeouts: CommTimeouts | None = None) -> RunOutcome:
    """The outcome of a rank stopped by ``exc``. ``timeouts``: the rank's process groups, when
    it has any (without them no op can have timed out)."""
    if isinstance(exc, RankDivergence):
        return RunOutcome.CRASH
    for e in _causes(exc):
        if isinstance(e, StepStalled):
            return RunOutcome.HANG
        if timeouts is not None and _waited_out(getattr(e, FLIGHT_RECORD_ATTR, None), timeouts):
            return RunOutcome.HANG
    return RunOutcome.CRASH


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it was raised from, each once."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__


def _waited_out(record: Any, timeouts: CommTimeouts) -> bool:
    """The flight record is of an op that ran for its group's whole timeout."""
    if not isinstance(record, Mapping):
        return False
    start, end, group = record.get("t_start_ns"), record.get("t_end_ns"), record.get("group")
    if not isinstance(start, int) or not isinstance(end, int) or not isinstance(group, str):
        return False
    return (end - start) / _NS + _CLOCK_SLACK_S >= timeouts.of(group)


def exit_code(outcome: RunOutcome) -> int:
    """The exit code of a rank process that ended with ``outcome``."""
    return {RunOutcome.HEALTHY: EXIT_OK, RunOutcome.HANG: EXIT_HANG}.get(outcome, EXIT_CRASH)


def classify_exit(code: int | None, otherwise: RunOutcome) -> RunOutcome:
    """The outcome of a rank known only by its exit code (it left no dump): a non-zero exit is
    a crash; a clean exit, or one not known (``None``), takes the run's ``otherwise``."""
    return RunOutcome.CRASH if code not in (None, 0) else otherwise


def describe_exit(code: int | None) -> str:
    """`` (SIGKILL)`` for an exit code that is a signal (negative), else ``""``."""
    if code is None or code >= 0:
        return ""
    try:
        return f" ({signal.Signals(-code).name})"
    except ValueError:
        return ""
