"""The event loop of one rank and the evidence it leaves when something goes wrong.

``Engine.run`` drives the workload through the scheduler and the model step by step, fires the
scheduler-thread fault points, keeps the step watchdog fed, and at the end drains every
transfer and checks pool/tree integrity. ``dump_rank`` writes one rank's part of a crash bundle
(traceback, all-thread stacks, event ring, flight recorder, state snapshot).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.points import FaultPoint
from faults.spec import FaultKind
from hicache_runtime.cache.accounting import check_at_drain
from hicache_runtime.contracts.bundle import (
    RankEntry,
    RankFiles,
    RankState,
    RunOutcome,
    rank_dir,
    write_json,
    write_text,
)
from hicache_runtime.contracts.errors import InjectedFault
from hicache_runtime.contracts.events import Ev
from hicache_runtime.engine.rank import RankRuntime
from hicache_runtime.engine.workload import Workload
from hicache_runtime.kv.request import Req, ReqStatus

#: Sleep when a step had nothing to run but work is pending (background copies/IO).
_IDLE_SLEEP_S = 0.0005


@dataclass
class EngineResult:
    """What one rank's loop produced."""

    reqs: dict[str, Req]
    steps: int
    wall_s: float

    @property
    def outputs(self) -> dict[str, list[int]]:
        return {rid: list(r.output_ids) for rid, r in self.reqs.items()}

    @property
    def completed(self) -> int:
        return sum(1 for r in self.reqs.values() if r.status is ReqStatus.FINISHED)

    @property
    def aborted(self) -> int:
        return sum(1 for r in self.reqs.values() if r.status is ReqStatus.ABORTED)

    def cached_tokens(self) -> dict[str, int]:
        out = {"device": 0, "host": 0, "storage": 0}
        for r in self.reqs.values():
            for k in out:
                out[k] += r.cached[k]
        return out


@dataclass
class Engine:
    """Runs one rank to completion. Scheduler thread = the thread calling :meth:`run`."""

    rt: RankRuntime
    workload: Workload
    on_step: Callable[[int, int, int], None] | None = None
    """Called after each step with (step, finished, total) (progress bars)."""
    heartbeat: Callable[[], None] = field(default=lambda: None)
    step: int = 0

    def run(self) -> EngineResult:
        rt, sched = self.rt, self.rt.scheduler
        finished: dict[str, Req] = {}
        all_reqs: dict[str, Req] = {}
        start = time.monotonic()
        every = rt.cfg.observability.check_integrity_every
        while True:
            self.step += 1
            rt.tracer.step = self.step
            self._fault_point(FaultPoint.SCHEDULER_STEP)
            arrivals = self.workload.poll(self.step, finished)
            for req in arrivals:
                all_reqs[req.rid] = req
                sched.add_request(req)
            for rid in self.workload.aborts(self.step):
                sched.abort(rid)
            for rid, applied in rt.aborts.take():
                sched.abort(rid)
                applied.set()
            self._fault_point(FaultPoint.CACHE_EVENTS)
            batch = sched.next_batch(self.step)
            if batch is not None:
                self._fault_point(FaultPoint.FORWARD)
                tokens = rt.model.forward(batch.forward, rt.device_pool)
                sched.process_result(batch, tokens)
            for req in sched.finished:
                finished[req.rid] = req
            sched.finished.clear()
            if batch is not None or arrivals or not sched.has_work:
                self.heartbeat()
            if every and self.step % every == 0:
                sched.check_integrity()
            if self.on_step is not None:
                self.on_step(self.step, len(finished), self.workload.total)
            if not sched.has_work and self.workload.exhausted():
                break
            if batch is None and sched.has_work:
                time.sleep(_IDLE_SLEEP_S)
        self._drain()
        return EngineResult(all_reqs, self.step, time.monotonic() - start)

    def _drain(self) -> None:
        drain = getattr(self.rt.cache, "drain", None)
        if drain is not None:
            drain()
        check_at_drain(self.rt.cache)
        self.rt.tracer.emit(Ev.INTEGRITY, ok=True, at="drain")

    def _fault_point(self, point: FaultPoint) -> None:
        faults = self.rt.faults
        if faults is None or not faults.armed(point):
            return
        for spec in faults.fire(point, step=self.step):
            if spec.kind is FaultKind.STAGE_LAG:
                time.sleep(spec.lag_s)
            elif spec.kind is FaultKind.CRASH:
                raise InjectedFault(f"injected crash at {point.value} (step {self.step})")
            elif spec.kind is FaultKind.HANG:
                threading.Event().wait()
            elif spec.kind is FaultKind.RANK_KILL:
                os.kill(os.getpid(), signal.SIGKILL)


# --- evidence --------------------------------------------------------------------------------


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
            d / "traceback.txt", "".join(traceback.format_exception(exc))))
    if outcome is not RunOutcome.HEALTHY:
        # A rank that finished cleanly has nothing on its stacks worth the risk: the all-thread
        # walk (faulthandler's, unlocked) segfaulted healthy ranks at their final dump on a
        # loaded machine (about 1 in 100 runs), before the final barrier.
        attempt("stacks", lambda: _stacks(d / "stacks.txt"))
    attempt("events", lambda: _events(d / "events.jsonl", rt))
    attempt("flight_recorder", lambda: write_json(
        d / "flight_recorder.json", getattr(rt.sync, "flight_records", lambda: [])()))
    attempt("state", lambda: write_json(d / "state.json", rank_state(rt, step, extra)))
    error = None if exc is None else f"{type(exc).__name__}: {exc}".splitlines()[0]
    if problems:
        write_text(d / "dump_errors.txt", "\n".join(problems) + "\n")
    return RankEntry(rank=rt.rank.rank, tp_rank=rt.rank.tp_rank, pp_rank=rt.rank.pp_rank,
                     pid=os.getpid(), outcome=outcome, error=error, step=step, files=files)


def rank_state(rt: RankRuntime, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
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
    pending = getattr(rt.sync, "pending_sends", None)
    if pending is not None:
        data["pending_sends_by_group"] = _safe(pending)
        data["pending_sends"] = sum(v for v in data["pending_sends_by_group"].values()
                                    if isinstance(v, int))
    if extra:
        data.update(extra)
    if rt.faults is not None:
        data["faults_fired"] = [f.as_dict() for f in rt.faults.fired]
    return data


def _stacks(path: Path) -> str:
    with path.open("w", encoding="utf-8") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=True)
    return f"{path.parent.name}/{path.name}"


def _events(path: Path, rt: RankRuntime) -> str:
    rt.tracer.write_jsonl(path)
    return f"{path.parent.name}/{path.name}"


def _safe(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:  # a snapshot taken while the scheduler is stuck may race
        return {"snapshot_error": f"{type(err).__name__}: {err}"}
