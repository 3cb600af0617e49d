"""Entry point of one rank process: ``python -m hicache_runtime.launch.rank_process``.

Started by the built-in launcher (``hicache run --tp 2 --pp 2``) or by ``torchrun``; either way
the rendezvous is ``env://`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

The run directory it shares with the launcher is described in
:mod:`hicache_runtime.contracts.run_files`; the dump request (``<run>/DUMP``) and the progress
file in :mod:`hicache_runtime.launch.side_channel`. On a dump request every rank's listener
thread dumps its evidence, without touching any process group (they may be stuck). At its end
a rank writes its :class:`~hicache_runtime.contracts.rank_result.RankResult`.

Teardown of a healthy rank, in this order (see :func:`run_rank` and :func:`main`): the side
threads that run collectives stop (the consensus thread by agreement, so no rank is left
inside a round), the L3 workers and copy engine are joined, a world barrier, the result, then
every process group is destroyed *and freed*, which joins gloo's worker threads while the
interpreter is still whole. A gloo worker that outlives the interpreter aborts the process
when it drops the last reference to a Python-owned tensor (it cannot take the GIL once
finalization began: ``terminate called without an active exception``, exit -6, after a
healthy result). A failed rank never destroys its groups (a peer may be stuck inside one) and
leaves with ``os._exit``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hicache_runtime.cache.accounting import drain_account, reached_drain
from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.contracts import pyspy
from hicache_runtime.contracts.bundle import RankEntry, RunOutcome, rank_dir, write_text
from hicache_runtime.contracts.outcome import EXIT_OK, CommTimeouts, classify, exit_code
from hicache_runtime.contracts.rank_result import write_rank_result
from hicache_runtime.contracts.run_files import (
    RANK_ENTRY,
    RANK_FAULTS_FIRED,
    RANK_JOURNAL,
    RANK_TORCH_FR,
    RANK_TRACEBACK,
    RunDir,
)
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.dist.consensus_check import ConsensusChecker
from hicache_runtime.dist.groups import STORAGE_IO_GROUPS, RankGroups, TPComm, create_groups
from hicache_runtime.dist.protocols import DistributedSync
from hicache_runtime.engine.evidence import dump_rank
from hicache_runtime.engine.loop import Engine, EngineResult
from hicache_runtime.engine.profile import setup_chunking
from hicache_runtime.engine.rank import RankRuntime, build_rank, make_tracer
from hicache_runtime.engine.samples import RankSampler, samples_path
from hicache_runtime.engine.workload import Workload
from hicache_runtime.launch.bundles import write_manifest_in_place
from hicache_runtime.launch.dp_intake import controller_feed, dp_rank_from_env
from hicache_runtime.launch.results import rank_result
from hicache_runtime.launch.side_channel import (
    DumpRequest,
    progress_writer,
    read_dump,
    request_dump,
)
from hicache_runtime.launch.threads import torch_threads
from hicache_runtime.launch.watchdog import (
    StepWatchdog,
    install_interrupt_handler,
    interrupt_main_thread,
)

_POLL_S = 0.05
_PYSPY_WAIT_S = 20.0
_STARTUP_TIMEOUT_S = 120.0
_JOIN_S = 5.0
_GLOO_WORKER = "pt_gloo_runloop"
"""Thread name of gloo's worker threads (they run every collective and hold its tensors)."""


