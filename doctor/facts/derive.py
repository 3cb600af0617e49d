"""Deriving structural facts (:class:`signatures.fact_names.Fact`) from the evidence.

Each ``_fact_*`` function reads one part of the evidence and adds facts with witnesses. This
module covers outcomes, stacks, collectives, exits and exceptions; :mod:`doctor.facts.trace`
covers the runtime's traces and state snapshots. ``derive_facts`` runs them all; a function that
fails on odd evidence is reported as a problem and the others still run.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

from doctor.facts.exits import fact_exits, fact_size_abort, uncaught_cxx
from doctor.facts.factset import FactSet, witness
from doctor.facts.injected import fact_injected
from doctor.facts.trace import TRACE_FACTS
from doctor.model.builder import Evidence
from doctor.model.evidence import (
    ExceptionRecord,
    Frame,
    InputStatus,
    KvLineKind,
    LogHit,
    RankEvidence,
    ThreadState,
)
from doctor.model.findings import (
    BlockedSite,
    CollectiveFinding,
    Divergence,
    FindingKind,
    RankCondition,
    RankRow,
)
from doctor.model.frames import FrameClassifier, checks_configuration, is_prefetch_vote
from doctor.ranks.collectives import watchdog_moments
from doctor.ranks.table import failing_exception, is_comm_error, site_label
from doctor.read.ingest import EMPTY
from hicache_runtime.contracts.bundle import RunOutcome
from signatures.fact_names import Fact
from signatures.index import UpstreamIndex, load_index
from signatures.index.failures import FailureKind, classify
from signatures.matching import MechanismHit, Witness

_CONFIG_FRAMES = re.compile(r"server_args|__post_init__|check_server_args|load_config|"
                            r"parse_args|from_cli_args|prepare_server_args|validate_config")
_CONFIG_TYPES = re.compile(r"(ConfigError|ValueError|TypeError|ArgumentError|ArgumentTypeError|"
                           r"AssertionError|SystemExit)$")
_INVARIANT_TYPES = re.compile(r"(InvariantViolation|DoubleAllocation|DoubleFree)$")


def derive_facts(evidence: Evidence, frames: FrameClassifier, rows: list[RankRow],
                 sites: list[BlockedSite], findings: list[CollectiveFinding],
                 divergences: list[Divergence], problem: Callable[[str], None],
                 mechs: Sequence[MechanismHit] = ()) -> FactSet:
    """Every fact the evidence supports. ``mechs`` (what the upstream index read) tells a
    warning that states a failure from a healthy server's chatter."""
    facts = FactSet()
    steps: list[Callable[[], None]] = [
        lambda: _fact_outcome(evidence, frames, rows, facts),
        lambda: _fact_stacks(evidence, sites, rows, facts),
        lambda: _fact_collectives(findings, facts),
        lambda: fact_exits(evidence, frames, rows, facts),
        lambda: fact_size_abort(evidence, rows, facts),
        lambda: fact_injected(evidence, facts),
        lambda: _fact_exceptions(evidence, frames, facts),
        lambda: _fact_logs(evidence, facts),
        lambda: _fact_same_collective(evidence, sites, rows, facts),
        lambda: _fact_stated_sizes(evidence, facts),
        lambda: _fact_collective_reports(evidence, facts),
        lambda: _fact_fingerprints(evidence, facts),
        lambda: _fact_unranked_stacks(evidence, frames, facts),
        lambda: _fact_kv_layers(evidence, facts),
    ]
    steps += [functools.partial(f, evidence, divergences, facts) for f in TRACE_FACTS]
    for step in steps:
        try:
            step()
        except Exception as exc:  # one analyzer's bug must not stop the others
            problem(f"a fact analyzer failed ({type(exc).__name__}: {exc}); its facts are missing")
    _fact_no_failure(evidence, facts, mechs)
    _fact_store_without_kv_cache(evidence, facts, mechs)
    return facts


