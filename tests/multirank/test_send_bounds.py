"""Async sends of the pipeline stay bounded (#28916, in its fixed form), measured on real rank
processes through their resource samples (``observability.sample_every``).

With gloo a send's ``is_completed()`` stays false until someone waits on it, so a channel
reaped by ``is_completed()`` keeps every send it ever made; the channels are reaped by waiting
on the sends the peer must already have received, and the count chain by waiting on the
rounds older than the pipeline depth (the agreement helpers' sends included)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.dist.flight_recorder import FlightRecorder, Group
from hicache_runtime.engine.samples import ResourceSample, read_samples
from hicache_runtime.launch.launcher import launch
from tests.multirank.conftest import mr_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PP = 2
#: At step i a stage holds the activation/token sends of steps i - pp .. i at most (three
#: sends per activation: size, descriptor, hidden states; two per token message).
ACT_BOUND, OUT_BOUND = 3 * (PP + 1), 2 * (PP + 1)
SYNC_BOUND = 8
"""Chain sends of the current round and the one before, with the helpers' votes."""


def _sampled_run(tmp_path: Path, bundle_root: Path, **overrides: object
                 ) -> tuple[int, dict[int, list[ResourceSample]]]:
    cfg = mr_config(**{"topology.pp": PP, "observability.sample_every": 1, **overrides})
    res = launch(cfg, bundle_root=bundle_root)
    try:
        assert res.outcome is RunOutcome.HEALTHY, res.error
        samples = {r: read_samples(res.run_dir, r) for r in range(cfg.topology.world_size)}
        return res.results[0].steps, samples
    finally:
        res.cleanup()


def _most(samples: dict[int, list[ResourceSample]], group: str) -> int:
    return max(s.pending_by_group.get(group, 0) for ss in samples.values() for s in ss)


def test_pipeline_send_channels_stay_bounded(tmp_path: Path, bundle_root: Path) -> None:
    """pp=2 with L3 and ``wait_complete`` prefetch (the agreement helpers vote often): every
    channel holds a few steps' sends at most, however long the run. Reaped by
    ``is_completed()``, the activation channel grew by about two sends a step and the chain
    by one send every few dozen steps (the helpers' sends were left out of the rounds)."""
    steps, samples = _sampled_run(tmp_path, bundle_root, **{
        "workload.requests": 96, "storage.backend": "file", "storage.path": tmp_path / "l3",
        "storage.prefetch_policy": "wait_complete"})
    assert steps > 300, steps  # long enough that any per-step leak would pass every bound
    assert all(len(ss) >= steps - 1 for ss in samples.values())
    assert _most(samples, "pp_act") <= ACT_BOUND
    assert _most(samples, "pp_out") <= OUT_BOUND
    assert _most(samples, "pp_sync") <= SYNC_BOUND
    assert all(s.pending_sends <= ACT_BOUND + SYNC_BOUND for ss in samples.values() for s in ss)


def test_unbounded_pp_sends_keeps_only_the_count_chain(tmp_path: Path,
                                                       bundle_root: Path) -> None:
    """The legacy switch restores 0.5.13's count chain (sends reaped only once
    ``is_completed()``, never on gloo): PP0's chain grows a send or more per round, with or
    without a fault, while the other channels stay bounded as in the fixed runtime."""
    steps, samples = _sampled_run(tmp_path, bundle_root, **{
        "legacy": ["unbounded-pp-sends"], "observability.pending_send_limit": 0})
    chain = [s.pending_by_group.get("pp_sync", 0) for s in samples[0]]
    assert chain[-1] >= steps - 1, (chain[-1], steps)
    assert chain == sorted(chain)
    assert _most(samples, "pp_act") <= ACT_BOUND
    assert _most(samples, "pp_out") <= OUT_BOUND


# --- the group primitive, on two real gloo processes --------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_ranks(rank: int, port: int, out: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = Group("g", None, [0, 1], rank, FlightRecorder())
        if rank == 0:
            for epoch in (1, 1, 2, 3):
                group.epoch = epoch
                group.isend(torch.tensor([epoch]), 1)
            dist.barrier()  # rank 1 has received all four
            time.sleep(0.2)
            completed = [p.work.is_completed() for p in group.pending]
            left_by_reap = group.reap_completed()
            t0 = time.monotonic()
            left = group.wait_through(2)
            waited = time.monotonic() - t0
            states = [r["state"] for r in group.recorder.records()]
            out.put((completed, left_by_reap, left, [p.epoch for p in group.pending], waited,
                     states))
            group.wait_pending()
        else:
            for _ in range(4):
                group.recv(torch.zeros(1, dtype=torch.int64), 0)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gloo_sends_are_reaped_by_waiting_through_a_round() -> None:
    """What the bounds rest on: a gloo send received long ago still says it is not
    completed, so ``reap_completed`` keeps it; ``wait_through`` reaps exactly the sends of
    the rounds named, at once, and closes their flight records."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    completed, left_by_reap, left, epochs, waited, states = out.get()
    assert completed == [False] * 4
    assert left_by_reap == 4
    assert (left, epochs) == (1, [3])
    assert waited < 0.5
    assert states == ["completed", "completed", "completed", "started"]
