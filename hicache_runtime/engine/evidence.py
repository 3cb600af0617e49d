"""The evidence one rank leaves when a run ends: its part of a crash bundle.

``dump_rank`` writes the rank's traceback, all-thread stacks, event ring, flight recorder and
state snapshot into ``<bundle>/rank<N>/`` and describes them in a :class:`RankEntry`. The same
function serves a single-rank run (``run.py``) and every rank of a multi-rank one
(``rank_process.py``); a single rank simply has no flight records and no async sends.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hicache_runtime.contracts.bundle import (
    RankEntry,
    RankFiles,
    RankState,
    RunOutcome,
    rank_dir,
    write_json,
    write_text,
)
from hicache_runtime.contracts.run_files import (
    RANK_DUMP_ERRORS,
    RANK_EVENTS,
    RANK_FLIGHT_RECORDER,
    RANK_STACKS,
    RANK_STATE,
    RANK_STORAGE_CLIENT_LOG,
    RANK_TRACEBACK,
)
from hicache_runtime.engine.rank import RankRuntime

_T = TypeVar("_T")


def dump_rank(bundle: Path, rt: RankRuntime, outcome: RunOutcome, step: int,
              exc: BaseException | None = None, extra: dict[str, Any] | None = None) -> RankEntry:
    """Write this rank's files into ``bundle`` and describe them. Never raises: a dump that
    fails halfway still leaves whatever it managed to write, and says what failed."""
    d = rank_dir(bundle, rt.rank.rank)
    files = RankFiles()
    problems: list[str] = []

    def attempt(name: str, fn: Callable[[], str]) -> None:
        try:
            setattr(files, name, fn())
        except Exception as err:  # evidence collection must not mask the original failure
            problems.append(f"{name}: {type(err).__name__}: {err}")

    if exc is not None:
        attempt("traceback", lambda: write_text(
            d / RANK_TRACEBACK, "".join(traceback.format_exception(exc))))
    if outcome is not RunOutcome.HEALTHY:
        # A rank that finished cleanly has nothing on its stacks worth the risk: the all-thread
        # walk (faulthandler's, unlocked) segfaulted healthy ranks at their final dump on a
        # loaded machine (about 1 in 100 runs), before the final barrier.
        attempt("stacks", lambda: _stacks(d / RANK_STACKS))
    attempt("events", lambda: _events(d / RANK_EVENTS, rt))
    attempt("flight_recorder", lambda: write_json(
        d / RANK_FLIGHT_RECORDER, rt.sync.flight_records()))
    attempt("state", lambda: write_json(d / RANK_STATE, rank_state(rt, step, extra)))
    try:
        _storage_client_log(d, rt)
    except Exception as err:  # as for every file above: the dump goes on
        problems.append(f"storage client log: {type(err).__name__}: {err}")
    error = None if exc is None else f"{type(exc).__name__}: {exc}".splitlines()[0]
    if problems:
        write_text(d / RANK_DUMP_ERRORS, "\n".join(problems) + "\n")
    return RankEntry(rank=rt.rank.rank, tp_rank=rt.rank.tp_rank, pp_rank=rt.rank.pp_rank,
                     pid=os.getpid(), outcome=outcome, error=error, step=step, files=files)


def rank_state(rt: RankRuntime, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rank's ``state.json``: scheduler queues and slots, the cache's snapshot, the live
    threads, async sends still pending (ranks that send any) and the faults that fired."""
    sched = rt.scheduler
    state = RankState(
        rank=rt.rank.rank, tp_rank=rt.rank.tp_rank, pp_rank=rt.rank.pp_rank, step=step,
        scheduler={
            "waiting": [r.rid for r in sched.waiting],
            "slots": [{"running": [r.rid for r in s.running],
                       "chunked": s.chunked_req.rid if s.chunked_req else None,
                       "in_flight": s.in_flight.forward.rids if s.in_flight else None}
                      for s in sched.slots],
            "request_owned_tokens": sched.request_owned_tokens(),
        },
        cache=_safe(rt.cache.snapshot),
        threads=sorted(t.name for t in threading.enumerate()),
    )
    data = state.model_dump()
    pending = _safe(rt.sync.pending_sends)
    if pending is not None:
        data["pending_sends_by_group"] = pending
        data["pending_sends"] = sum(v for v in pending.values() if isinstance(v, int))
    if extra:
        data.update(extra)
    if rt.faults is not None:
        data["faults_fired"] = [f.as_dict() for f in rt.faults.fired]
    return data


def _storage_client_log(d: Path, rt: RankRuntime) -> None:
    """``storage-client.log``: the L3 client library's own log lines, for a backend that keeps
    them (Mooncake's client logs through glog, outside Python logging); the doctor reads the
    store's failures in its words there."""
    l3 = rt.cache.parts().l3
    text = l3.workers.backend.client_log() if l3 is not None else None
    if text:
        write_text(d / RANK_STORAGE_CLIENT_LOG, text)


def _stacks(path: Path) -> str:
    with path.open("w", encoding="utf-8") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=True)
    return f"{path.parent.name}/{path.name}"


def _events(path: Path, rt: RankRuntime) -> str:
    rt.tracer.write_jsonl(path)
    return f"{path.parent.name}/{path.name}"


def _safe(fn: Callable[[], _T]) -> _T | dict[str, Any]:
    try:
        return fn()
    except Exception as err:  # a snapshot taken while the scheduler is stuck may race
        return {"snapshot_error": f"{type(err).__name__}: {err}"}