@dataclass
class RankDumper:
    """Writes this rank's bundle files exactly once, whichever thread gets there first; a
    later exception on the main thread adds its traceback."""

    run_dir: Path
    rt: RankRuntime
    engine: Engine | None = None
    dumped: bool = False
    manifest_written: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    failing: threading.Event = field(default_factory=threading.Event)
    """Set by the main thread when it enters its own failure path: it dumps by itself, and an
    interrupt then would cut its dump (and its traceback) short."""

    @property
    def bundle(self) -> Path:
        return RunDir(self.run_dir).bundle

    def dump(self, outcome: RunOutcome, exc: BaseException | None = None) -> None:
        step = self.engine.step if self.engine is not None else 0
        with self.lock:
            d = rank_dir(self.bundle, self.rt.rank.rank)
            if self.dumped:
                if exc is not None:  # the evidence is there; add how this rank ended
                    write_text(d / RANK_TRACEBACK, "".join(traceback.format_exception(exc)))
                    self._update_entry(d, exc)
                return
            self.dumped = True
            entry = dump_rank(self.bundle, self.rt, outcome, step, exc)
            entry.files.torch_fr = _torch_fr(d, stacks=outcome is not RunOutcome.HEALTHY)
            if os.environ.get("HICACHE_SELF_PYSPY") == "1":
                # under torchrun there is no launcher to take py-spy dumps: take our own
                entry.files.pyspy = pyspy.write_into(d, pyspy.dump(os.getpid()))
            write_text(d / RANK_ENTRY, entry.model_dump_json(indent=1))

    def _update_entry(self, d: Path, exc: BaseException) -> None:
        try:
            entry = RankEntry.model_validate_json((d / RANK_ENTRY).read_text())
        except (OSError, ValueError):
            return
        entry.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        entry.files.traceback = f"{d.name}/{RANK_TRACEBACK}"
        write_text(d / RANK_ENTRY, entry.model_dump_json(indent=1))

    def listen(self) -> None:
        """Side channel: another rank (or the launcher) asked for a dump."""
        while not self.stop.wait(_POLL_S):
            request = read_dump(self.run_dir)
            if request is None:
                continue
            self.dump(request.outcome)
            self.finish_without_launcher(request)
            _wait_for(RunDir(self.run_dir).pyspy_done, _PYSPY_WAIT_S, self.stop)
            if not self.stop.is_set() and not self.failing.is_set():
                interrupt_main_thread()
            return

    def finish_without_launcher(self, request: DumpRequest | None) -> None:
        """Under ``torchrun`` nobody else writes the manifest: rank 0 does, once the other
        ranks' dumps are in (or a timeout passed)."""
        if os.environ.get("HICACHE_LAUNCHER") or self.rt.rank.rank != 0:
            return
        with self.lock:
            if self.manifest_written:
                return
            self.manifest_written = True
        cfg = self.rt.cfg
        run = RunDir(self.run_dir)
        deadline = time.monotonic() + cfg.observability.protocol_timeout_s + 5.0
        want = [run.entry(r) for r in range(cfg.topology.world_size)]
        while time.monotonic() < deadline and not all(p.exists() for p in want):
            time.sleep(_POLL_S)
        write_manifest_in_place(self.run_dir, cfg,
                                request.outcome if request else RunOutcome.CRASH,
                                request.reason if request else "")


def run_rank(run_dir: Path, rank: RankInfo, cfg: RuntimeConfig) -> int:
    """Run one rank to completion; returns the process exit code."""
    tracer = make_tracer(cfg, rank)
    tracer.journal = RunDir(run_dir).rank_bundle(rank.rank) / RANK_JOURNAL
    groups = create_groups(rank, tracer, cfg.observability.protocol_timeout_s,
                           storage_timeout_s(cfg))
    sync = DistributedSync(rank, tracer, groups, cfg.legacy,
                           cfg.observability.pending_send_limit)
    rt = build_rank(cfg, rank, sync=sync, tp=TPComm(groups.tp_compute), tracer=tracer)
    dumper = RankDumper(run_dir, rt)
    if rt.faults is not None:
        rt.faults.journal = RunDir(run_dir).rank_bundle(rank.rank) / RANK_FAULTS_FIRED
    consensus = None
    if cfg.observability.consensus_check:
        consensus = ConsensusChecker(groups.consensus, tracer).start()
        tracer.observer = consensus.on_event
    caps = _read_json(RunDir(run_dir).caps) or {}
    workload = Workload(cfg.workload, cfg.model.vocab_size, cfg.seed,
                        client_aborts=not caps, caps=caps)
    # a DP group's entry rank reads the DP controller's stream instead of its own workload
    feed = controller_feed(cfg.topology.dp, rank.rank, tracer, workload.total,
                           lambda: rt.scheduler.has_work)
    engine = Engine(rt, feed or workload, groups=groups, consensus=consensus,
                    on_step=progress_writer(run_dir) if rank.rank == 0 else None)
    if cfg.observability.sample_every:
        engine.sampler = RankSampler(rt, groups, samples_path(run_dir, rank.rank),
                                     cfg.observability.sample_every)
    dumper.engine = engine
    install_interrupt_handler()

    def on_stall(idle_s: float) -> None:
        reason = f"rank {rank.rank} ({rank.label}): no scheduler progress for {idle_s:.1f}s " \
                 f"(step {engine.step})"
        request_dump(run_dir, rank.rank, RunOutcome.HANG, reason)

    watchdog = StepWatchdog(cfg.observability.watchdog_timeout_s, on_stall).start()
    engine.heartbeat = watchdog.beat
    listener = threading.Thread(target=dumper.listen, name="hicache-dump-listener",
                                daemon=True)
    listener.start()
    # A peer may still be writing its own evidence when this rank stops (seconds on a loaded
    # machine): the consensus thread's last round waits for it, as long as a collective may.
    side = _SideThreads(dumper, listener, watchdog, consensus,
                        consensus_join_s=cfg.observability.protocol_timeout_s + _JOIN_S)
    outcome, error, result = RunOutcome.HEALTHY, None, None
    try:
        if cfg.scheduler.enable_dynamic_chunking:
            # start-up, watched: a profile stuck in a forward is a stall like any other
            setup_chunking(rt, groups.world)
            watchdog.beat()
        result = engine.run()
        # Keep the evidence of a clean run too: outputs may still turn out wrong when the
        # launcher compares them with the reference.
        dumper.dump(RunOutcome.HEALTHY)
        side.stop(agreed=True)
        if consensus is not None:
            if consensus.running:  # destroying its group under it would crash the process
                raise RuntimeError("the consensus thread did not finish its last round "
                                   f"within {side.consensus_join_s:.0f}s of the agreed stop")
            consensus.check()  # the last round ran at the agreed stop
        _final_barrier(groups)
    except BaseException as exc:
        dumper.failing.set()  # first: the dump listener must not interrupt this path
        outcome = classify(exc, _comm_timeouts(cfg))
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        request_dump(run_dir, rank.rank, outcome, f"rank {rank.rank} ({rank.label}): {error}")
        # the result first: the launcher stops ranks soon after their dump is complete
        _write_result(run_dir, rt, outcome, error, result, engine.step,
                      drained=result is not None or reached_drain(exc))
        dumper.dump(outcome, exc)
        dumper.finish_without_launcher(read_dump(run_dir))
        _linger_without_launcher(run_dir, cfg)
    finally:
        side.stop(agreed=False)  # no-op after a clean stop; a failed rank does not wait
    if outcome is RunOutcome.HEALTHY:
        _write_result(run_dir, rt, outcome, error, result, engine.step, drained=True)
        rt.close()  # L3 workers and copy engine joined: nothing runs a collective any more
        dist.destroy_process_group()
    else:
        rt.tracer.close()
    # The groups are freed (and gloo's workers joined) by main() once this frame is gone.
    return exit_code(outcome)