def _fact_collective_reports(ev: Evidence, facts: FactSet) -> None:
    """What torch's own cross-rank checks printed: ``Detected mismatch between collectives``
    (a different op or sequence number: an ordering fault; the same op with other shapes: a
    size fault) and the NCCL desync report (ranks that never joined; ranks in different ops)."""
    started: dict[str, Witness] = {}
    for r in ev.all_ranks():
        for h in r.hits.get("collective-fingerprint-mismatch", _EMPTY).kept:
            g = h.groups
            if "op_b" not in g:
                continue
            w = witness(h.text, h.source, r.rank)
            seq_a, seq_b = g.get("seq_a"), g.get("seq_b")
            at_a = f" #{seq_a}" if seq_a else ""
            at_b = f" #{seq_b}" if seq_b else ""
            aspects = _aspects(g.get("aspects") or "")
            if g["op_a"] != g["op_b"] or seq_a != seq_b or aspects & {"seq", "op"}:
                text = (f"rank {g['rank_a']} runs {g['op_a']}{at_a} while rank "
                        f"{g['rank_b']} runs {g['op_b']}{at_b}")
                facts.add(Fact.COLLECTIVE_OP_MISMATCH, Witness(text, w.file, w.line, w.rank))
                # two ranks inside different collectives at the same moment: the ranks took
                # different paths, as blocked stacks at two call sites would show
                facts.add(Fact.BLOCKED_SITES_DIVERGE, Witness(
                    f"torch's collective check: {text}", w.file, w.line, w.rank))
            elif g.get("shape_a") != g.get("shape_b") or aspects & {"shape", "dtype"}:
                said = f" (torch: the {', '.join(sorted(aspects))} differ)" if aspects else ""
                facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, Witness(
                    f"{g['op_a']}{at_a}: rank {g['rank_a']} shape [{g.get('shape_a')}], "
                    f"rank {g['rank_b']} shape [{g.get('shape_b')}]{said}", w.file, w.line,
                    w.rank))
        for h in r.hits.get("collective-members-disagree", _EMPTY).kept:
            if classify(h.text, None) is FailureKind.SHAPE:
                facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, witness(
                    f"the collective's own check: its members fed it different sizes: "
                    f"{h.text[:240]}", h.source, r.rank))
        for h in r.hits.get("nccl-desync-lagging", _EMPTY).kept:
            facts.add(Fact.RANK_MISSING_FROM_COLLECTIVE, witness(
                f"ranks [{h.groups['ranks']}] never joined collective #{h.groups['seq']}: "
                f"{h.text}", h.source, r.rank))
        for h in r.hits.get("nccl-desync-state", _EMPTY).kept:
            if h.groups.get("state") == "started":
                started.setdefault(h.groups["op"], witness(h.text, h.source, r.rank))
        for h in r.hits.get("fr-analyzer-mismatch", _EMPTY).kept:
            kind = h.groups.get("kind", "")
            fact = {"SIZE_OR_SYNTAX_MISMATCH": Fact.COLLECTIVE_SIZE_MISMATCH,
                    "COLLECTIVE_DTYPE_MISMATCH": Fact.COLLECTIVE_SIZE_MISMATCH,
                    "COLLECTIVE_TYPE_MISMATCH": Fact.COLLECTIVE_OP_MISMATCH,
                    "COLLECTIVE_STATE_MISMATCH": Fact.RANK_MISSING_FROM_COLLECTIVE}.get(kind)
            if fact is not None:
                facts.add(fact, witness(f"torch's Flight Recorder analyzer: {h.text}", h.source,
                                        r.rank))
    if len(started) >= 2:
        w = next(iter(started.values()))
        facts.add(Fact.COLLECTIVE_OP_MISMATCH, Witness(
            "the desync report has ranks started in different collectives: "
            + ", ".join(sorted(started)), w.file, w.line, w.rank))


#: torch's list of what differs between two ranks' collectives (ProcessGroupWrapper.cpp,
#: ``CollectiveFingerPrint::compute_collective_diff``): "Sequence number: 5vs 6", "Op type:
#: ...", "Tensor Tensor shapes: ...", "Tensor Tensor dtypes: ...", "Tensor Tensor devices".
_ASPECTS = {"seq": "Sequence number:", "op": "Op type:", "shape": "Tensor shapes:",
            "dtype": "Tensor dtypes:", "device": "Tensor devices:"}


def _aspects(text: str) -> set[str]:
    """Which aspects torch's collective check says differ (empty: it did not say)."""
    return {k for k, said in _ASPECTS.items() if said in text}


