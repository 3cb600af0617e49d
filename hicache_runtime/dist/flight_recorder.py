"""Recorded communication: every collective and p2p op of a rank goes through a :class:`Group`.

Each op is recorded in the rank's :class:`FlightRecorder` (group, per-group sequence number, op,
shapes, dtype, peer, call site, thread, state ``started`` -> ``completed``/``failed``, times),
the same facts PyTorch's Flight Recorder keeps for NCCL, but for every group, gloo included,
and with the *application* call site (the first frame outside the communication layer).
A hang or a crash leaves the per-group sequence numbers in the bundle, so the doctor can line
ranks up and see who stopped where.

A :class:`Group` is owned by one thread. SGLang's rule, kept here: two threads never run
collectives on the same communicator.

Async sends are kept (with the tensors they send) until they are *reaped*, which for gloo
means waited on: a gloo send's ``is_completed()`` stays false until someone calls ``wait()``,
however long ago the peer received it, so reaping by ``is_completed()`` keeps every send ever
made. The owner tags each send with its round (:attr:`Group.epoch`) and reaps with
:meth:`Group.wait_through`, naming a round whose sends the peer must already have received
(the wait then returns at once), or whose sends it is right to wait for (backpressure). A
work is waited on exactly once: gloo's second ``wait()`` blocks until the timeout.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.outcome import FLIGHT_RECORD_ATTR

ReduceOpType = dist.ReduceOp.RedOpType
"""What ``dist.ReduceOp.SUM`` and its siblings are (torch types them so, not as ``ReduceOp``)."""

if TYPE_CHECKING:
    from hicache_runtime.telemetry.tracer import Tracer

#: Frames in these modules are the recording machinery; an op's call site is the first frame
#: outside them. Matched on the package-relative path, so a renamed module cannot slip through
#: as a call site unnoticed (tests compare recorded sites across ranks).
_SKIP_FILES = tuple(os.path.join("dist", name)
                    for name in ("flight_recorder.py", "protocols.py", "groups.py"))
_SIZE = torch.int64


class FlightRecorder:
    """A bounded ring of op records for one rank. Thread-safe."""

    def __init__(self, capacity: int = 8192) -> None:
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def start(self, group: str, seq: int, op: str, tensors: list[torch.Tensor],
              peer: int | None) -> dict[str, Any]:
        rec = {
            "group": group, "seq": seq, "op": op,
            "shapes": [list(t.shape) for t in tensors],
            "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
            "peer": peer, "site": call_site(), "state": "started",
            "thread": threading.current_thread().name, "t_start_ns": time.monotonic_ns(),
            "t_end_ns": None,
        }
        with self._lock:
            self._ring.append(rec)
        return rec

    @staticmethod
    def finish(rec: dict[str, Any], error: BaseException | None = None) -> None:
        rec["t_end_ns"] = time.monotonic_ns()
        rec["state"] = "completed" if error is None else "failed"
        if error is not None:
            rec["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            # gloo's timeout is a plain RuntimeError: the op's record (how long it waited, in
            # which group) is what tells a timeout apart (contracts.outcome.classify)
            with contextlib.suppress(AttributeError, TypeError):
                setattr(error, FLIGHT_RECORD_ATTR, rec)

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(r) for r in self._ring]


def call_site() -> str:
    """``file:line:function`` of the first caller outside the communication layer."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_SKIP_FILES):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}:{code.co_name}"


@dataclass
class PendingSend:
    """An async send not reaped yet: its work, its flight record, the tensors it keeps alive
    and the owner's round it was made in."""

    work: dist.Work
    rec: dict[str, Any]
    tensors: list[torch.Tensor]
    epoch: int


