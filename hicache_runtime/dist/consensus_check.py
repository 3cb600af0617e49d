"""The rank consensus check (``--consensus-check``): it decides nothing, it verifies that the
decisions every rank took independently are the same, and names the first that is not.

Decisions are the agreed-on parts of decision events (``DECISION_ATTRS``) that the scheduler
thread emits; they are hashed in batches and compared on the ``consensus`` group by a thread of
their own. The scheduler also waits at one point of every step (:meth:`ConsensusChecker.verify`,
before the step's batch runs) until every rank is there and every decision of every rank so
far has been compared: a divergence then always stops the ranks before a collective that
depends on it can fail on mismatched shapes (which, on gloo, aborts a rank in native code and
leaves only what its peers saw).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hicache_runtime.contracts.errors import RankDivergence
from hicache_runtime.contracts.events import Ev

if TYPE_CHECKING:
    from hicache_runtime.dist.flight_recorder import Group
    from hicache_runtime.telemetry.tracer import Tracer


class ConsensusChecker:
    """``--consensus-check``: decisions that must be identical on every rank are hashed and
    compared on a side group; a mismatch names the first divergent decision.

    The scheduler thread records decisions (via the tracer's observer hook); a daemon thread
    agrees on how many every rank has (MIN), MIN/MAX-reduces a digest of that many, and on a
    mismatch gathers them to find the first that differs. Named after SGLang's
    ``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER`` (0.5.23 names the variable in
    ``sglang/test/test_utils.py``; its checker is not in the wheel, so nothing here claims to
    model it): the report says *which* decision diverged, and the per-step gate
    (:meth:`verify`) is this runtime's own, a diagnostic that no release has.
    """

    def __init__(self, group: Group, tracer: Tracer, interval_s: float = 0.05) -> None:
        self.group = group
        self.tracer = tracer
        self.interval_s = interval_s
        self._decisions: list[str] = []
        self._lock = threading.Lock()
        self._checked = 0
        self._stop = threading.Event()
        self._abandon = threading.Event()
        self._wake = threading.Event()
        self._barrier = -1
        """The step the scheduler waits at in :meth:`verify` (-1: it is not waiting)."""
        self._released = threading.Condition(self._lock)
        self._released_step = -1
        self.divergence: str | None = None
        self._thread = threading.Thread(target=self._loop, name="hicache-consensus",
                                        daemon=True)

    def start(self) -> ConsensusChecker:
        self._thread.start()
        return self

    def on_event(self, kind: str, attrs: dict[str, Any]) -> None:
        """Tracer hook (scheduler thread): keep the agreed part of decision events."""
        keys = DECISION_ATTRS.get(kind)
        if keys is None or threading.current_thread() is not threading.main_thread():
            return
        text = kind + json.dumps({k: attrs.get(k) for k in keys}, sort_keys=True, default=str)
        with self._lock:
            self._decisions.append(f"step {self.tracer.step}|{text}")

    def check(self) -> None:
        """Raise :class:`RankDivergence` on the scheduler thread once a mismatch was found."""
        if self.divergence is not None:
            raise RankDivergence(self.divergence)

    def verify(self, step: int, timeout_s: float) -> None:
        """Scheduler thread, at the same point of every step on every rank: wait until a round
        saw every rank here with all its decisions compared (or found the first that differs,
        a count that differs included), then :meth:`check`. Gives up after ``timeout_s`` (a
        peer that never arrives fails on its own) and lets the step go on."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._barrier = step
        self._wake.set()
        with self._lock:
            while (self._released_step != step and self.divergence is None
                   and self._thread.is_alive() and time.monotonic() < deadline):
                self._released.wait(0.05)
            self._barrier = -1
        self.check()

    def stop(self, agreed: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the thread and join it. ``agreed``: every rank is stopping; the thread keeps
        taking rounds until all of them say so, checks what is left and ends, so no rank
        walks out of a round its peers are in (they would sit in it until the timeout, and a
        round still running at process exit aborts it). Without it (a failed rank), leave at
        once."""
        self._stop.set()
        if not agreed:
            self._abandon.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    @property
    def running(self) -> bool:
        """The thread has not ended (it may be inside a collective on the consensus group)."""
        return self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._abandon.is_set():
                return
            with self._lock:
                have, barrier = len(self._decisions), self._barrier
            new = have - self._checked
            # One MIN carries everything: the fewest new decisions on any rank, 1 once all
            # ranks stop, and (negated) the most new decisions and each rank's barrier step.
            got = self.group.all_reduce(
                torch.tensor([new, int(self._stop.is_set()), -new, barrier, -barrier]),
                dist.ReduceOp.MIN).tolist()
            n, all_stopping, n_max = int(got[0]), int(got[1]) == 1, -int(got[2])
            at_barrier = int(got[3]) == -int(got[4]) == barrier >= 0
            if n > 0 and not self._check_batch(n):
                return
            if at_barrier and n == 0 and n_max > 0:
                # every rank waits at the same step, and some took decisions the others did
                # not: the first one past the common prefix is the divergence
                with self._lock:
                    extra = self._decisions[self._checked : self._checked + n_max]
                self._report(extra)
                return
            if at_barrier and n_max == n:
                with self._lock:  # every decision of every rank up to this step agreed
                    self._released_step = barrier
                    self._released.notify_all()
            if all_stopping:
                return

    def _check_batch(self, n: int) -> bool:
        """Compare the next ``n`` decisions; False once a divergence was found."""
        with self._lock:
            batch = self._decisions[self._checked : self._checked + n]
        digest = int.from_bytes(hashlib.sha256("\n".join(
            d.split("|", 1)[1] for d in batch).encode()).digest()[:7], "little")
        lo = self.group.all_reduce(torch.tensor([digest]), dist.ReduceOp.MIN).item()
        hi = self.group.all_reduce(torch.tensor([digest]), dist.ReduceOp.MAX).item()
        if lo != hi:
            self._report(batch)
            return False
        self._checked += n
        self.tracer.emit(Ev.CONSENSUS, checked=self._checked)
        return True

    def _report(self, batch: list[str]) -> None:
        every = self.group.all_gather_object(batch)
        for i in range(max(len(b) for b in every)):
            values = [b[i].split("|", 1)[1] if i < len(b) else None for b in every]
            if len(set(values)) > 1:
                ranks = "; ".join(f"rank {r}: {b[i]}" for r, b in
                                  zip(self.group.ranks, every) if i < len(b))
                self.divergence = (f"Found rank divergence: first divergent decision "
                                   f"#{self._checked + i}: {ranks}")
                self.tracer.emit(Ev.CONSENSUS, divergent=self._checked + i,
                                 decisions=[b[i] for b in every if i < len(b)])
                return


#: Decision events whose listed attributes must be identical on every rank.
DECISION_ATTRS: dict[str, tuple[str, ...]] = {
    Ev.BATCH: ("decode", "rids", "extend", "prefix", "tokens", "slot"),
    Ev.MATCH: ("rid", "device", "host", "loaded"),
    Ev.EVICT: ("want", "evicted", "victims"),
    Ev.EVICT_HOST: ("want", "evicted", "victims"),
    Ev.WRITE_SKIP: ("node", "tokens"),
    Ev.PREFETCH_SETTLE: ("rid", "completed", "inserted"),
    Ev.REQ_ADMIT: ("rid", "prefix", "device_hit", "host_hit", "storage_hit"),
    Ev.CHUNK_SIZE: ("rid", "history", "size"),
    Ev.PREFETCH_PARTIAL: ("rid", "pages"),
}