_FINGERPRINT = re.compile(
    r"Rank\s+(?P<rank>\d{1,6})\s+is\s+running\s+(?:inconsistent\s+)?collective:\s*"
    r"CollectiveFingerPrint\((?:\s*SequenceNumber\s*=\s*(?P<seq>\d{1,12}),?)?\s*"
    r"OpType\s*=\s*(?P<op>\w{1,40})(?:,\s*TensorShape\s*=\s*\[(?P<shape>[\d,\s]{0,200})\])?")


def _fact_fingerprints(ev: Evidence, facts: FactSet) -> None:
    """torch's collective check (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) as exceptions carry it,
    over lines a paste may have broken, and one rank per message (older releases print each
    rank's own "inconsistent collective"): ranks at the same point in different collectives
    or sequence positions took different paths; the same collective with other shapes was fed
    rank-dependent sizes."""
    seen: dict[int, tuple[str | None, str, str | None, Witness]] = {}
    aspects: set[str] = set()
    for r in ev.all_ranks():
        for e in r.exceptions:
            if "CollectiveFingerPrint" not in e.message:
                continue
            aspects |= _aspects(e.message[:20000])
            for m in _FINGERPRINT.finditer(e.message[:20000]):
                rank = int(m["rank"])
                shape = " ".join(m["shape"].split()) if m["shape"] is not None else None
                seen.setdefault(rank, (m["seq"], m["op"], shape,
                                       witness(e.text[:300], e.source, r.rank)))
    if len(seen) < 2:
        return
    (ra, (sa, oa, sha, wa)), (rb, (sb, ob, shb, _)) = sorted(seen.items())[:2]
    if oa != ob or (sa is not None and sb is not None and sa != sb) or aspects & {"seq", "op"}:
        text = (f"rank {ra} runs {oa}{f' #{sa}' if sa else ''} while rank {rb} runs "
                f"{ob}{f' #{sb}' if sb else ''}")
        facts.add(Fact.COLLECTIVE_OP_MISMATCH, Witness(text, wa.file, wa.line, wa.rank))
        facts.add(Fact.BLOCKED_SITES_DIVERGE, Witness(f"torch's collective check: {text}",
                                                      wa.file, wa.line, wa.rank))
    elif (sha is not None and shb is not None and sha != shb) or aspects & {"shape", "dtype"}:
        facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, Witness(
            f"{oa}: rank {ra} shape [{sha}], rank {rb} shape [{shb}]", wa.file, wa.line,
            wa.rank))


def _fact_unranked_stacks(ev: Evidence, frames: FrameClassifier, facts: FactSet) -> None:
    """Stacks pasted without their ranks: two main threads blocked in collectives entered
    from different call sites are two processes that took different paths (and when the
    operations differ too, they can never pair up)."""
    sites: dict[str, tuple[str, Witness]] = {}
    for t in ev.unranked.threads:
        if frames.state(t) != ThreadState.BLOCKED or frames.role(t) != "main":
            continue
        idx = frames.collective_index(t.frames)
        site = frames.call_site(t.frames)
        if idx is None or site is None:
            continue
        op = t.frames[idx].func.rsplit(".", 1)[-1]
        sites.setdefault(site.func.rsplit(".", 1)[-1], (op, Witness(
            f"{op} from {site_label(site)}", t.source.file, t.source.line, -1)))
    if len(sites) < 2:
        return
    first = next(iter(sites.values()))[1]
    summary = "; ".join(w.text for _, w in sites.values())
    facts.add(Fact.BLOCKED_SITES_DIVERGE, Witness(
        f"stacks of unknown ranks are blocked at different call sites: {summary}", first.file,
        first.line, -1))
    if len({op for op, _ in sites.values()}) >= 2:
        facts.add(Fact.COLLECTIVE_OP_MISMATCH, Witness(
            f"stacks of unknown ranks wait in different collective operations: {summary}",
            first.file, first.line, -1))


def _fact_kv_layers(ev: Evidence, facts: FactSet) -> None:
    """What the KV storage and transfer layers said (:mod:`doctor.read.text.kvstore`): a store that
    failed, a host pool with no room, a disaggregation transfer that failed. A transfer engine's
    failure belongs to the store when the inputs show a store in use and no disaggregation."""
    kv = ev.kv
    index = load_index()
    for r in ev.all_ranks():
        for kind, text, src in r.kv_lines:
            if _read_otherwise(text, kind, index):
                continue
            if kind == KvLineKind.STORE_FAILURE or (kind == KvLineKind.TRANSFER_FAILURE
                                                    and kv.store and not kv.pd):
                facts.add(Fact.STORAGE_ERRORS, witness(text, src, r.rank))
            elif kind == KvLineKind.POOL_PRESSURE:
                facts.add(Fact.HOST_ALLOC_FAILING, witness(
                    f"a KV cache's host pool had no room: {text}", src, r.rank))
            elif kind == KvLineKind.PD_FAILURE or (kind == KvLineKind.TRANSFER_FAILURE
                                                   and kv.pd):
                facts.add(Fact.PD_TRANSFER_ERRORS, witness(text, src, r.rank))