@dataclass
class Group:
    """One process group, used by one thread; every op is recorded.

    ``ranks`` are global ranks in group order; ``peer`` arguments are global ranks."""

    name: str
    pg: dist.ProcessGroup | None
    ranks: list[int]
    rank: int
    recorder: FlightRecorder
    tracer: Tracer | None = None
    seq: int = 0
    pending: list[PendingSend] = field(default_factory=list)
    """Async sends not reaped yet, oldest first (with the tensors they keep alive)."""
    epoch: int = 0
    """The owner's current round: each send is tagged with it (see :meth:`wait_through`)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _begin(self, op: str, tensors: list[torch.Tensor], peer: int | None) -> dict[str, Any]:
        self.seq += 1
        rec = self.recorder.start(self.name, self.seq, op, tensors, peer)
        if self.tracer is not None:
            self.tracer.emit(Ev.COLLECTIVE_ENTER, group=self.name, seq=self.seq, op=op,
                             site=rec["site"], peer=peer)
        return rec

    def _end(self, rec: dict[str, Any], error: BaseException | None = None) -> None:
        FlightRecorder.finish(rec, error)
        if self.tracer is not None:
            self.tracer.emit(Ev.COLLECTIVE_EXIT, group=self.name, seq=rec["seq"], op=rec["op"],
                             state=rec["state"])

    def _run(self, op: str, tensors: list[torch.Tensor], peer: int | None, fn: Any) -> Any:
        rec = self._begin(op, tensors, peer)
        try:
            out = fn()
        except BaseException as exc:
            self._end(rec, exc)
            raise
        self._end(rec)
        return out

    # --- collectives --------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpType = dist.ReduceOp.SUM
                   ) -> torch.Tensor:
        if self.size == 1:
            return tensor
        name = {dist.ReduceOp.SUM: "all_reduce", dist.ReduceOp.MIN: "all_reduce_min",
                dist.ReduceOp.MAX: "all_reduce_max"}.get(op, "all_reduce")
        self._run(name, [tensor], None, lambda: dist.all_reduce(tensor, op=op, group=self.pg))
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        if self.size == 1:
            return [obj]
        self._run("all_gather_object", [], None,
                  lambda: dist.all_gather_object(out, obj, group=self.pg))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.size > 1:
            self._run("broadcast", [tensor], src,
                      lambda: dist.broadcast(tensor, src=src, group=self.pg))
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        self._run("broadcast_object", [], src,
                  lambda: dist.broadcast_object_list(box, src=src, group=self.pg))
        return box[0]

    # --- point to point ----------------------------------------------------------------------

    def isend(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        rec = self._begin("isend", [tensor], dst)
        try:
            work = dist.isend(tensor, dst=dst, group=self.pg)
        except BaseException as exc:
            self._end(rec, exc)
            raise
        assert work is not None
        self.pending.append(PendingSend(work, rec, [tensor], self.epoch))
        return work

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self._run("recv", [tensor], src, lambda: dist.recv(tensor, src=src, group=self.pg))
        return tensor

    def isend_object(self, obj: Any, dst: int) -> None:
        """Send a picklable object: its size, then its bytes (both async, FIFO per peer)."""
        data = _pickle(obj)
        self.isend(torch.tensor([data.numel()], dtype=_SIZE), dst)
        self.isend(data, dst)

    def recv_object(self, src: int) -> Any:
        size = torch.zeros(1, dtype=_SIZE)
        self.recv(size, src)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.recv(data, src)
        return pickle.loads(data.numpy().tobytes())

    def wait_pending(self, count: int | None = None) -> None:
        """Wait for the oldest ``count`` async sends of this group (all by default): bounds
        in-flight sends and applies backpressure to a sender that runs ahead."""
        n = len(self.pending) if count is None else min(count, len(self.pending))
        self._wait(n)

    def wait_through(self, epoch: int) -> int:
        """Wait for (and forget) every send made in round ``epoch`` or before, oldest first.
        The owner names a round whose sends the peer must have received already, so this
        returns at once, or one it means to wait for. Returns how many are still pending."""
        n = 0
        while n < len(self.pending) and self.pending[n].epoch <= epoch:
            n += 1
        self._wait(n)
        return len(self.pending)

    def _wait(self, n: int) -> None:
        done, self.pending = self.pending[:n], self.pending[n:]
        for i, p in enumerate(done):
            try:
                p.work.wait()
            except BaseException as exc:
                self._end(p.rec, exc)
                self.pending[:0] = done[i + 1:]  # not waited: still pending
                raise
            self._end(p.rec)

    def reap_completed(self) -> int:
        """Forget the leading async sends whose ``is_completed()`` is true; returns how many
        are still pending. With gloo that is none until someone waits: the pre-fix reaping
        (SGLang 0.5.13 ``_reap_completed_async_work``), kept for the legacy paths."""
        n = 0
        while n < len(self.pending) and self.pending[n].work.is_completed():
            n += 1
        for p in self.pending[:n]:
            self._end(p.rec)
        del self.pending[:n]
        return len(self.pending)

    def pending_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.pending for t in p.tensors)

    def close(self) -> None:
        """Forget pending sends (the run is over, or failed)."""
        self.pending.clear()


def _pickle(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
