"""Process groups of one rank, each owned by one thread.

Every rank creates every group in the same order (``torch.distributed.new_group`` is
collective over the world), all gloo on CPU; the model's TP all_reduce uses NCCL when the
pools live on a GPU. Protocol groups carry a short timeout so a rank stuck in a vote raises
gloo's ``Timed out waiting ...`` instead of blocking for 30 minutes; the L3 threads' groups
(:data:`STORAGE_IO_GROUPS`) wait longer, since each of their votes also waits for the peers'
storage calls.

==================  =============  ===================================================
group               thread         carries
==================  =============  ===================================================
tp_compute          scheduler      the model's row-parallel all_reduce (this stage's TP)
tp_cpu              scheduler      votes decided on PP0 (TP MIN/MAX), request broadcast
pp_requests         scheduler      new requests and aborts, stage to stage
pp_sync             scheduler      PP0's agreed counts chained down the pipeline
pp_act              scheduler      hidden states + batch description, stage to stage
pp_out              scheduler      sampled tokens, last stage -> PP0 -> ... (a ring)
alloc_vote          scheduler      MIN over every rank of an allocation's success
prefetch_hits       prefetch-query the L3 hit-length MIN over every rank
prefetch_tp         prefetch-query this stage's hit-length MIN (``local-prefetch-progress``)
prefetch_progress   prefetch-sync  the per-batch progress MIN over every rank
l3_backup           backup         the per-op backup completion MIN over every rank
consensus           consensus      digests of decisions that must agree
world               start-up       host capacity MIN, final barrier; ``skip-empty-sync``'s
                                   per-call count chain (scheduler, point to point)
==================  =============  ===================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hicache_runtime.dist.flight_recorder import FlightRecorder, Group

if TYPE_CHECKING:
    from hicache_runtime.contracts.topology import RankInfo
    from hicache_runtime.telemetry.tracer import Tracer

_WORLD_GROUPS = ("pp_requests", "pp_sync", "pp_act", "pp_out", "alloc_vote", "prefetch_hits",
                 "prefetch_progress", "l3_backup", "consensus")

STORAGE_IO_GROUPS = ("prefetch_hits", "prefetch_tp", "prefetch_progress", "l3_backup")
"""The L3 threads' groups: each vote waits for every peer's own storage call, not only for
the peer to get there (a rank votes on a hit once its existence query returned, on progress
once its batch was read, on a backup once its pages were written). A call is bounded only by
the IO budget plus one storage call, which on a loaded machine (a Mooncake put of 8 pages:
2 s) outlasts a short protocol timeout. They wait ``storage_timeout_s`` instead."""


@dataclass
class RankGroups:
    """This rank's groups (see the module table)."""

    world: Group
    tp_compute: Group
    tp_cpu: Group
    pp_requests: Group
    pp_sync: Group
    pp_act: Group
    pp_out: Group
    alloc_vote: Group
    prefetch_hits: Group
    prefetch_tp: Group
    prefetch_progress: Group
    l3_backup: Group
    consensus: Group
    recorder: FlightRecorder

    def all(self) -> list[Group]:
        return [self.world, self.tp_compute, self.tp_cpu, self.pp_requests, self.pp_sync,
                self.pp_act, self.pp_out, self.alloc_vote, self.prefetch_hits,
                self.prefetch_tp, self.prefetch_progress, self.l3_backup, self.consensus]


def create_groups(rank: RankInfo, tracer: Tracer, timeout_s: float,
                  storage_timeout_s: float) -> RankGroups:
    """Create every group (collective over the world: all ranks call this together).
    :data:`STORAGE_IO_GROUPS` wait ``storage_timeout_s``, the others ``timeout_s``."""
    recorder = FlightRecorder()
    timeout = timedelta(seconds=timeout_s)
    storage_timeout = timedelta(seconds=storage_timeout_s)
    world_ranks = list(range(rank.world_size))
    # NCCL needs one GPU per rank; ranks sharing a GPU (or none) reduce through gloo.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    compute_backend = "nccl" if gpus >= rank.world_size else "gloo"
    tp_compute = tp_cpu = prefetch_tp = None
    for stage in range(rank.pp_size):
        ranks = rank.stage_ranks(stage)
        compute = dist.new_group(ranks, timeout=timeout, backend=compute_backend)
        cpu = dist.new_group(ranks, timeout=timeout, backend="gloo")
        # the classic prefetch_tp_group: the query thread's own stage-local communicator
        hits = dist.new_group(ranks, timeout=storage_timeout, backend="gloo")
        if stage == rank.pp_rank:
            tp_compute, tp_cpu, prefetch_tp = compute, cpu, hits
    world = {name: dist.new_group(world_ranks, backend="gloo",
                                  timeout=storage_timeout if name in STORAGE_IO_GROUPS
                                  else timeout)
             for name in _WORLD_GROUPS}
    stage_ranks = rank.stage_ranks(rank.pp_rank)

    def wrap(name: str, pg: dist.ProcessGroup | None, ranks: list[int],
             traced: bool = True) -> Group:
        return Group(name, pg, ranks, rank.rank, recorder, tracer if traced else None)

    return RankGroups(
        world=wrap("world", dist.group.WORLD, world_ranks),
        # the compute all_reduce runs twice per layer: recorded, but kept out of the event ring
        tp_compute=wrap("tp_compute", tp_compute, stage_ranks, traced=False),
        tp_cpu=wrap("tp_cpu", tp_cpu, stage_ranks),
        prefetch_tp=wrap("prefetch_tp", prefetch_tp, stage_ranks),
        **{name: wrap(name, pg, world_ranks) for name, pg in world.items()},
        recorder=recorder,
    )


class TPComm:
    """The model's TP collective on ``tp_compute`` (implements ``TensorParallelComm``)."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def all_reduce(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        return self.group.all_reduce(tensor, dist.ReduceOp.SUM)