def _read_otherwise(text: str, kind: KvLineKind, index: UpstreamIndex) -> bool:
    """The upstream index reads a KV layer's line as another mechanism than the words did (a
    pool's bookkeeping rather than a store failing or running full; another component than a
    store): the mechanism it reads speaks instead."""
    # only a reading of the line from its start: a template that fits a phrase further in
    # (a quoted cause, or a chance run of common words) does not outweigh the line's own words
    matches = [m for m in index.match(text, limit=1) if m.anchored]
    if not matches:
        return False
    t = matches[0].template
    comp = index.template_component(t)
    failure = index.failure(t)
    if failure in (FailureKind.BOOKKEEPING, FailureKind.INVARIANT):
        return True
    if kind == KvLineKind.POOL_PRESSURE:
        return False
    return comp is None or comp.role not in ("storage", "transfer")


_DIGITS = re.compile(r"\d+")


def _fact_stated_sizes(ev: Evidence, facts: FactSet) -> None:
    """A report's own prints of what each rank fed a collective (``collective-size-stated``):
    the first statement of each rank per print (its text with the numbers taken out) and
    collective; ranks of one print that state different sizes fed that collective different
    sizes. Prints of different wording (before and after an all-gather) are never compared."""
    stated: dict[tuple[str, str], dict[int, tuple[str, LogHit]]] = {}
    for r in ev.all_ranks():  # an unprefixed print is the unranked slot's
        stats = r.hits.get("collective-size-stated")
        if not stats:
            continue
        for h in stats.kept:
            rank = h.groups.get("rank", "")
            size = (h.groups.get("shape") or h.groups.get("size") or "").replace(" ", "")
            if not rank.isdigit() or not size:
                continue
            key = (_DIGITS.sub("#", h.text), h.groups.get("op", "").replace("_", "").lower())
            stated.setdefault(key, {}).setdefault(int(rank), (size, h))
    for (_, op), by_rank in stated.items():
        sizes: dict[str, list[int]] = {}
        for who, (stated_size, _) in sorted(by_rank.items()):
            sizes.setdefault(stated_size, []).append(who)
        if len(by_rank) >= 2 and len(sizes) >= 2:
            h = next(iter(by_rank.values()))[1]
            facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, Witness(
                f"the report's prints of {op}: " + "; ".join(
                    f"ranks {rs} state size [{sz}]" for sz, rs in sizes.items()),
                h.source.file, h.source.line, -1))
            return


def _fact_same_collective(ev: Evidence, sites: list[BlockedSite], rows: list[RankRow],
                          facts: FactSet) -> None:
    """Every rank that reported waits in the same collective: watchdog timeouts naming the
    same (SeqNum, OpType), or blocked threads all at one call site."""
    moments = [m for m in watchdog_moments(ev) if len(m) >= 2]
    if moments and all(len({(t.seq, t.op) for t in m.values()}) == 1 for m in moments):
        for seen in moments:
            by_size: dict[str, list[int]] = {}
            for rank, t in sorted(seen.items()):
                if t.numel:
                    by_size.setdefault(t.numel, []).append(rank)
            if len(by_size) >= 2:
                # the same collective, fed different sizes: each rank waits for data its
                # peers will never send
                t = next(iter(seen.values()))
                facts.add(Fact.COLLECTIVE_SIZE_MISMATCH, Witness(
                    f"SeqNum {t.seq} ({t.op}): " + "; ".join(f"ranks {rs} with NumelIn={n}"
                                                             for n, rs in by_size.items()),
                    t.item.file, t.item.line, t.rank))
                return
        heads = [next(iter(m.values())) for m in moments]  # one (seq, op) per moment
        facts.add(Fact.SAME_COLLECTIVE_EVERYWHERE, Witness("; ".join(
            f"ranks {sorted(m)} all time out in SeqNum {t.seq} ({t.op})"
            for m, t in zip(moments, heads, strict=True)), heads[0].item.file,
            heads[0].item.line, heads[0].rank))
        return
    main = [s for s in sites if s.role == "main"]
    others = [r for r in rows
              if r.state in (RankCondition.IDLE, RankCondition.ACTIVE, RankCondition.CRASHED)]
    if len(main) == 1 and len(main[0].ranks) >= 2 and not others:
        s = main[0]
        e = s.evidence[0] if s.evidence else None
        facts.add(Fact.SAME_COLLECTIVE_EVERYWHERE, Witness(
            f"ranks {s.ranks} all wait in {s.op} from {s.site}", e.file if e else None,
            e.line if e else None, s.ranks[0]))


