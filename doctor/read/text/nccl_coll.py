"""NCCL's own record of every collective it enqueues (``NCCL_DEBUG=INFO`` with
``NCCL_DEBUG_SUBSYS=COLL``), one line per call on every rank::

    host:pid:tid [dev] NCCL INFO Broadcast: opCount 0 sendbuff 0x.. recvbuff 0x.. count 53
        datatype 4 op 0 root 0 comm 0x.. [nranks=8] stream 0x..

(NCCL ``src/enqueue.cc``, the ``INFO(NCCL_COLL, ...)`` of each call.) ``opCount`` numbers the
calls of one communicator alike on every rank, so lines of several ranks line up as a flight
recorder's entries do: the doctor's cross-rank alignment (:mod:`doctor.ranks.collectives`)
then finds ranks that, at the same call, ran another op or fed other sizes. The datatype is
part of the call's identity (every rank of a collective must pass the same one): two ranks
whose calls at one ``opCount`` differ in datatype are in different calls, not in one call with
different sizes. The communicator's address differs per process, so a group is named by its
size and, where a process uses several communicators of that size, by the order in which it
first used each (ranks set up and first use their communicators in the same order). The rank
is the one the line's prefixes named, else the CUDA device (one node).
"""

from __future__ import annotations

from doctor.model.evidence import Collective, SourceRef
from signatures.linear import linear

TRIGGER = "NCCL INFO"
_COLL = linear(r"(?:^|[\s:])(?P<proc>[\w.-]{1,253}:\d{1,9}):\d{1,9} \[(?P<dev>\d{1,4})\] NCCL INFO "
               r"(?P<op>[A-Za-z]{2,40}): opCount (?P<seq>[0-9a-fA-F]{1,16}) sendbuff \S{1,40} "
               r"recvbuff \S{1,40} count (?P<count>\d{1,20}) datatype (?P<dt>\d{1,3}) "
               r"op \d{1,3} root -?\d{1,9} comm (?P<comm>\S{1,40}) \[nranks=(?P<n>\d{1,7})\]")
MAX_COMMS = 4096


class NcclCollectives:
    """Reads the collective records of one input, naming each process's communicators."""

    def __init__(self) -> None:
        self._names: dict[tuple[str, str], str] = {}
        self._used: dict[tuple[str, str], int] = {}

    def read(self, text: str, source: SourceRef) -> tuple[int, Collective] | None:
        """(the CUDA device the line names, its collective), or None when ``text`` is no
        NCCL collective record."""
        m = _COLL.search(text) if "opCount" in text else None
        if m is None:
            return None
        return int(m.group("dev")), Collective(
            group=self._group(m.group("proc"), m.group("comm"), m.group("n")),
            seq=int(m.group("seq"), 16), op=f"{m.group('op')}[datatype {m.group('dt')}]",
            state="enqueued", sizes=f"count {m.group('count')}", site=None, source=source)

    def _group(self, proc: str, comm: str, nranks: str) -> str:
        name = self._names.get((proc, comm))
        if name is None:
            k = self._used.get((proc, nranks), 0)
            name = f"nccl[nranks={nranks}]" + (f"#{k + 1}" if k else "")
            if len(self._names) < MAX_COMMS:
                self._used[(proc, nranks)] = k + 1
                self._names[(proc, comm)] = name
        return name
