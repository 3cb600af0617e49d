"""How a run ends, for the launcher of one group and the DP controller alike.

* :func:`judge_end`: the outcome once every rank has exited: the failure a rank (or the
  launcher) asked the dump for, else healthy, unless a rank exited cleanly but left a result
  that cannot be read (then nothing can be judged: a crash, with a bundle of what is there);
* :func:`abandon_run`: the cleanup when the launcher itself is stopped (an interrupt, an
  error of ours): no rank and no run directory left behind, the bundle salvaged by the caller
  named on stderr and on the :class:`Interrupted` the caller re-raises.
"""

from __future__ import annotations

import shutil
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.launch import zygote
from hicache_runtime.launch.bundles import kept_bundle
from hicache_runtime.launch.side_channel import DumpRequest


class Interrupted(KeyboardInterrupt):
    """A signal asked the launcher to stop (Ctrl-C, SIGTERM, SIGHUP). A KeyboardInterrupt, so
    callers treat every one like Ctrl-C; ``bundle`` is the evidence kept, if any."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.bundle: Path | None = None


@dataclass(frozen=True)
class RunEnd:
    outcome: RunOutcome
    error: str | None
    bundle: Path | None
    bundle_error: str | None


def judge_end(request: DumpRequest | None, unreadable: Mapping[int, str], bundle: Path | None,
              bundle_error: str | None,
              write_bundle: Callable[[RunOutcome, str], Path]) -> RunEnd:
    """The run's end from the dump request (None: nobody asked), the ranks whose results
    cannot be read, and the bundle collected for the request; ``write_bundle(outcome,
    reason)`` writes one when a clean exit left an unreadable result."""
    if request is not None:
        return RunEnd(request.outcome, request.reason, bundle, bundle_error)
    if not unreadable:
        return RunEnd(RunOutcome.HEALTHY, None, bundle, bundle_error)
    r, why = min(unreadable.items())
    error = f"rank {r}: {why}"
    kept, problem = kept_bundle(lambda: write_bundle(RunOutcome.CRASH, error))
    return RunEnd(RunOutcome.CRASH, error, kept, problem)


def abandon_run(exc: BaseException, run_dir: Path, kept: Path | None) -> None:
    """After the ranks were stopped and the bundle salvaged: remove the run directory, and
    say where the bundle is. A rank forked but not yet known to the caller (the signal came
    while ranks started) would write into the run directory after it is removed: its zygote
    takes it along."""
    zygote.close_shared()
    shutil.rmtree(run_dir, ignore_errors=True)
    if isinstance(exc, Interrupted):
        exc.bundle = kept
    if kept is not None:
        sys.stderr.write(f"hicache: {exc or type(exc).__name__}; the run's bundle is kept at "
                         f"{kept}\n")