_MARKER_KEY = re.compile(r"[+~-]\d+$")
#: Log patterns that only describe a healthy server (progress, capacities, samples).
_QUIET = {"memory-sample", "host-capacity", "host-capacity-synced", "prefetch-start",
          "prefetch-result"}


#: What shows a KV cache or a serving engine in the inputs (paths, sites, words).
_SERVING = re.compile(r"(?i)sglang|vllm|lmcache|hicache|kv[ _-]?cache|kvcache|prefix[ _-]?cach|"
                      r"kv_connector|kv_transfer|dynamo|tensorrt_llm|trtllm|kvbm|infinistore|"
                      r"radix|mem_cache|offload")
_SERVING_ROLES = {"tree", "pool", "host-pool", "controller", "scheduler", "model", "pd"}


def _fact_store_without_kv_cache(ev: Evidence, facts: FactSet,
                                 mechs: Sequence[MechanismHit]) -> None:
    """A storage system failed, and nothing in the inputs shows a KV cache or a serving engine
    (the store may serve anything)."""
    stores = [h for h in mechs if h.role == "storage"]
    if not stores or any(h.role in _SERVING_ROLES or h.component in (
            "storage.lmcache", "storage.hicache", "storage.package") for h in mechs):
        return
    texts: list[str] = list(ev.kv.store)
    for r in ev.all_ranks():
        texts += list(r.sites)
        texts += [fl.text for fl in r.failure_lines.values()]
        texts += [t for t, _ in r.errors]
        texts += [f.file for e in r.exceptions for f in e.frames[:40]]
        texts += [f.file for t in r.threads for f in t.frames[:40]]
        texts += [h.text for stats in r.hits.values() for h in stats.kept]
    if any(_SERVING.search(t) for t in texts[:4000]):
        return
    w = stores[0].witness
    facts.add(Fact.STORE_WITHOUT_KV_CACHE, Witness(
        f"{stores[0].component} failed; nothing in the inputs shows a KV cache or a serving "
        "engine using it", w.file, w.line, w.rank))


def _fact_no_failure(ev: Evidence, facts: FactSet, mechs: Sequence[MechanismHit] = ()) -> None:
    """Nothing in the inputs records a failure (a benchmark printout, warnings that state
    none)."""
    if facts or ev.outcome not in (None, RunOutcome.HEALTHY) or ev.mismatches or mechs:
        return
    for r in ev.all_ranks():
        if len(r.exceptions) or len(r.threads) or r.exits or r.collectives or r.decisions \
                or len(r.errors):
            return
        # catalog marker keys (sig+3, look~1) are texts of upstream code, often plain INFO
        # lines; a failure among them also leaves an error line, an exception or a stack
        if any(pid not in _QUIET and not pid.startswith(("nccl-", "gloo-"))
               and not _MARKER_KEY.search(pid) for pid in r.hits):
            return
    # empty inputs are not output that records no failure: nothing was given at all
    if any(i.status == InputStatus.READ and i.kind != EMPTY for i in ev.inputs):
        facts.add(Fact.NO_FAILURE, Witness("no exception, stack, hang, crash or error line in "
                                           "the inputs"))


