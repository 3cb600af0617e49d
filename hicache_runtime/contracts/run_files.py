"""The names of the files a multi-rank run exchanges and leaves behind, in one place.

A run directory is shared by the launcher (or ``torchrun``'s rank 0) and every rank process::

    <run>/config.json          the RuntimeConfig (written by the launcher)
    <run>/caps.json            optional: reference-run caps (see Workload.caps)
    <run>/DUMP                 side channel: created once (O_EXCL) by whoever sees a failure
                               first; every rank then dumps its evidence
    <run>/PYSPY_DONE           the launcher took its py-spy dumps; ranks may unwind now
    <run>/progress.json        rank 0's progress (step, finished, total)
    <run>/rank<N>.log          the rank's stdout and stderr
    <run>/rank<N>.result.json  the rank's RankResult (outcome, outputs, stats)
    <run>/rank<N>.exit.json    a healthy rank's teardown: native threads left at exit
    <run>/bundle/rank<N>/      the rank's bundle files (below), plus entry.json (its RankEntry)

Per-rank files in a bundle (``<bundle>/rank<N>/``) are the ``RANK_*`` names below; a manifest
records them relative to the bundle (:func:`in_bundle`). Torch-free, like all contracts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
"""A bundle's manifest, at its root."""
CONFIG = "config.json"
CAPS = "caps.json"
DUMP = "DUMP"
DUMP_TMP = "DUMP.tmp"
PYSPY_DONE = "PYSPY_DONE"
PROGRESS = "progress.json"
PROGRESS_TMP = "progress.tmp"
BUNDLE = "bundle"

#: A rank's own file in a bundle (``<bundle>/rank<N>/<name>``).
RANK_ENTRY = "entry.json"
"""The rank's RankEntry while the run lasts; folded into the manifest, then removed."""
RANK_TRACEBACK = "traceback.txt"
RANK_STACKS = "stacks.txt"
RANK_EVENTS = "events.jsonl"
RANK_FLIGHT_RECORDER = "flight_recorder.json"
RANK_STATE = "state.json"
RANK_DUMP_ERRORS = "dump_errors.txt"
RANK_PYSPY = "pyspy.json"
RANK_PYSPY_ERR = "pyspy.err.txt"
RANK_TORCH_FR = "torch_fr.pkl"
RANK_LOG = "log.txt"
RANK_FAULTS_FIRED = "faults_fired.json"
"""The faults fired on a rank, written just before a fault ends it with no dump (rank-kill)."""
RANK_JOURNAL = "journal.jsonl"
"""The few events a rank writes to disk as they happen (a fault firing, a legacy path taken),
each line marked ``durable``: what is left of its trace when it dies before it can dump (a
native abort, a kill). Kept as the rank's ``events.jsonl`` then; removed when it dumped."""
RANK_STORAGE_CLIENT_LOG = "storage-client.log"
"""The L3 client library's own log lines (a backend that keeps them, e.g. Mooncake's glog)."""


DP_RANK_ENV = "HICACHE_DP_RANK"
"""A rank's data-parallel group, in its environment (each group numbers its ranks from 0)."""
DP_SIZE_ENV = "HICACHE_DP_SIZE"
"""The run's number of DP groups, in every rank's environment when there are several (so a
capture knows how many ranks the job will have: ``WORLD_SIZE`` per group times this)."""
HELPER_PROCESS_ENV = "HICACHE_HELPER"
"""Set (to the helper's name) in the environment of a run's processes that are not ranks (the
rank zygote): ``hicache capture --tree`` leaves them out."""

RANK_DIRS = "rank*"
"""Glob of the rank folders in a bundle."""


def rank_dir_name(rank: int) -> str:
    """The folder of one rank's files in a bundle (and in a capture)."""
    return f"rank{rank}"


def in_bundle(rank: int, name: str) -> str:
    """A rank file's path relative to the bundle, as a manifest records it."""
    return f"{rank_dir_name(rank)}/{name}"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (see the module notes)."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def caps(self) -> Path:
        return self.path / CAPS

    @property
    def dump(self) -> Path:
        return self.path / DUMP

    @property
    def dump_tmp(self) -> Path:
        return self.path / DUMP_TMP

    @property
    def pyspy_done(self) -> Path:
        return self.path / PYSPY_DONE

    @property
    def progress(self) -> Path:
        return self.path / PROGRESS

    @property
    def progress_tmp(self) -> Path:
        return self.path / PROGRESS_TMP

    @property
    def bundle(self) -> Path:
        """Where the ranks write their bundle files while the run lasts."""
        return self.path / BUNDLE

    @property
    def manifest(self) -> Path:
        """The manifest of the bundle written in place (``torchrun``, no launcher)."""
        return self.bundle / MANIFEST

    def samples(self, rank: int) -> Path:
        """The rank's resource samples (``observability.sample_every``), one JSON line each."""
        return self.path / f"rank{rank}.samples.jsonl"

    def log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.log"

    def result(self, rank: int) -> Path:
        return self.path / f"rank{rank}.result.json"

    def exit_report(self, rank: int) -> Path:
        return self.path / f"rank{rank}.exit.json"

    def rank_bundle(self, rank: int) -> Path:
        """The rank's folder in the run's bundle (not created here)."""
        return self.bundle / rank_dir_name(rank)

    def entry(self, rank: int) -> Path:
        return self.rank_bundle(rank) / RANK_ENTRY
