"""Cross-rank timing for a fault whose bug needs one interleaving of the ranks' threads.

A ``mid-prefetch-abort`` reaches every rank through rank 0's next step plan. Whether it exposes
an ack-protocol bug depends on where the *other* ranks' prefetch IO is by then: a peer that
has already acked every batch of the op has more acks than rank 0, whose IO thread sees the
abort in the middle of the op; a peer still reading the same batch sees the abort at the same
batch index and emits as many acks as rank 0, and nothing goes wrong. Left to the scheduler,
a cell that should show the bug shows it in most runs and not in others (more often not when
the machine is loaded and the peers' storage reads are slow).

The rendezvous takes the chance out: every peer records in the run's rendezvous store (the
``torch.distributed`` store the ranks joined with) that its IO thread has finished an op, and
rank 0 waits for those records before it asks for the abort. The interleaving is then always
the one production hits when one rank's storage is slower than its peers' (the reason a
client gives up on a request), whatever this machine's load.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from faults.kinds import KINDS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from faults.spec import FaultSpec
    from hicache_runtime.contracts.topology import RankInfo

log = logging.getLogger(__name__)

_PREFIX = "hicache/fault/prefetch-io-done"
_POLL_S = 0.01


class KeyStore(Protocol):
    """The part of ``torch.distributed.Store`` the rendezvous uses."""

    def set(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...


def needs_prefetch_rendezvous(specs: Iterable[FaultSpec], world_size: int) -> bool:
    """Whether a run arms a fault that times itself on the peers' prefetch IO."""
    return world_size > 1 and any(KINDS[s.kind].prefetch_rendezvous for s in specs)


class PrefetchIORendezvous:
    """Per rank: records that this rank's prefetch IO finished an op; on the rank a
    ``mid-prefetch-abort`` fires, waits for every peer's record of the same op."""

    def __init__(self, store: KeyStore, rank: RankInfo, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s

    def _key(self, rid: str, rank: int) -> str:
        return f"{_PREFIX}/{self.rank.dp_rank}/{rid}/{rank}"

    def finished(self, rid: str) -> None:
        """This rank's IO thread emitted its last ack of ``rid`` (or returned without)."""
        self.store.set(self._key(rid, self.rank.rank), "1")

    def wait_for_peers(self, rid: str) -> bool:
        """Block until every other rank of this DP group finished ``rid``'s IO; False (and
        a warning) when one has not within the timeout, and the fault fires anyway."""
        keys = [self._key(rid, r) for r in range(self.rank.world_size) if r != self.rank.rank]
        deadline = time.monotonic() + self.timeout_s
        # polled, not ``store.wait``: a blocking wait holds the process's store client, which
        # other threads of this rank may need meanwhile
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                log.warning("mid-prefetch-abort of %s: peers' prefetch IO not finished after "
                            "%.0f s; aborting anyway", rid, self.timeout_s)
                return False
            time.sleep(_POLL_S)
        return True