def _fact_outcome(ev: Evidence, frames: FrameClassifier, rows: list[RankRow],
                  facts: FactSet) -> None:
    src = ev.outcome_source
    if ev.outcome == RunOutcome.HANG:
        facts.add(Fact.HANG, witness("the bundle records a hang", src, -1))
    if ev.outcome == RunOutcome.CRASH:
        facts.add(Fact.CRASH, witness("the bundle records a crash", src, -1))
    if ev.outcome == RunOutcome.WRONG_OUTPUT or ev.mismatches:
        facts.add(Fact.WRONG_OUTPUT, witness(
            f"outputs differ from the cache-disabled run ({ev.mismatches} request(s))", src, -1))
    for r in ev.all_ranks():
        for pid in ("nccl-watchdog-timeout", "gloo-timeout", "scheduler-watchdog",
                    "hicache-watchdog", "nccl-watchdog-stuck", "horovod-stall",
                    "horovod-missing-ranks"):
            for h in r.hits.get(pid, _EMPTY).kept:
                facts.add(Fact.HANG, witness(h.text, h.source, r.rank))
    crashed = [row for row in rows if row.state == RankCondition.CRASHED]
    for row in crashed:
        facts.add(Fact.CRASH, Witness(f"rank {row.rank}: {row.error}", rank=row.rank))
    blocked = [row for row in rows if row.state == RankCondition.BLOCKED]
    if blocked and not crashed and len(blocked) == len(
            [r for r in rows if r.state != RankCondition.MISSING]):
        facts.add(Fact.HANG, Witness(f"every rank with stacks is blocked in a collective "
                                     f"({[r.rank for r in blocked]})"))


def _fact_stacks(ev: Evidence, sites: list[BlockedSite], rows: list[RankRow],
                 facts: FactSet) -> None:
    main = [s for s in sites if s.role == "main"]
    if len({s.site for s in main}) >= 2:
        summary = "blocked at different call sites: " + "; ".join(
            f"ranks {s.ranks} in {s.op} from {s.site}" for s in main)
        for i, s in enumerate(main):
            e = s.evidence[0] if s.evidence else None
            text = summary if i == 0 else (e.text if e else s.site)
            facts.add(Fact.BLOCKED_SITES_DIVERGE, Witness(
                text, e.file if e else None, e.line if e else None, s.ranks[0]))
    elif main:
        blocked = set(main[0].ranks)
        absent = [r.rank for r in rows if r.rank not in blocked
                  and r.state in (RankCondition.IDLE, RankCondition.ACTIVE)]
        if absent:
            facts.add(Fact.BLOCKED_SITES_DIVERGE, Witness(
                f"ranks {sorted(blocked)} wait in {main[0].op} from {main[0].site}; "
                f"ranks {absent} are not in any collective"))
    for s in sites:
        if s.role == "prefetch":
            e = s.evidence[0] if s.evidence else None
            facts.add(Fact.BLOCKED_IN_PREFETCH_VOTE, Witness(
                f"ranks {s.ranks}: a prefetch thread is blocked in {s.op} from {s.site}",
                e.file if e else None, e.line if e else None, s.ranks[0]))
    with_stacks = [r for r in rows if r.state in (RankCondition.IDLE, RankCondition.ACTIVE,
                                                  RankCondition.BLOCKED, RankCondition.CRASHED)]
    # idle after the end is no hang
    finished = ev.outcome in (RunOutcome.HEALTHY, RunOutcome.WRONG_OUTPUT)
    if with_stacks and not finished and all(r.state == RankCondition.IDLE for r in with_stacks):
        facts.add(Fact.ALL_RANKS_IDLE, Witness(
            f"ranks {[r.rank for r in with_stacks]}: every thread waits for work; none is "
            "inside a collective"))


