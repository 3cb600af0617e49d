"""The DP controller: parent of the ``dp × pp × tp`` rank grid and owner of the request stream.

``hicache run --dp N`` runs it in the process that would otherwise run the launcher. It starts
every DP group's ranks as its own children and then, until every rank has exited:

* generates the run's workload with the run's seed
  (:class:`~hicache_runtime.engine.workload.Workload`) on its own clock, the step every group's
  entry rank has reached (read from the load board). Groups report each request they finish,
  so a chat's next turn is built from the reply, as in a run of one group;
* routes each request by policy (:class:`~hicache_runtime.launch.dp_routing.Router`: round
  robin, or shortest queue from the load board with a speculative +1 per dispatch and a
  refresh at most every 20 ms); an external router's choice (``routed_dp_rank``) goes straight
  through. The request goes to its group's entry rank (PP0, TP0) over that group's pipe, and
  on into the group's existing intake (:mod:`hicache_runtime.launch.dp_intake`);
* sends client aborts and the end of the stream to each group's entry rank (control
  messages), whose step exchange copies them to its peers;
* watches every rank. The first failure anywhere (a rank's dump request, a rank that died, no
  progress) is broadcast to every worker of every group (the dump request, a global message),
  so the one bundle of the run holds every group's ranks
  (:mod:`hicache_runtime.launch.dp_bundle`).

Every routing decision is an ``Ev.DP_ROUTE`` event and every control message and broadcast an
``Ev.DP_CONTROL`` in the controller's own event ring (rank -1 in its events; with ``--trace
run.jsonl`` also ``run.controller.jsonl``); each entry rank records what it received
(``Ev.DP_RECEIVE``).

Why one torch.distributed world per DP group, not one world with a subgroup per group: inside
its own world a group's ranks are numbered, grouped and synchronised exactly as the ranks of a
run of one group (rank 0 reads the requests, ``stage_ranks`` and every protocol collective,
the final barrier included, address the group alone), so the TP × PP code runs unchanged. One
world would renumber every peer and turn each world collective into a subgroup's. Groups share
nothing but the controller and the L3 store, as upstream's DP groups do. Each has its own
rendezvous store, its own run directory (``<run>/dp<d>/``, laid out as
:mod:`hicache_runtime.contracts.run_files` says) and its own side channel.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hicache_runtime.config import RuntimeConfig
from hicache_runtime.contracts import pyspy
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.outcome import classify_exit, describe_exit
from hicache_runtime.contracts.rank_result import RankResult
from hicache_runtime.contracts.run_files import DP_SIZE_ENV, RunDir
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.engine.workload import Workload
from hicache_runtime.kv.request import Req
from hicache_runtime.launch.bundles import RankExit, kept_bundle
from hicache_runtime.launch.dp_bundle import group_dir, has_rank_dumps, write_dp_bundle
from hicache_runtime.launch.dp_intake import (
    ENV_BOARD,
    ENV_DP_RANK,
    ENV_FEED_FD,
    Abort,
    EndOfStream,
    FromGroup,
    Routed,
    ToGroup,
)
from hicache_runtime.launch.dp_routing import LoadBoard, MessageKind, Policy, Router, recipients
from hicache_runtime.launch.ending import abandon_run, judge_end
from hicache_runtime.launch.launcher import (
    SELF_EXIT_S,
    STARTUP_ALLOWANCE_S,
    LaunchResult,
    RankProcess,
    exits_of,
    kill_all,
    read_results,
    rendezvous_store,
    signals_interrupt,
    start_ranks,
    wait_exit,
)
from hicache_runtime.launch.side_channel import DumpRequest, ProgressFn, read_dump, request_dump
from hicache_runtime.telemetry.perfetto import CONTROLLER_RANK
from hicache_runtime.telemetry.tracer import Tracer

ExternalRouter = Callable[[Req], int | None]
"""A router in front of the controller (prefill/decode disaggregation, say): the DP group it
chose for a request (``routed_dp_rank``), or None to leave the choice to the policy."""

_WAIT_S = 0.002
"""Longest wait for a group's report between two rounds of routing and watching."""
_POLL_S = 0.05