def storage_timeout_s(cfg: RuntimeConfig) -> float:
    """How long a vote that waits for its peers' storage calls waits
    (``dist.groups.STORAGE_IO_GROUPS``): the protocol timeout plus the step watchdog's, so
    that a slow store on a loaded machine is not taken for a peer that stopped, while one
    that stopped is still reported within the time a stalled step would be."""
    obs = cfg.observability
    return obs.protocol_timeout_s + obs.watchdog_timeout_s


def _comm_timeouts(cfg: RuntimeConfig) -> CommTimeouts:
    """The rank's groups wait ``protocol_timeout_s``, those that wait for storage calls
    :func:`storage_timeout_s`; the world group, made at start-up, waits the start-up timeout
    (see :func:`_init_process_group`)."""
    return CommTimeouts(cfg.observability.protocol_timeout_s, {
        "world": _STARTUP_TIMEOUT_S,
        **dict.fromkeys(STORAGE_IO_GROUPS, storage_timeout_s(cfg))})


@dataclass
class _SideThreads:
    """The rank's threads besides the scheduler and the L3 workers, stopped before teardown."""

    dumper: RankDumper
    listener: threading.Thread
    watchdog: StepWatchdog
    consensus: ConsensusChecker | None
    consensus_join_s: float = _JOIN_S

    def stop(self, agreed: bool) -> None:
        """Stop and join. ``agreed``: every rank is stopping too, so the consensus thread
        finishes its rounds with its peers instead of walking out of one."""
        self.dumper.stop.set()
        self.watchdog.stop()
        if self.consensus is not None:
            # A failed rank exits without destroying its groups: no need to wait out a round.
            self.consensus.stop(agreed=agreed,
                                timeout_s=self.consensus_join_s if agreed else _JOIN_S)
        if self.listener.is_alive() and self.listener is not threading.current_thread():
            self.listener.join(timeout=_JOIN_S)


def _linger_without_launcher(run_dir: Path, cfg: RuntimeConfig) -> None:
    """Under ``torchrun`` a failed rank's exit makes the agent kill every other rank at once:
    stay until rank 0 has written the manifest (or a timeout), so the bundle is complete."""
    if os.environ.get("HICACHE_LAUNCHER"):
        return
    deadline = time.monotonic() + cfg.observability.protocol_timeout_s + 10.0
    while time.monotonic() < deadline and not RunDir(run_dir).manifest.exists():
        time.sleep(_POLL_S)


def _final_barrier(groups: RankGroups) -> None:
    """No rank leaves while a peer may still talk to it."""
    groups.world.all_reduce(torch.zeros(1))