def _fact_collectives(findings: list[CollectiveFinding], facts: FactSet) -> None:
    kinds = {FindingKind.MISSING_RANKS: Fact.RANK_MISSING_FROM_COLLECTIVE,
             FindingKind.SEQ_BEHIND: Fact.RANK_MISSING_FROM_COLLECTIVE,
             FindingKind.OP_MISMATCH: Fact.COLLECTIVE_OP_MISMATCH,
             FindingKind.SITE_MISMATCH: Fact.COLLECTIVE_OP_MISMATCH,
             FindingKind.SIZE_MISMATCH: Fact.COLLECTIVE_SIZE_MISMATCH,
             FindingKind.CROSSED: Fact.BLOCKED_SITES_DIVERGE,
             # a receive that waits for a send that never came is p2p's missing rank; a send
             # nobody received is what any rank leaves behind when its peer fails: no fact
             FindingKind.UNMATCHED_RECV: Fact.RANK_MISSING_FROM_COLLECTIVE}
    for f in findings:
        if f.kind not in kinds:
            continue
        ev = f.evidence[0] if f.evidence else None
        facts.add(kinds[f.kind], Witness(f"group {f.group} {f.detail}", ev.file if ev else None,
                                         ev.line if ev else None, -1))
        if f.kind == FindingKind.MISSING_RANKS and is_prefetch_vote(f.group, f.func):
            # peers entered a prefetch vote a rank never joined: they wait in it, whether or
            # not a stack still shows them there (the timeout may have unwound it first)
            facts.add(Fact.BLOCKED_IN_PREFETCH_VOTE, Witness(
                f"the prefetch vote of group {f.group}: {f.detail}",
                ev.file if ev else None, ev.line if ev else None, -1))
        if f.kind == FindingKind.CROSSED:
            # each rank waits in a collective the others never entered: ranks are missing
            # from a collective, seen from every side at once
            facts.add(Fact.RANK_MISSING_FROM_COLLECTIVE, Witness(
                f"group {f.group}: ranks {f.ranks} each wait for ranks that never entered "
                "their collective", ev.file if ev else None, ev.line if ev else None, -1))
    _fact_message_skipped(findings, facts)


def _fact_message_skipped(findings: list[CollectiveFinding], facts: FactSet) -> None:
    """A send its receiver never took, while that receiver waits for the same sender in
    another group: the receiver did not die or stall before the message, it went past it (a
    pipeline stage that ran no micro-batch where its upstream stage sent one)."""
    waits = {(f.ranks[0], f.peer, f.group) for f in findings
             if f.kind == FindingKind.UNMATCHED_RECV and f.peer is not None and f.ranks}
    for f in findings:
        if f.kind != FindingKind.UNRECEIVED_SEND or f.peer is None:
            continue
        dst = f.peer
        src = next((r for r in f.ranks if r != dst), None)
        later = [g for r, s, g in waits if r == dst and s == src and g != f.group]
        if src is None or not later:
            continue
        ev = f.evidence[0] if f.evidence else None
        facts.add(Fact.MESSAGE_SKIPPED, Witness(
            f"group {f.group}: rank {dst} never received rank {src}'s send #{f.seq} and waits "
            f"for rank {src} in group {later[0]}", ev.file if ev else None,
            ev.line if ev else None, -1))
        return


def _fact_exceptions(ev: Evidence, frames: FrameClassifier, facts: FactSet) -> None:
    for r in ev.all_ranks():
        for e in r.exceptions:
            _one_exception(r, e, frames, facts)
        exc = failing_exception(r, frames)
        if exc is not None and (r.pp or 0) >= 1 and not is_comm_error(exc):
            facts.add(Fact.EXCEPTION_ON_DOWNSTREAM_STAGE, witness(
                f"rank {r.rank} ({r.role}) raised {exc.text}", exc.source,
                r.rank))


def _one_exception(r: RankEvidence, e: ExceptionRecord, frames: FrameClassifier,
                   facts: FactSet) -> None:
    text = f"{e.text}"
    # the KV cache's bookkeeping: tree, pools, allocators, and the offload tiers' block maps
    in_cache = any(re.search(r"lock_ref|radix|pool|tree|allocator|kv_offload|/offloading/",
                             f.file + f.func)
                   for f in frames.in_app_frames(e.frames))
    lost_key = e.short_type == "KeyError" and e.message.strip("'\"").isdigit()
    # a node or slot that should hold a value does not: None where the tree promised pages
    lost_value = e.short_type in ("TypeError", "AttributeError") and "NoneType" in e.message
    starting = checks_configuration(e.frames)
    if _INVARIANT_TYPES.search(e.type) or (in_cache and not starting and (
            e.short_type == "AssertionError" or lost_key or lost_value)):
        facts.add(Fact.INVARIANT_BROKEN, witness(text, e.source, r.rank))
    if re.search(r"Double-?(alloc|free)|DoubleAllocation|DoubleFree", e.type + e.message, re.I):
        facts.add(Fact.HOST_POOL_DOUBLE_USE, witness(text, e.source, r.rank))
    if e.short_type == "RankDivergence":
        facts.add(Fact.CONSENSUS_FIRED, witness(text, e.source, r.rank))
    if e.short_type == "StorageUnavailable":
        facts.add(Fact.STORAGE_ERRORS, witness(text, e.source, r.rank))
    if _CONFIG_TYPES.search(e.type) and (any(
            _CONFIG_FRAMES.search(f.func) or _CONFIG_FRAMES.search(f.file) for f in e.frames)
            or (starting and not _in_storage(e.frames))):
        facts.add(Fact.STARTUP_CONFIG_ERROR, witness(text, e.source, r.rank))