@dataclass
class DPLaunchResult(LaunchResult):
    """A finished run of several DP groups: results and exit codes keyed by grid rank."""

    controller_events: list[dict[str, Any]] = field(default_factory=list)

    def bundle_as(self, outcome: RunOutcome, reason: str, bundle_root: Path,
                  mismatches: list[dict[str, Any]]) -> Path:
        return write_dp_bundle(self.run_dir, self.cfg, bundle_root, outcome, reason,
                               {r: RankExit(r, c) for r, c in self.exit_codes.items()}, {},
                               mismatches, self.controller_events)


@dataclass
class _Group:
    """One DP group as the controller holds it."""

    index: int
    run: RunDir
    first: int
    """Grid rank of the group's entry rank (its rank 0)."""
    store: dist.TCPStore | None
    """The group's rendezvous store, held until its ranks are gone."""
    conn: Connection | None
    """The controller's end of the group's pipe; None once the entry rank is gone."""
    procs: dict[int, RankProcess] = field(default_factory=dict)
    """The group's rank processes by rank in the group."""


def launch_dp(cfg: RuntimeConfig, *, bundle_root: Path, caps: dict[str, int] | None = None,
              progress: ProgressFn | None = None,
              external_router: ExternalRouter | None = None) -> DPLaunchResult:
    """Run ``cfg`` (``topology.dp > 1``) as its DP groups under this process; returns when
    every rank has exited. The caller must ``cleanup()`` the result. Raising (an interrupt
    included), it leaves no rank and no run directory behind."""
    with signals_interrupt() as quiet:
        run_dir = Path(tempfile.mkdtemp(prefix="hicache-run-"))
        ctl: DPController | None = None
        bundle: Path | None = None
        try:
            start = time.monotonic()
            ctl = DPController(cfg, run_dir, caps=caps, external_router=external_router)
            request: DumpRequest | None = None
            try:
                ctl.start()
                bundle_error: str | None = None
                if ctl.serve(progress):
                    bundle, request, bundle_error = ctl.collect_bundle(bundle_root)
            finally:
                ctl.stop()
            results, unreadable = ctl.results()
            exits, events = ctl.exits(), ctl.tracer.events()
            end = judge_end(request, unreadable, bundle, bundle_error,
                            lambda outcome, reason: write_dp_bundle(
                                run_dir, cfg, bundle_root, outcome, reason, exits, {}, [],
                                events))
            return DPLaunchResult(end.outcome, end.error, end.bundle, results,
                                  time.monotonic() - start, run_dir, cfg,
                                  {r: x.returncode for r, x in exits.items()}, unreadable,
                                  bundle_error=end.bundle_error, controller_events=events)
        except BaseException as exc:
            quiet()  # a second Ctrl-C must not cut the cleanup short
            kept = bundle
            if ctl is not None:
                ctl.stop()
                kept = kept or ctl.salvage(bundle_root, exc)
            abandon_run(exc, run_dir, kept)
            raise


