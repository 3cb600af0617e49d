"""What the inputs lack, and the exact commands that would collect it.

A partial rank set is analysed anyway; this module lists the ranks the job has (from the
manifest, server arguments, Flight Recorder group members, torchrun's failure summary or a
capture manifest) but the inputs do not cover, and, for a hang, the ranks without stacks. Each
item carries a command to run on the affected host: ``py-spy dump`` with the rank's pid when
an input named it, else with a placeholder and the way to find the pid.
"""

from __future__ import annotations

from doctor.facts.observation import statements
from doctor.model.builder import Evidence
from doctor.model.findings import RankCondition, RankRow
from doctor.report.bounds import rank_ranges
from doctor.report.model import MissingItem

MAX_ITEMS = 32
#: Rows whose stacks a hang does not need asked for: the rank is missing altogether (its own
#: items say so), or its stacks are already in the inputs.
_HAVE_STACKS_OR_NONE = (RankCondition.MISSING, RankCondition.BLOCKED, RankCondition.CRASHED)
_PGREP = "pgrep -af 'sglang::scheduler'"


def missing_items(ev: Evidence, rows: list[RankRow], hang: bool,
                  single_line: bool = False) -> list[MissingItem]:
    """Items for partial evidence first (a traceback cut before its exception line, a report
    of one line), then missing ranks, then ranks lacking stacks in a hang."""
    pids = {rank: pid for pid, rank in ev.pid_ranks.items()}
    pids.update({r: e.pid for r, e in ev.ranks.items() if e.pid is not None})
    items: list[MissingItem] = _partial(ev, single_line)
    missing = sorted(ev.expected_ranks - set(ev.ranks))
    if missing:
        items.append(MissingItem(
            rank=None, what=f"rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)}: "
                            "no evidence at all",
            command="hicache capture --tree <launcher pid> --log <server log> --out capture/  "
                    "# all ranks' stacks at once, while the job is still up"))
    for r in missing:
        if len(items) >= MAX_ITEMS:
            break
        items += _for_missing_rank(ev, r, pids.get(r))
    if hang:
        for row in rows:
            e = ev.ranks.get(row.rank)
            if row.state not in _HAVE_STACKS_OR_NONE and e and not e.threads:
                items.append(MissingItem(
                    rank=row.rank, what=f"stacks of rank {row.rank} during the hang",
                    command=_pyspy(row.rank, pids.get(row.rank), ev)))
    return items[:MAX_ITEMS]


def _partial(ev: Evidence, single_line: bool) -> list[MissingItem]:
    """What would complete partial evidence: the exception line a pasted traceback was cut
    before; the lines around a report's only failure line."""
    items: list[MissingItem] = []
    for r in ev.all_ranks():
        for e in r.exceptions:
            if e.truncated and len(items) < 4:
                where = f"{e.source.file}:{e.source.line}" if e.source.line else e.source.file
                items.append(MissingItem(
                    rank=r.rank if r.rank >= 0 else None,
                    what=f"the exception line of the traceback at {where} (the input ends "
                         "before it: the frames say where something failed, not what)",
                    command="grep -n -A80 'Traceback (most recent call last)' <full log>  "
                            "# the whole traceback, to its last line"))
    src = next((fl.source for r in ev.all_ranks() for fl in r.failure_lines.values()),
               None) or next((e.source for r in ev.all_ranks() for e in r.exceptions), None)
    if single_line and not items and statements(ev):  # no line at all: nothing to widen
        where = f" at {src.file}:{src.line}" if src is not None and src.line else ""
        items.append(MissingItem(
            rank=None, what=f"more than the one failure line{where}: the traceback or stack "
                            "that goes with it, the lines before it, every rank's log",
            command="grep -n -B50 -A80 '<a few words of that line>' <full log of every rank>"))
    return items


def _for_missing_rank(ev: Evidence, r: int, pid: int | None) -> list[MissingItem]:
    """Stacks always; the FR dump and log lines when the other ranks came with those."""
    kinds = set().union(*(e.kinds for e in ev.ranks.values())) if ev.ranks else set()
    items = [MissingItem(rank=r, what=f"stacks of rank {r} ({_role(ev, r)})",
                         command=_pyspy(r, pid, ev))]
    if "fr" in kinds:
        items.append(MissingItem(
            rank=r, what=f"the Flight Recorder dump of rank {r}",
            command=f"copy <dump prefix>{r} from rank {r}'s host (TORCH_NCCL_DEBUG_INFO_"
                    f"TEMP_FILE, default /tmp/nccl_trace_rank_{r}; recorded with "
                    "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 or TORCH_FR_BUFFER_SIZE=2000)"))
    if "log" in kinds:
        items.append(MissingItem(
            rank=r, what=f"the log lines of rank {r}",
            command=f"grep -E '{_log_tag(ev, r)}' <server log> > rank{r}.log"))
    return items


def _pyspy(rank: int, pid: int | None, ev: Evidence) -> str:
    target = str(pid) if pid is not None else f"<pid of rank {rank}, see: {_PGREP}>"
    return f"py-spy dump --json --pid {target} > rank{rank}.pyspy.json"


def _role(ev: Evidence, rank: int) -> str:
    tp = ev.topology.tp
    return f"TP{rank % tp} PP{rank // tp}" if tp else f"rank {rank}"


def _log_tag(ev: Evidence, rank: int) -> str:
    tp = ev.topology.tp
    if not tp:
        return rf"\[rank{rank}\]:"
    tp_rank, pp = rank % tp, rank // tp
    if (ev.topology.pp or 1) > 1:
        return rf" (TP{tp_rank} PP{pp}|PP{pp} TP{tp_rank})[] ]"
    return rf" TP{tp_rank}[] ]"
