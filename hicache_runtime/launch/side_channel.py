"""What ranks and the launcher tell each other through the run directory while a run lasts.

* the dump request (``<run>/DUMP``): created once, exclusively, by whoever sees a failure
  first (a rank's exception or watchdog, or the launcher); every rank's listener then dumps
  its evidence. Its content says who asked, the outcome and why (:class:`DumpRequest`);
* ``<run>/PYSPY_DONE``: the launcher took its py-spy dumps, ranks may unwind;
* rank 0's progress (``<run>/progress.json``), polled by the launcher.

Both the launcher and the rank processes import this module (and not each other).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.run_files import RunDir

ProgressFn = Callable[[int, int, int], None]
_PROGRESS_EVERY_S = 0.2


class DumpRequest(BaseModel):
    """The content of ``<run>/DUMP``. ``by``: the rank that asked, -1 for the launcher."""

    model_config = ConfigDict(extra="ignore")
    by: int
    outcome: RunOutcome
    reason: str
    t: float


def request_dump(run_dir: Path, rank: int, outcome: RunOutcome, reason: str) -> bool:
    """Create the dump request; True if this call created it (first writer wins)."""
    try:
        fd = os.open(RunDir(run_dir).dump, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(_request_json(rank, outcome, reason))
    return True


def _request_json(by: int, outcome: RunOutcome, reason: str) -> str:
    return DumpRequest(by=by, outcome=outcome, reason=reason, t=time.time()).model_dump_json()


_PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
"""gloo's words when the process at the other end of a pair is gone."""


def lost_a_peer(reason: str) -> bool:
    """Whether a rank's dump request says only that a peer went away (a consequence)."""
    return any(m in reason for m in _PEER_LOST)


def blame_dump(run_dir: Path, outcome: RunOutcome, reason: str) -> None:
    """Replace the dump request's outcome and reason with the launcher's (``by`` -1): a rank
    that died without reporting is the cause of the lost connections its peer reported first.
    Atomic: a reader sees the old request or the new one."""
    run = RunDir(run_dir)
    run.dump_tmp.write_text(_request_json(-1, outcome, reason), encoding="utf-8")
    os.replace(run.dump_tmp, run.dump)


def read_dump(run_dir: Path) -> DumpRequest | None:
    """The dump request, once there is one and it is complete (its writer may still be
    writing: then ``None``, like no request yet)."""
    try:
        return DumpRequest.model_validate_json(RunDir(run_dir).dump.read_bytes())
    except (OSError, ValidationError):
        return None


def progress_writer(run_dir: Path) -> ProgressFn:
    """Rank 0's progress callback: writes ``progress.json`` at most every 0.2 s."""
    run = RunDir(run_dir)
    last = [0.0]

    def write(step: int, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > _PROGRESS_EVERY_S:
            last[0] = now
            run.progress_tmp.write_text(json.dumps({"step": step, "finished": done,
                                                    "total": total}))
            os.replace(run.progress_tmp, run.progress)

    return write


def read_progress(run_dir: Path) -> tuple[int, int, int] | None:
    """Rank 0's last (step, finished, total), if it wrote any."""
    try:
        data = json.loads(RunDir(run_dir).progress.read_text())
        return int(data["step"]), int(data["finished"]), int(data["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