def _write_result(run_dir: Path, rt: RankRuntime, outcome: RunOutcome, error: str | None,
                  result: EngineResult | None, step: int, *, drained: bool = False) -> None:
    """``drained``: the rank got through its drain (or failed the drain's own check), so its
    page accounting (``drain``) is what the run left behind."""
    drain = drain_account(rt.cache).model_dump() if drained else None
    write_rank_result(RunDir(run_dir).result(rt.rank.rank), rank_result(
        rt, outcome, error, result.reqs if result is not None else {}, step,
        result.wall_s if result else None, drain))


def _torch_fr(d: Path, stacks: bool = True) -> str | None:
    """PyTorch's own Flight Recorder dump (gloo entries too), when it was enabled.

    A clean rank's dump leaves out the entries' stack traces: dumping them keeps a process
    group alive after ``destroy_process_group`` (torch 2.13), and its gloo workers would then
    outlive the interpreter (see the module notes on teardown)."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return None
    try:
        # private and untyped in torch's stubs; present in builds with the Flight Recorder
        raw = torch._C._distributed_c10d._dump_fr_trace(  # type: ignore[attr-defined]
            includeStackTraces=stacks)
    except Exception:  # not built in, or nothing recorded: the bundle says so by omission
        return None
    (d / RANK_TORCH_FR).write_bytes(raw)
    return f"{d.name}/{RANK_TORCH_FR}"


def _wait_for(path: Path, timeout_s: float, stop: threading.Event) -> None:
    if not os.environ.get("HICACHE_LAUNCHER"):
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not path.exists() and not stop.is_set():
        time.sleep(_POLL_S)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, help="RuntimeConfig JSON (default <run>/config.json)")
    ap.add_argument("--run-dir", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(torch_threads())
    # A C++ abort (gloo's EnforceNotMet, a segfault) kills the process before any Python
    # handler runs: faulthandler still prints every thread's stack into the rank's log.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(_read_json(args.config or RunDir(args.run_dir).config))
    world = int(os.environ["WORLD_SIZE"])
    if world != cfg.topology.world_size:
        sys.stderr.write(f"error: WORLD_SIZE={world} but the config wants "
                         f"tp*pp={cfg.topology.world_size}\n")
        return 2
    rank = RankInfo.of(int(os.environ["RANK"]), cfg.topology.tp, cfg.topology.pp,
                       dp_rank_from_env(), cfg.topology.dp)
    if torch.cuda.is_available():  # one GPU per local rank, shared round-robin if fewer
        local = int(os.environ.get("LOCAL_RANK", rank.rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    if "HICACHE_LAUNCHER" not in os.environ:
        os.environ.setdefault("HICACHE_SELF_PYSPY", "1")
    _init_process_group(rank.rank, world)
    code = run_rank(args.run_dir, rank, cfg)
    if code == EXIT_OK:
        left = _free_groups(args.run_dir, rank.rank)
        if not left:
            return code
    # A failed rank's groups may have a peer stuck inside a collective: destroying them would
    # block on gloo workers that are still waiting, and letting the interpreter finalize with
    # those workers alive aborts the process whenever one of them finishes (it drops tensors
    # it cannot free without the GIL). The evidence and the result are on disk already.
    _hard_exit(code)
    return code  # not reached


def _init_process_group(rank: int, world: int) -> None:
    """Join the rendezvous. Under the built-in launcher, the launcher hosts the store on a
    port it has held since before the ranks started (so two runs at once never race for it)
    and every rank is a client; under ``torchrun``, ``env://`` as usual."""
    timeout = timedelta(seconds=_STARTUP_TIMEOUT_S)
    if os.environ.get("HICACHE_LAUNCHER") and os.environ.get("HICACHE_STORE") == "launcher":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        return
    dist.init_process_group("gloo", timeout=timeout)


def _free_groups(run_dir: Path, rank: int) -> list[str]:
    """Free the destroyed process groups now, while the interpreter is whole: they sit in
    reference cycles (tracer, engine, sync), so without this only the collection during
    interpreter shutdown would free them, and their gloo workers would race it. Freeing a
    group joins its workers with the GIL released. Records what is left in
    ``rank<N>.exit.json``; returns the names of native worker threads still alive."""
    gc.collect()
    native = _native_threads()
    left = [n for n in native if n == _GLOO_WORKER]
    py = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    data = {"rank": rank, "gloo_workers": len(left), "python_threads": py,
            "native_threads": native}
    with contextlib.suppress(OSError):
        RunDir(run_dir).exit_report(rank).write_text(json.dumps(data), encoding="utf-8")
    return left + py


def _native_threads() -> list[str]:
    """Names of this process's other threads (Linux ``/proc``; empty elsewhere)."""
    me = threading.get_native_id()
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tasks:
        if int(tid) == me:
            continue
        with contextlib.suppress(OSError):
            out.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return sorted(out)


def _hard_exit(code: int) -> None:
    """Leave without interpreter finalization, after flushing what a reader needs."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