class DPController:
    """Starts the DP groups, routes the request stream to them and watches them (module
    notes). One per run; :meth:`stop` releases everything it holds."""

    def __init__(self, cfg: RuntimeConfig, run_dir: Path, *, caps: dict[str, int] | None = None,
                 external_router: ExternalRouter | None = None) -> None:
        t, obs = cfg.topology, cfg.observability
        self.cfg = cfg
        self.run_dir = run_dir
        self.per_group = t.world_size
        self.board = LoadBoard(t.dp, create=True)
        self.router = Router(t.dp, Policy(t.dp_policy),
                             read_loads=self.board.loads_received)
        self.workload = Workload(cfg.workload, cfg.model.vocab_size, cfg.seed,
                                 client_aborts=not caps, caps=dict(caps or {}))
        self.tracer = Tracer(RankInfo(CONTROLLER_RANK, 0, 0, t.tp, t.pp, 0, t.dp),
                             ring_size=obs.ring_size, enabled=obs.tracing,
                             jsonl_path=_trace_path(cfg, "controller"))
        self.external_router = external_router
        self.groups: list[_Group] = []
        self.finished: dict[str, Req] = {}
        """Requests the groups finished, as the workload reads them (follow-up turns)."""
        self.clock = 0
        """The step every live group's entry rank has reached: the stream's clock."""
        self.request: DumpRequest | None = None
        """The failure broadcast to every group, once there is one."""
        self._polled = 0
        self._ready = False
        self._ended = False
        self._stopped = False

    # --- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        """Start every group's ranks: its own rendezvous store, run directory and pipe."""
        for d in range(self.cfg.topology.dp):
            path = group_dir(self.run_dir, d)
            path.mkdir()
            run = RunDir(path)
            gcfg = _group_config(self.cfg, d)
            run.config.write_text(gcfg.model_dump_json(), encoding="utf-8")
            ours, theirs = multiprocessing.Pipe()
            store = rendezvous_store(self.per_group)
            group = _Group(d, run, d * self.per_group, store, ours)
            self.groups.append(group)
            try:
                group.procs = start_ranks(
                    gcfg, path, store.port, first_device=group.first,
                    env={ENV_DP_RANK: str(d), DP_SIZE_ENV: str(self.cfg.topology.dp),
                         ENV_BOARD: self.board.name},
                    entry_env={ENV_FEED_FD: str(theirs.fileno())}, entry_fds=(theirs.fileno(),))
            finally:
                theirs.close()  # the entry rank holds its end: EOF here once it is gone

    def stop(self) -> None:
        """Stop every rank (idempotent) and release the pipes, stores and load board."""
        kill_all(self.procs())
        if self._stopped:
            return
        self._stopped = True
        for g in self.groups:
            if g.conn is not None:
                g.conn.close()
                g.conn = None
        for g in self.groups:
            g.store = None  # the ranks are gone: nobody talks to it any more
        self.board.close()
        self.tracer.close()

    def procs(self) -> dict[int, RankProcess]:
        """Every rank process by grid rank."""
        return {g.first + r: p for g in self.groups for r, p in g.procs.items()}

    def exits(self) -> dict[int, RankExit]:
        return exits_of(self.procs())

    def results(self) -> tuple[dict[int, RankResult], dict[int, str]]:
        """Every rank's result and every unreadable one, by grid rank."""
        results: dict[int, RankResult] = {}
        unreadable: dict[int, str] = {}
        for g in self.groups:
            got, bad = read_results(g.run.path, g.procs)
            results.update({g.first + r: x for r, x in got.items()})
            unreadable.update({g.first + r: why for r, why in bad.items()})
        return results, unreadable

    # --- the run -----------------------------------------------------------------------------

    def serve(self, progress: ProgressFn | None = None) -> bool:
        """Route and watch until every rank has exited (False) or something failed (True:
        every group has been asked to dump its evidence)."""
        obs = self.cfg.observability
        stale_after = obs.watchdog_timeout_s + obs.protocol_timeout_s + 10.0
        last_change, last_state = time.monotonic() + STARTUP_ALLOWANCE_S, (-1, -1)
        next_watch = 0.0
        while True:
            self._pump()
            now = time.monotonic()
            if now >= next_watch:  # routing needs milliseconds; watching, the launcher's pace
                next_watch = now + _POLL_S
                codes = {r: p.poll() for r, p in self.procs().items()}
                if all(c == 0 for c in codes.values()):
                    return False
                if self._failed(codes):
                    return True
                state = (self.clock, len(self.finished))
                if state != last_state:
                    last_state, last_change = state, max(last_change, now)
                    if progress is not None:
                        progress(self.clock, len(self.finished), self.workload.total)
                elif now - last_change > stale_after:
                    self._broadcast_dump(DumpRequest(
                        by=CONTROLLER_RANK, outcome=RunOutcome.HANG, t=time.time(),
                        reason=f"DP controller: no progress from any DP group for "
                               f"{stale_after:.0f}s"))
                    return True
            self._wait()

    def _pump(self) -> None:
        """One round: take the groups' reports, advance the clock, route what is due. Nothing
        is routed before every group is ready (its entry rank wrote the board once), as
        upstream's controller waits for every scheduler: a group still starting would take
        requests it cannot serve yet, and its empty queue would draw the shortest-queue policy
        to it."""
        for g in self.groups:
            self._read_reports(g)
        board = self.board.snapshot()
        if not self._ready:
            self._ready = all(slot.written_ns for slot in board)
            if not self._ready:
                return
        live = [board[g.index].step for g in self.groups if g.procs[0].poll() is None]
        if live:
            self.clock = max(self.clock, min(live))
        while self._polled < max(self.clock, 1):
            self._polled += 1
            self.tracer.step = self._polled
            for req in self.workload.poll(self._polled, self.finished):
                self._route(req)
            for rid in self.workload.aborts(self._polled):
                self._control(Abort(rid), "abort", rid=rid)
        if not self._ended and self.workload.exhausted():
            self._ended = True
            self._control(EndOfStream(), "end")

    def _route(self, req: Req) -> None:
        t = self.cfg.topology
        pinned = self.external_router(req) if self.external_router is not None else None
        decision = self.router.route(pinned)
        self._send(self.groups[decision.group], Routed.of(req, decision.reason, decision.loads))
        to = recipients(MessageKind.GENERATE, dp=t.dp, pp=t.pp, tp=t.tp, group=decision.group)
        self.tracer.emit(Ev.DP_ROUTE, rid=req.rid, group=decision.group, reason=decision.reason,
                         loads=list(decision.loads), board=self.board.loads(), to=to)

    def _control(self, msg: ToGroup, what: str, **attrs: Any) -> None:
        """A control message: to each group's entry rank."""
        t = self.cfg.topology
        for g in self.groups:
            self._send(g, msg)
        self.tracer.emit(Ev.DP_CONTROL, what=what, kind=MessageKind.CONTROL.value,
                         to=recipients(MessageKind.CONTROL, dp=t.dp, pp=t.pp, tp=t.tp), **attrs)

    def _send(self, g: _Group, msg: ToGroup) -> None:
        if g.conn is None:
            return  # the entry rank is gone; its exit is what the watch reports
        try:
            g.conn.send(msg)
        except OSError:
            g.conn.close()
            g.conn = None

    def _read_reports(self, g: _Group) -> None:
        if g.conn is None:
            return
        try:
            while g.conn.poll(0):
                report: FromGroup = g.conn.recv()
                for done in report:
                    self.finished[done.rid] = done.as_req(self.clock)
        except (EOFError, OSError):
            g.conn.close()
            g.conn = None

    def _wait(self) -> None:
        conns = [g.conn for g in self.groups if g.conn is not None]
        if conns:
            multiprocessing.connection.wait(conns, timeout=_WAIT_S)
        else:
            time.sleep(_WAIT_S)

    # --- failure -------------------------------------------------------------------------------

    def _failed(self, codes: dict[int, int | None]) -> bool:
        """True once a group asked for a dump or a rank died; the request is then broadcast."""
        for g in self.groups:
            asked = read_dump(g.run.path)
            if asked is not None:
                by = g.first + asked.by if asked.by >= 0 else asked.by
                self._broadcast_dump(asked.model_copy(update={"by": by}))
                return True
        dead = {r: c for r, c in codes.items() if c not in (None, 0)}
        if dead:
            r, c = min(dead.items())
            self._broadcast_dump(DumpRequest(
                by=CONTROLLER_RANK, outcome=classify_exit(c, RunOutcome.CRASH), t=time.time(),
                reason=f"rank {r} ({self._label(r)}) exited with code {c}{describe_exit(c)} "
                       "before reporting"))
            return True
        return False

    def _broadcast_dump(self, request: DumpRequest) -> None:
        """The dump request, a global message: every worker of every group dumps."""
        t = self.cfg.topology
        self.request = self.request or request
        for g in self.groups:  # a group that asked first keeps its own request
            request_dump(g.run.path, request.by, request.outcome, request.reason)
        self.tracer.emit(Ev.DP_CONTROL, what="dump", kind=MessageKind.GLOBAL.value,
                         to=recipients(MessageKind.GLOBAL, dp=t.dp, pp=t.pp, tp=t.tp),
                         by=request.by, outcome=request.outcome.value)

    def collect_bundle(self, bundle_root: Path) -> tuple[Path | None, DumpRequest, str | None]:
        """py-spy every live rank, wait for every rank's dump, stop everyone, write the one
        bundle of the run (None, and why, when it could not be written)."""
        procs = self.procs()
        dumps = self._pyspy({r: p.pid for r, p in procs.items() if p.poll() is None})
        for g in self.groups:
            g.run.pyspy_done.touch()
        deadline = time.monotonic() + self.cfg.observability.protocol_timeout_s + 5.0
        while time.monotonic() < deadline and not all(
                g.run.entry(r).exists() or p.poll() is not None
                for g in self.groups for r, p in g.procs.items()):
            time.sleep(_POLL_S)
        wait_exit(procs, SELF_EXIT_S)
        kill_all(procs)
        request = self.request or DumpRequest(by=CONTROLLER_RANK, outcome=RunOutcome.CRASH,
                                              reason="unknown failure", t=time.time())
        dest, problem = kept_bundle(lambda: write_dp_bundle(
            self.run_dir, self.cfg, bundle_root, request.outcome, request.reason, self.exits(),
            dumps, [], self.tracer.events()))
        return dest, request, problem

    def salvage(self, bundle_root: Path, exc: BaseException) -> Path | None:
        """A run stopped while ranks were dumping: keep what they wrote as a bundle."""
        if not has_rank_dumps(self.run_dir, len(self.groups)):
            return None
        asked = self.request
        reason = f"{(asked.reason if asked else '') or 'unknown failure'}; " \
                 f"{exc or type(exc).__name__} before the bundle was complete"
        try:
            return write_dp_bundle(self.run_dir, self.cfg, bundle_root,
                                   asked.outcome if asked else RunOutcome.CRASH, reason,
                                   self.exits(), {}, [], self.tracer.events())
        except (OSError, ValueError):
            return None

    def _pyspy(self, pids: dict[int, int]) -> dict[int, str | None]:
        """``py-spy dump --json`` of every pid (by grid rank) into its group's rank folder,
        in parallel."""
        out: dict[int, str | None] = {}

        def one(r: int) -> None:
            g = self.groups[r // self.per_group]
            out[r] = pyspy.write_into(g.run.rank_bundle(r - g.first), pyspy.dump(pids[r]))

        threads = [threading.Thread(target=one, args=(r,)) for r in pids]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return out

    def _label(self, grid_rank: int) -> str:
        t = self.cfg.topology
        return RankInfo.of(grid_rank % self.per_group, t.tp, t.pp, grid_rank // self.per_group,
                           t.dp).label


def _trace_path(cfg: RuntimeConfig, part: str) -> Path | None:
    """``--trace run.jsonl`` becomes ``run.<part>.jsonl`` for the controller and each group
    (a group of several ranks splits its own further, ``run.dp1.rank0.jsonl``)."""
    path = cfg.observability.trace_path
    return None if path is None else path.with_name(f"{path.stem}.{part}{path.suffix}")


def _group_config(cfg: RuntimeConfig, group: int) -> RuntimeConfig:
    """The config a group's ranks read: the run's, with the group's own trace file."""
    path = _trace_path(cfg, f"dp{group}")
    return cfg if path is None else cfg.with_overrides(**{"observability.trace_path": path})
