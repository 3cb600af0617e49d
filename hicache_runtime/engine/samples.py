"""Resource samples of one rank, taken every N steps (``observability.sample_every``).

A leak in a long run shows as a slope, not as an error: pending async sends per process group
(and the bytes they keep alive), pool pages in use, the process's resident memory, objects in
the L3 store. Each sample is one JSON line appended to ``<run>/rank<N>.samples.jsonl`` while
the run goes, so a soak can be watched live and a run that failed keeps what it had.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from hicache_runtime.contracts.run_files import RunDir
from hicache_runtime.l3.backends.file import FileBackend

if TYPE_CHECKING:
    from hicache_runtime.dist.groups import RankGroups
    from hicache_runtime.engine.rank import RankRuntime

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_L3_SUFFIX = ".bin"
"""File backend objects (``l3/backends/file.py``): one ``<key>.bin`` per page."""


class ResourceSample(BaseModel):
    """One rank's resources at the end of one step."""

    model_config = ConfigDict(extra="forbid")
    rank: int
    step: int
    pending_sends: int
    """Async sends this rank has not reaped yet, every group together."""
    pending_by_group: dict[str, int]
    pending_bytes: int
    """Bytes of the tensors those sends keep alive."""
    device_pages: int
    host_pages: int
    rss_mb: float
    l3_keys: int | None
    """Objects of this model in the L3 store (file backend, counted by rank 0 only)."""
    tree_nodes: int = 0
    py_objects: int = 0
    """Objects the garbage collector tracks: what grows when Python-level state is kept."""


def samples_path(run_dir: Path, rank: int) -> Path:
    return RunDir(run_dir).samples(rank)


def read_samples(run_dir: Path, rank: int) -> list[ResourceSample]:
    """A rank's samples so far (a line cut short by a rank that died is skipped)."""
    try:
        lines = samples_path(run_dir, rank).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(ResourceSample.model_validate_json(line))
        except ValueError:
            continue
    return out


def rss_mb() -> float:
    """This process's resident memory now (Linux ``/proc``; the peak elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * _PAGE_BYTES / 2**20
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RankSampler:
    """Called by the engine after every step; samples every ``every`` steps."""

    rt: RankRuntime
    groups: RankGroups | None
    path: Path
    every: int

    def __call__(self, step: int) -> None:
        if self.every and step % self.every == 0:
            self.take(step)

    def take(self, step: int) -> ResourceSample:
        groups = self.groups.all() if self.groups is not None else []
        by_group = {g.name: len(g.pending) for g in groups if g.pending}
        host = self.rt.host_pool
        sample = ResourceSample(
            rank=self.rt.rank.rank, step=step, pending_sends=sum(by_group.values()),
            pending_by_group=by_group, pending_bytes=sum(g.pending_bytes() for g in groups),
            device_pages=self.rt.device_pool.allocator.used_pages,
            host_pages=host.allocator.used_pages if host is not None else 0,
            rss_mb=round(rss_mb(), 2), l3_keys=self._l3_keys(), tree_nodes=self._tree_nodes(),
            py_objects=len(gc.get_objects()))
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(sample.model_dump_json() + "\n")
        return sample

    def _tree_nodes(self) -> int:
        tree = self.rt.cache.parts().tree
        return sum(1 for _ in tree.nodes()) if tree is not None else 0

    def _l3_keys(self) -> int | None:
        """The store is shared by every rank: rank 0 counts it, others report None. Only a
        file store can be counted (its objects are files)."""
        l3 = self.rt.cache.parts().l3
        if l3 is None or self.rt.rank.rank != 0:
            return None
        backend = l3.workers.backend
        if not isinstance(backend, FileBackend):
            return None
        try:
            with os.scandir(backend.root) as entries:
                return sum(1 for e in entries if e.name.endswith(_L3_SUFFIX)
                           and backend.scheme.owns(e.name[: -len(_L3_SUFFIX)]))
        except OSError:
            return None
