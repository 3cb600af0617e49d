"""Every cross-rank agreement the runtime makes, in one place.

Ranks stay consistent only if every decision that changes tree state is taken from *protocol
values*: numbers reduced with MIN/MAX over the TP group, or decided by PP0 and chained down the
pipeline. This module owns all of them. Callers hand in their rank-local readings and get back
the agreed value; they never talk to a process group themselves.

Which thread may call what (each thread has its own communicator, never shared):

==========================  ==================  ===========================================
method                      thread              fixed protocol
==========================  ==================  ===========================================
``drain_counts``            scheduler           TP MIN on PP0, chained to PP1.. by p2p
``agree_min``/``agree_any`` scheduler           TP MIN/MAX on PP0, chained
``legacy_tp_min``           scheduler           classic per-stage TP MIN (legacy paths only)
``hit_vote``                prefetch thread     MIN over TP+PP on the prefetch-hit group
``progress_vote``           prefetch sync       MIN over TP+PP on the completion group
``host_capacity``           start-up            MIN over PP
``broadcast_requests``      scheduler           rank 0 -> all
==========================  ==================  ===========================================

:class:`SingleRankSync` is the one-rank implementation: every vote is the identity, but each is
still traced (inputs and outputs), so traces look the same whatever the topology.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from hicache_runtime.tracing import Ev

if TYPE_CHECKING:
    from hicache_runtime.topology import RankInfo
    from hicache_runtime.tracing import Tracer


class DrainCounts(NamedTuple):
    """The per-step vector agreed before any completion is consumed (SGLang's
    ``_sync_hicache_ready_counts``). Every field is a count of leading ready items."""

    write_acks: int = 0
    """L1->L2 write acks whose copy has finished."""
    load_acks: int = 0
    """L2->L1 load acks whose copy has finished."""
    backup_reservations: int = 0
    """Leading write-backup host reservations that succeeded (two-phase write_backup)."""
    prefetch_hits: int = 0
    """Prefetch ops whose agreed L3 hit length is known (``prefetch_hit_queue``)."""
    prefetch_acks: int = 0
    """Reduced prefetch progress acks (``ack_prefetch_queue``)."""
    backup_acks: int = 0
    """Finished L2->L3 backups (``ack_backup_queue``)."""
    host_releases: int = 0
    """Host pages other threads asked the scheduler to free (``host_mem_release_queue``)."""


class RankSync(ABC):
    """Cross-rank agreement for one rank. All methods return agreed values."""

    def __init__(self, rank: RankInfo, tracer: Tracer) -> None:
        self.rank = rank
        self.tracer = tracer

    @abstractmethod
    def drain_counts(self, local: DrainCounts) -> DrainCounts:
        """How many of each completion to consume this step. Downstream stages must then
        consume exactly that many, waiting for their own copies/threads if behind."""

    @abstractmethod
    def agree_min(self, value: int, site: str) -> int:
        """A scheduler-thread MIN decided on PP0 and chained (e.g. an immediate backup)."""

    @abstractmethod
    def agree_any(self, flag: bool, site: str) -> bool:
        """A scheduler-thread OR (MAX): true if any TP rank on PP0 says so; chained."""

    @abstractmethod
    def legacy_tp_min(self, value: int, site: str) -> int:
        """Classic per-stage TP MIN, used only by legacy code paths."""

    @abstractmethod
    def hit_vote(self, pages: int) -> int:
        """Prefetch thread: MIN of the L3 leading hit pages over every rank."""

    @abstractmethod
    def progress_vote(self, values: Sequence[int]) -> list[int]:
        """Prefetch sync thread: element-wise MIN of one progress ack over every rank."""

    @abstractmethod
    def host_capacity(self, tokens: int) -> int:
        """Start-up: MIN of the host pool token capacity over PP stages."""

    @abstractmethod
    def broadcast_requests(self, payload: list[Any] | None) -> list[Any]:
        """Scheduler thread: new requests from rank 0 to every rank, in the same order."""

    def close(self) -> None:
        """Release communicators."""

    def _trace_vote(self, site: str, local: Any, agreed: Any) -> None:
        self.tracer.emit(Ev.VOTE, site=site, local=_plain(local), agreed=_plain(agreed))


class SingleRankSync(RankSync):
    """One rank: every agreement is the local value. Votes are still traced."""

    def drain_counts(self, local: DrainCounts) -> DrainCounts:
        if any(local):
            self._trace_vote("drain_counts", local, local)
        return local

    def agree_min(self, value: int, site: str) -> int:
        self._trace_vote(site, value, value)
        return value

    def agree_any(self, flag: bool, site: str) -> bool:
        self._trace_vote(site, flag, flag)
        return flag

    def legacy_tp_min(self, value: int, site: str) -> int:
        return value

    def hit_vote(self, pages: int) -> int:
        self._trace_vote("prefetch_hit", pages, pages)
        return pages

    def progress_vote(self, values: Sequence[int]) -> list[int]:
        return list(values)

    def host_capacity(self, tokens: int) -> int:
        return tokens

    def broadcast_requests(self, payload: list[Any] | None) -> list[Any]:
        return list(payload or [])


def _plain(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return list(value)
    return value