def _in_storage(frames: list[Frame]) -> bool:
    """The innermost frames a component owns are a storage tier's (a store that fails to set
    up is the storage tier failing, not a start-up mistake of the server)."""
    index = load_index()
    for f in frames[:4]:
        comp = index.component(f.file) if f.file else None
        if comp is not None:
            return comp.role in ("storage", "transfer")
    return False


def _fact_logs(ev: Evidence, facts: FactSet) -> None:
    table = {
        "host-pool-double-use": Fact.HOST_POOL_DOUBLE_USE,
        "glibc-double-free": Fact.HOST_POOL_DOUBLE_USE,
        "oom-kill": Fact.OOM_KILLED,
        "rank-divergence": Fact.CONSENSUS_FIRED,
        "duplicate-reclaim-diverged": Fact.CONSENSUS_FIRED,
        "hicache-consensus": Fact.CONSENSUS_FIRED,
        "backup-failed": Fact.STORAGE_ERRORS,
        "prefetch-page-failed": Fact.STORAGE_ERRORS,
        "storage-connect-error": Fact.STORAGE_ERRORS,
        "storage-threads-stuck": Fact.STORAGE_ERRORS,
        "cuda-device-fault": Fact.DEVICE_FAULT,
        "pool-leak-check": Fact.INVARIANT_BROKEN,
        "kv-manager-assert": Fact.INVARIANT_BROKEN,
        "startup-usage-error": Fact.STARTUP_CONFIG_ERROR,
        "horovod-stall": Fact.RANK_MISSING_FROM_COLLECTIVE,
        "horovod-missing-ranks": Fact.RANK_MISSING_FROM_COLLECTIVE,
    }
    for r in ev.all_ranks():
        _abort_in_flight(r, facts)
        for pid in ("host-alloc-failed", "prefetch-dropped"):
            stats = r.hits.get(pid)
            if stats is not None and stats.count >= 3:
                h = next(iter(stats.kept))
                facts.add(Fact.HOST_ALLOC_FAILING, witness(
                    f"rank {r.rank}: {stats.count} host allocation failures ({pid}), first: "
                    f"{h.text}", h.source, r.rank))
        for pid, fact in table.items():
            for h in r.hits.get(pid, _EMPTY).kept:
                if fact is Fact.INVARIANT_BROKEN and classify(h.text) is FailureKind.CAPACITY:
                    continue  # "assertion failed: no free blocks left": a full pool, not a bug
                facts.add(fact, witness(h.text, h.source, r.rank))
        sig = r.hits.get("fatal-signal")
        thrown = uncaught_cxx(r)
        for h in (sig.kept if sig else []):
            what, name = h.groups.get("what") or "", h.groups.get("name")
            if thrown is not None and ("Abort" in what or name == "SIGABRT"):
                continue  # the abort of an uncaught C++ exception the log names
            if what or name in ("SIGSEGV", "SIGABRT", "SIGBUS"):
                facts.add(Fact.PROCESS_SEGFAULT, witness(h.text, h.source, r.rank))


def _abort_in_flight(r: RankEvidence, facts: FactSet) -> None:
    """An ``Abort request`` for a rid whose prefetch started and had not settled yet."""
    started = {h.groups.get("rid"): h for h in r.hits.get("prefetch-start", _EMPTY).kept}
    settled = {h.groups.get("rid") or h.groups.get("rid2"): h
               for h in r.hits.get("prefetch-result", _EMPTY).kept}
    for h in r.hits.get("request-aborted", _EMPTY).kept:
        rid = h.groups.get("rid")
        start = started.get(rid)
        if start is None or start.source.file != h.source.file:
            continue
        done = settled.get(rid)
        if (start.source.line or 0) < (h.source.line or 0) and (
                done is None or (done.source.line or 0) > (h.source.line or 0)):
            facts.add(Fact.ABORT_DURING_PREFETCH, witness(
                f"rank {r.rank}: request {rid} aborted while its prefetch was in flight "
                f"(started at line {start.source.line})", h.source, r.rank))


class _Empty:
    kept: tuple[()] = ()


_EMPTY = _Empty()
