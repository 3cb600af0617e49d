"""Facts about how ranks ended: kills, fatal signals, the rank that failed first, and a
collective that aborted on a size its peers did not expect.

A rank the launcher stopped after its dump (see :mod:`doctor.ranks.exits`) did not fail; a rank
that failed on its own (an in-app exception, a fatal signal, a C++ abort) makes its peers'
timeouts, lost connections and blocked collectives consequences (``peer-exited-first``).
"""

from __future__ import annotations

from doctor.facts.factset import FactSet, witness
from doctor.facts.injected import killed_on_purpose
from doctor.model.builder import Evidence
from doctor.model.evidence import ExceptionRecord, RankEvidence
from doctor.model.findings import RankCondition, RankRow
from doctor.model.frames import FrameClassifier
from doctor.ranks.exits import describe, killed_without_dump, stopped_after_dump
from doctor.ranks.table import failing_exception, is_comm_error, site_label
from signatures.fact_names import Fact
from signatures.matching import Witness


def fact_exits(ev: Evidence, frames: FrameClassifier, rows: list[RankRow],
               facts: FactSet) -> None:
    """Kills, fatal signals and the ranks that failed on their own (then their peers)."""
    died: list[int] = []
    on_purpose = killed_on_purpose(ev)
    for r in ev.ranks.values():
        thrown = uncaught_cxx(r)
        for x in r.exits:
            if stopped_after_dump(x):
                continue  # the launcher stopped a rank after collecting its evidence
            if r.rank in on_purpose and x.signal == "SIGKILL":
                died.append(r.rank)  # an injected rank-kill (injected-failure says so)
                continue
            if killed_without_dump(x) or (x.exit_code == -9 and x.dumped is None):
                facts.add(Fact.OOM_KILLED, witness(f"rank {r.rank} {describe(x)}", x.source,
                                                   r.rank))
            if x.signal in ("SIGSEGV", "SIGBUS") or (x.signal == "SIGABRT" and thrown is None):
                facts.add(Fact.PROCESS_SEGFAULT, witness(
                    f"rank {r.rank} died of {x.signal} (exit {x.exit_code})", x.source, r.rank))
            if x.root_cause or x.signal in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGKILL"):
                died.append(r.rank)  # a plain non-zero exit is usually a peer's consequence
        for t in r.threads:
            if t.fatal and not (thrown is not None and "Abort" in t.fatal):
                facts.add(Fact.PROCESS_SEGFAULT, witness(
                    f"rank {r.rank}: Fatal Python error: {t.fatal} in thread {t.tid} at "
                    f"{site_label(frames.innermost_caller(t.frames))}", t.source, r.rank))
                died.append(r.rank)
        exc = failing_exception(r, frames)
        if exc is not None and not is_comm_error(exc) and (frames.in_app_frames(exc.frames)
                                                          or not exc.frames):
            died.append(r.rank)
    _peer_exited(ev, set(died), rows, facts)


def uncaught_cxx(r: RankEvidence) -> ExceptionRecord | None:
    """The uncaught C++ exception the rank's log shows (``terminate called after throwing an
    instance of 'gloo::EnforceNotMet'``, read as a frameless record of a namespaced type): the
    SIGABRT that follows is that exception's, a named error, not a fault in memory."""
    return next((e for e in r.exceptions if not e.frames and "::" in e.type), None)


def _peer_exited(ev: Evidence, died: set[int], rows: list[RankRow], facts: FactSet) -> None:
    """Ranks that failed on their own, and peers that then lost them: a closed connection, or
    a collective they waited in (blocked, or timed out). The peers' state is a consequence."""
    if not died:
        return
    first = sorted(died)
    by_rank = {row.rank: row for row in rows}
    for r in ev.ranks.values():
        if r.rank in died:
            continue
        closed = list(r.hits.get("gloo-connection-closed", _EMPTY).kept)
        row = by_rank.get(r.rank)
        if closed:
            h = closed[0]
            facts.add(Fact.PEER_EXITED_FIRST, witness(
                f"rank {r.rank} lost its peer ({h.groups.get('what', 'connection closed')}) "
                f"after ranks {first} died", h.source, r.rank))
        elif row is not None and row.state == RankCondition.BLOCKED:
            facts.add(Fact.PEER_EXITED_FIRST, Witness(
                f"rank {r.rank} waited in a collective at {row.site or row.frame} after ranks "
                f"{first} failed on their own" + (f" ({row.error})" if row.error else "")[:160],
                rank=r.rank))


def fact_size_abort(ev: Evidence, rows: list[RankRow], facts: FactSet) -> None:
    """gloo's size check aborted a rank while its thread sat in a collective: the collective
    was fed a size this rank did not expect (the structure behind the message)."""
    by_rank = {row.rank: row for row in rows}
    for r in ev.all_ranks():
        row = by_rank.get(r.rank)
        where = (row.site or row.frame) if row is not None else None
        for h in r.hits.get("gloo-size-mismatch", _EMPTY).kept:
            got, want = h.groups.get("got"), h.groups.get("expected")
            sizes = f": {got} bytes arrived where it expected {want}" if got and want else ""
            if where is None:
                # no stack says where, but the transport's own check is the structure: a peer
                # sent more bytes than this rank posted for the same collective
                facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, witness(
                    f"gloo's transport caught a peer sending more than this rank posted for the "
                    f"same collective{sizes}", h.source, r.rank))
                continue
            facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, witness(
                f"rank {r.rank} failed inside the collective entered from {where}{sizes}",
                h.source, r.rank))
            _peer_sizes(ev, r.rank, where, facts)


def _peer_sizes(ev: Evidence, rank: int, where: str, facts: FactSet) -> None:
    """What the peers fed the same call site's last collective (their flight recorders; the
    runtime's named groups before torch's numbered copy of the same op)."""
    for peer in ev.ranks.values():
        if peer.rank == rank:
            continue
        lasts = [ring[-1] for _, ring in sorted(peer.collectives.items(),
                                                key=lambda kv: (kv[0].isdigit(), kv[0])) if ring]
        for last in lasts:
            if site_label(last.site) == where and last.state != "completed":
                facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, witness(
                    f"rank {peer.rank} was in the same collective ({last.group} #{last.seq} "
                    f"{last.op}, {last.state}) with sizes {last.sizes}", last.source, peer.rank))
                break


class _Empty:
    kept: tuple[()] = ()


_EMPTY = _Empty()
