"""All terminal rendering. The only module that imports rich.

Every human-readable report is drawn here from typed results (pydantic models); nothing else
prints except ``cli.py``'s plain ``--json`` output. Width and colour follow the environment
(``TERMINAL_WIDTH``, ``NO_COLOR``, ``FORCE_COLOR``) so tests get stable output.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from doctor.model.evidence import InputStatus
from doctor.model.findings import RankCondition
from doctor.read.ingest import EMPTY

if TYPE_CHECKING:
    from hicache_runtime.l3.audit import StoreAudit
    from hicache_runtime.launch.run import RunSummary

STYLE_OK = "bold green"
STYLE_BAD = "bold red"
STYLE_WARN = "yellow"
STYLE_DIM = "dim"
STYLE_KEY = "cyan"

OUTCOME_STYLE = {"healthy": STYLE_OK, "crash": STYLE_BAD, "hang": STYLE_BAD,
                 "wrong-output": STYLE_BAD}


#: Terminal control sequences and control characters: CSI (colours, clear screen, cursor
#: moves), OSC (window titles, OSC 8 hyperlinks) and other escapes, and C0/C1 controls other
#: than tab and newline. A log line or a file name carries them as easily as text.
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b\][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)?|"
                      r"\x1b[@-Z\\-_]?|\x9b[0-?]*[ -/]*[@-~]?|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _closed_pipe(self: Console) -> None:
    """What every console (ours and the help's) does when its reader went away (``hicache ...
    | head``): stop writing and end with the status of a process killed by SIGPIPE (128 + 13),
    the shell's convention; rich's own default exits 1, which here means "no signature fits"."""
    import signal

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    raise SystemExit(128 + signal.SIGPIPE)


Console.on_broken_pipe = _closed_pipe  # type: ignore[method-assign]


def esc(text: object) -> str:
    """Text from outside (errors, log lines, paths, user input) as data: terminal control
    sequences removed and rich markup escaped. Every such text reaches the terminal through
    here."""
    return _markup_escape(_CONTROL.sub("", str(text)))


#: Width of output that does not go to a terminal (a pipe, a file, CI logs) and has no
#: ``COLUMNS``: the width a reader's terminal or editor most likely has.
PIPE_WIDTH = 80


def _width(stderr: bool) -> int | None:
    """``TERMINAL_WIDTH``, else the terminal's own width (rich reads it, and ``COLUMNS``), else
    ``COLUMNS``, else :data:`PIPE_WIDTH`."""
    value = os.environ.get("TERMINAL_WIDTH", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    stream = sys.stderr if stderr else sys.stdout
    try:
        if stream.isatty():
            return None
    except (AttributeError, ValueError):  # a closed or unusual stream: treat it as a pipe
        pass
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, width=_width(stderr),
                   no_color=bool(os.environ.get("NO_COLOR")), highlight=False,
                   soft_wrap=False)


def _short(table: Table, header: str, **kw: Any) -> None:
    """A column of short values (numbers, states, ids): never wrapped. Left to rich, a narrow
    terminal squeezes every column alike and folds these to a character per line; this way the
    long columns give way instead."""
    table.add_column(header, no_wrap=True, **kw)


def _long(table: Table, header: str, **kw: Any) -> None:
    """A column of free text: wraps at words and folds only words longer than the column.
    How narrow it may get is :func:`_fit`'s business."""
    table.add_column(header, overflow="fold", **kw)


def _fit(con: Console, table: Table, mins: dict[str, int]) -> Table:
    """Fit ``table`` to the console: as it is when its natural width fits; otherwise the short
    columns keep their width and the long ones (the keys of ``mins``) share the rest, the
    widest narrowed first, none below ``mins[header]`` (or its content's width if less).

    The widths are set here because rich's own narrowing ignores ``min_width`` (it clamps
    afterwards and runs past the terminal, cropping the last column and its header) and its
    ``ratio`` split can overshoot and then truncate short columns."""
    unbounded = con.options.update_width(1 << 16)
    total = con.measure(table, options=unbounded).maximum
    if total <= con.width:
        return table

    def natural(col: Any) -> int:
        cells = [col.header, *col.cells] if table.show_header else list(col.cells)
        return max([1] + [Measurement.get(con, unbounded, c).maximum for c in cells])

    widths = [natural(col) for col in table.columns]
    overhead = total - sum(widths)  # padding and borders
    long = [i for i, col in enumerate(table.columns) if str(col.header) in mins]
    room = con.width - overhead - sum(w for i, w in enumerate(widths) if i not in long)
    floor = {i: min(mins[str(table.columns[i].header)], widths[i]) for i in long}

    def used(level: int) -> int:
        return sum(min(widths[i], max(floor[i], level)) for i in long)

    lo, hi = 0, max((widths[i] for i in long), default=0)
    while lo < hi:  # the highest level whose columns fit the room
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if used(mid) <= room else (lo, mid - 1)
    for i in long:
        table.columns[i].width = min(widths[i], max(floor[i], lo))
    return table


def para(con: Console, body: str, lead: str = "", indent: int = 0) -> None:
    """A paragraph of prose (markup; outside text in it already through :func:`esc`), wrapped
    at word boundaries to the console's width; its continuation lines start under its first
    word, after ``lead`` (a label or a bullet) and ``indent`` spaces. Only a single token
    longer than the line is cut. Commands meant to be copied are printed whole instead."""
    head = Text(" " * indent) + (Text.from_markup(lead) + " " if lead else Text())
    hang = head.cell_len
    lines = Text.from_markup(body).wrap(con, max(20, con.width - hang), overflow="fold")
    for n, line in enumerate(lines):
        line.rstrip()
        con.print((head if n == 0 else Text(" " * hang)) + line, soft_wrap=True)


def error(message: str, hint: str = "") -> None:
    """One line on stderr (plus a hint line): how user errors are shown. Both are plain text
    (they quote what the user typed): never markup. Never wrapped: scripts and CI logs grep
    them, and a terminal wraps them anyway."""
    con = console(stderr=True)
    con.print(f"[{STYLE_BAD}]error:[/] {esc(message)}", soft_wrap=True)
    if hint:
        con.print(f"[{STYLE_DIM}]hint:[/] {esc(hint)}", soft_wrap=True)


def warn(message: str) -> None:
    console(stderr=True).print(f"[{STYLE_WARN}]warning:[/] {esc(message)}", soft_wrap=True)


def info(message: str) -> None:
    console().print(esc(message), soft_wrap=True)


@contextmanager
def run_progress(label: str, enabled: bool = True) -> Iterator[Callable[[int, int, int], None]]:
    """A progress bar fed by ``(step, finished, total)`` callbacks."""
    if not enabled:
        yield lambda step, done, total: None
        return
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("step {task.fields[step]}"),
                        TimeElapsedColumn(), console=console(stderr=True), transient=True)
    with progress:
        task = progress.add_task(label, total=None, step=0)

        def update(step: int, done: int, total: int) -> None:
            if step % 4 == 0 or done == total:
                progress.update(task, completed=done, total=total, step=step)

        yield update


def run_summary(s: RunSummary) -> None:
    con = console()
    style = OUTCOME_STYLE.get(s.outcome.value, STYLE_WARN)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style=STYLE_KEY, no_wrap=True)
    table.add_column(overflow="fold")
    match = {True: f"[{STYLE_OK}]identical to the cache-disabled run[/]",
             False: f"[{STYLE_BAD}]{len(s.mismatches)} request(s) differ[/]",
             None: f"[{STYLE_DIM}]not compared[/]"}[s.output_match]
    rows: list[tuple[str, str]] = [
        ("outcome", f"[{style}]{esc(s.outcome.value)}[/]"),
        ("topology", f"tp={s.topology.get('tp', 1)} pp={s.topology.get('pp', 1)}"),
        ("requests", f"{s.completed} completed, {s.aborted} aborted of {s.requests}"),
        ("outputs", match),
        ("cached tokens", f"device {s.cached_tokens.device}  host {s.cached_tokens.host}  "
                          f"storage {s.cached_tokens.storage}"),
        ("steps", str(s.steps)),
        ("wall", f"{s.wall_s:.2f}s" + (f" (reference {s.reference_wall_s:.2f}s)"
                                       if s.reference_wall_s else "")),
    ]
    if s.legacy:
        rows.append(("legacy", esc(", ".join(s.legacy))))
    if s.faults:
        rows.append(("faults", f"{esc(', '.join(s.faults))} (fired {s.faults_fired}x)"))
    if s.error:
        rows.append(("error", f"[{STYLE_BAD}]{esc(s.error)}[/]"))
    if s.bundle:
        rows.append(("bundle", esc(s.bundle)))
    elif getattr(s, "bundle_error", None):
        rows.append(("bundle", f"[{STYLE_WARN}]not written: {esc(s.bundle_error)}[/]"))
    for k, v in rows:
        table.add_row(k, v)
    con.print(Panel(table, title="hicache run", expand=False))
    for m in s.mismatches[:5]:
        con.print(f"  [{STYLE_BAD}]{esc(m.rid)}[/] first differs at token {m.index}: "
                  f"expected {esc(m.expected[:8])} got {esc(m.got[:8])} {esc(m.note)}",
                  soft_wrap=True)


# === doctor, signatures, capture ============================================================
# The doctor's human-readable output. Drawn only from doctor.report.model.Diagnosis and the catalog
# models; the JSON and Markdown forms are produced in doctor/ and printed by cli.py.


SEVERITY_STYLE = {"critical": STYLE_BAD, "high": STYLE_BAD, "medium": STYLE_WARN, "low": STYLE_DIM}
#: Console width from which the campaign summary shows every column side by side.
WIDE = 150

STATE_STYLE = {RankCondition.CRASHED: STYLE_BAD, RankCondition.BLOCKED: STYLE_WARN,
               RankCondition.MISSING: STYLE_BAD, RankCondition.EXITED: STYLE_BAD,
               RankCondition.FAILED: STYLE_WARN, RankCondition.IDLE: STYLE_DIM,
               RankCondition.FINISHED: STYLE_DIM}


def doctor_report(d: Any, verbose: bool = False) -> None:
    """The rich report of a ``doctor.report.model.Diagnosis``."""
    con = console()
    con.print(Panel(_doctor_head(d), title="hicache doctor", expand=False))
    for o in d.observations:
        para(con, esc(o), "•", indent=2)
    if d.ranks:
        con.print(_fit(con, _rank_table(d), {"frame / call site": 16, "error": 14,
                                             "last seq": 12}))
    if d.first_divergence is not None:
        fd = d.first_divergence
        vals = ", ".join(f"rank {r}: {v}" for r, v in sorted(fd.values.items()))
        para(con, f"{esc(fd.label)} #{fd.index}: {esc(vals)}",
             f"[{STYLE_KEY}]first divergent decision[/]")
    for v in d.verdicts[:1]:
        _verdict_detail(con, v)
    for look in getattr(d, "lookalikes", [])[:2]:
        para(con, f"{esc(look.title)} ({look.score:.2f}): {esc(look.meaning)}",
             f"[{STYLE_KEY}]looks like[/]")
        para(con, esc(look.advice), f"[{STYLE_KEY}]what to do[/]", indent=4)
        for e in look.evidence[:3]:
            where = f"{e.file}:{e.line}" if e.file and e.line else (e.file or "")
            para(con, f"[{STYLE_DIM}]{esc(where)}[/] {esc(e.text)}", indent=4)
    if not d.verdicts and d.near_misses:
        con.print(f"[{STYLE_WARN}]not enough evidence to name a signature; closest "
                  "candidates:[/]")
    for n in d.near_misses:
        para(con, f"{n.signature}, {n.score:.2f}, because {esc(n.because)}",
             f"[{STYLE_DIM}]similar to[/]")
    for m in d.missing:
        para(con, esc(m.what), f"[{STYLE_WARN}]missing:[/]")
        con.print(f"    [{STYLE_KEY}]{esc(m.command)}[/]", soft_wrap=True)  # copied whole
    for p in d.problems[:20]:
        para(con, esc(p), f"[{STYLE_WARN}]input problem:[/]")
    for i in d.inputs:
        if i.status != InputStatus.READ:
            para(con, f"{esc(i.path)}: {esc(i.message)}", f"[{STYLE_WARN}]unreadable:[/]")
    if verbose:
        con.print(f"[{STYLE_KEY}]rule log[/]")
        for line in d.rule_log:
            con.print(f"  {esc(line)}", soft_wrap=True)


def incident_list(result: Any) -> None:
    """Several incidents (a folder of bundles): one row each, newest first."""
    con = console()
    table = Table(title=f"{len(result.incidents)} incidents, newest first",
                  title_justify="left")
    _short(table, "#", justify="right")
    _long(table, "bundle")
    _short(table, "written")
    _short(table, "outcome")
    _long(table, "verdict")
    for n, inc in enumerate(result.incidents, 1):
        d = inc.diagnosis
        name = Path(inc.bundle).name if inc.bundle else "(the other inputs)"
        if d.verdicts:
            v = d.verdicts[0]
            verdict = (f"[{SEVERITY_STYLE.get(v.severity, STYLE_WARN)}]{esc(v.signature)}[/] "
                       f"({v.confidence:.2f})")
        else:
            verdict = f"[{STYLE_DIM}]{esc(d.summary)}[/]"
        outcome = esc(d.topology.get("outcome") or "-")
        table.add_row(str(n), esc(name), esc(inc.created_at[:19].replace("T", " ")),
                      outcome, verdict)
    con.print(_fit(con, table, {"bundle": 20, "verdict": 24}))
    con.print(f"[{STYLE_DIM}]one incident's whole report:[/] hicache doctor <bundle>",
              soft_wrap=True)


def _doctor_head(d: Any) -> Table:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style=STYLE_KEY, no_wrap=True)
    table.add_column(overflow="fold")
    if d.verdicts:
        v = d.verdicts[0]
        style = SEVERITY_STYLE.get(v.severity, STYLE_WARN)
        table.add_row("verdict", f"[{style}]{v.signature}[/] — {esc(v.title)}")
        table.add_row("confidence", f"{v.confidence:.2f} (catalog {d.catalog_version})")
        table.add_row("severity", f"[{style}]{v.severity}[/]")
        for other in d.verdicts[1:3]:
            table.add_row("also", f"{other.signature} ({other.confidence:.2f})")
    else:
        table.add_row("verdict", f"[{STYLE_WARN}]{esc(d.summary)}[/]")
    topo = d.topology
    if topo.get("world_size"):
        shape = " ".join(f"{k}={topo[k]}" for k in ("tp", "pp") if topo.get(k) is not None)
        table.add_row("job", f"world {topo['world_size']}" + (f" ({shape})" if shape else ""))
    if d.missing_ranks:
        ranges = getattr(d, "missing_rank_ranges", "") or str(d.missing_ranks)
        table.add_row("missing ranks", f"[{STYLE_BAD}]{esc(ranges)}[/]")
    read = sum(i.status == InputStatus.READ and i.kind != EMPTY for i in d.inputs)
    empty = sum(i.status == InputStatus.READ and i.kind == EMPTY for i in d.inputs)
    table.add_row("inputs", f"{read} read, "
                  f"{sum(i.status != InputStatus.READ for i in d.inputs)} unreadable"
                  + (f", {empty} empty" if empty else ""))
    fp = getattr(d, "fingerprint", None)
    if fp is not None:
        table.add_row("fingerprint", f"{fp.id}" + (f" ({esc(fp.exception)})"
                                                    if fp.exception and not d.verdicts else ""))
    return table


def _rank_table(d: Any) -> Table:
    table = Table(title="ranks", title_justify="left")
    _short(table, "rank", justify="right")
    _short(table, "role")
    _short(table, "state")
    _long(table, "frame / call site")
    _long(table, "error")
    _long(table, "last seq")
    for r in d.ranks:
        style = STATE_STYLE.get(r.state, "")
        where = r.frame or ""
        if r.site and r.site != r.frame:
            where += f"\n← {r.site}"
        seq = "\n".join(f"{k}: {v}" for k, v in r.last_seq.items())
        table.add_row(str(r.rank), esc(r.role), f"[{style}]{r.state}[/]" if style else r.state,
                      esc(where), esc(r.error or ""), esc(seq))
    return table


def _verdict_detail(con: Console, v: Any) -> None:
    con.print(f"[{STYLE_KEY}]evidence[/]")
    for e in v.evidence:
        where = f"{e.file}:{e.line}" if e.file and e.line is not None else (e.file or "")
        para(con, f"[{STYLE_DIM}]{esc(where)}[/] {esc(e.text)}", indent=2)
    para(con, esc(v.root_cause), f"[{STYLE_KEY}]root cause[/]")
    for fix in v.upstream_fix:  # one each: they are sentences ("...; ...": doubled stops)
        para(con, esc(fix), f"[{STYLE_KEY}]fix[/]")
    for m in v.mitigations:
        extra = esc(" ".join((*m.flags, *m.env)))
        para(con, esc(m.text) + (f"  [{STYLE_DIM}]{extra}[/]" if extra else ""),
             f"[{STYLE_KEY}]mitigate[/]")
    con.print(f"[{STYLE_KEY}]runbook[/] {esc(v.runbook)}", soft_wrap=True)  # a command
    if v.campaign_cell:
        con.print(f"[{STYLE_KEY}]campaign cell[/] {esc(v.campaign_cell)}", soft_wrap=True)
        _not_a_release(con, v.campaign_cell)
    if v.release_note:
        para(con, esc(v.release_note), f"[{STYLE_KEY}]release[/]")
    if v.tie_note:
        para(con, esc(v.tie_note), f"[{STYLE_KEY}]tied[/]")


def signature_table(catalog: Any) -> None:
    con = console()
    # Narrower than PIPE_WIDTH the kind goes under the severity and the campaign cell under
    # the title: five columns with an unbroken id do not fit 80 characters otherwise.
    wide = con.width >= PIPE_WIDTH
    table = Table(title=f"signatures (catalog {catalog.version})", title_justify="left")
    _short(table, "id")
    _short(table, "severity" if wide else "severity / kind")
    if wide:
        _short(table, "kind")
    _long(table, "title" if wide else "title / campaign cell")
    if wide:
        _long(table, "campaign cell")
    for s in catalog.signatures:
        style = SEVERITY_STYLE.get(s.severity.value, "")
        severity = f"[{style}]{s.severity.value}[/]"
        cell = esc(s.campaign.cell) if s.campaign else "-"
        if wide:
            table.add_row(s.id, severity, s.kind.value, esc(s.title), cell)
        else:
            table.add_row(s.id, f"{severity}\n{s.kind.value}",
                          f"{esc(s.title)}\n[{STYLE_DIM}]{cell}[/]")
    con.print(_fit(con, table, {"title": 16, "campaign cell": 16, "title / campaign cell": 16}))


def index_sources(rows: list[dict[str, Any]]) -> None:
    """The upstream index's systems: versions (oldest, newest), templates, files."""
    con = console()
    total = sum(r["templates"] for r in rows)
    table = Table(title=f"upstream index ({total} templates)", title_justify="left")
    _short(table, "system")
    _short(table, "templates")
    _short(table, "files")
    _long(table, "versions")
    for r in rows:
        names = [v["version"] for v in r["versions"]]
        shown = ", ".join(names) if len(names) <= 4 else \
            f"{names[0]} ... {names[-1]} ({len(names)})"
        where = r["versions"][-1]["source"].split(":", 1)[0] if r["versions"] else ""
        table.add_row(esc(r["system"]), str(r["templates"]), str(r["files"]),
                      esc(f"{shown} [{where}]"))
    con.print(_fit(con, table, {"versions": 16}))


def signature_detail(sig: Any) -> None:
    con = console()
    style = SEVERITY_STYLE.get(sig.severity.value, "")
    meaning = " ".join(sig.meaning.split())
    con.print(Panel(f"[{style}]{sig.severity.value}[/] {sig.kind.value}\n{esc(meaning)}",
                    title=esc(f"{sig.id}: {sig.title}"), expand=False))
    rec = sig.recognisers
    for e in rec.exceptions:
        con.print(esc(f"  exception {e.type} /{e.message}/  +{e.weight:.2f}"), soft_wrap=True)
    if rec.frames:
        con.print(esc(f"  in-app frame ({rec.frames.where}) {', '.join(rec.frames.any)}  "
                      f"+{rec.frames.weight:.2f}"), soft_wrap=True)
    for lg in rec.logs:
        con.print(f"  log {lg.pattern}  {lg.weight:+.2f}")
    for f in rec.facts:
        con.print(f"  fact {f.fact.value}  {f.weight:+.2f}")
    for leg in rec.legacy:
        con.print(f"  legacy {leg.switch}  +{leg.weight:.2f}")
    para(con, esc(' '.join(sig.root_cause.split())), f"[{STYLE_KEY}]root cause[/]")
    for fix in sig.upstream_fix:
        para(con, f"{esc(fix.ref)}: {esc(fix.summary)}", f"[{STYLE_KEY}]fix[/]")
    for m in sig.mitigations:
        para(con, f"{esc(m.text)} {esc(' '.join((*m.flags, *m.env)))}",
             f"[{STYLE_KEY}]mitigate[/]")
    if sig.campaign:
        con.print(f"[{STYLE_KEY}]campaign cell[/] {esc(sig.campaign.cell)} -> "
                  f"{sig.campaign.expect}")
        _not_a_release(con, sig.campaign.cell)
    a = sig.affected
    if a is not None:
        seen = ", ".join(a.reproduces) or "none of them"
        para(con, esc(f"reproduced on {seen} of {', '.join(a.profiles)}"
                      + (f"; its fault ({a.row}) ran clean on {', '.join(a.clean) or 'none'}"
                         if a.row else "")
                      + f" (release matrix of the {a.campaign} campaign, {a.run_at[:10]})"),
             f"[{STYLE_KEY}]releases[/]")


def capture_summary(result: Any) -> None:
    con = console()
    ok = [t for t in result.manifest.targets if not t.error]
    con.print(f"captured {len(ok)} of {len(result.manifest.targets)} rank(s) into "
              f"{esc(str(result.out))}")
    for t in result.manifest.targets:
        state = f"[{STYLE_BAD}]{esc(t.error)}[/]" if t.error else \
            f"[{STYLE_OK}]ok[/] {esc(t.pyspy)}"
        con.print(f"  rank {t.rank} pid {t.pid}: {state}", soft_wrap=True)
    for log in result.manifest.logs:
        con.print(f"  log {esc(log)}")
    if result.hint:
        con.print(f"[{STYLE_WARN}]hint:[/] {esc(result.hint)}", soft_wrap=True)
    con.print(f"next: hicache doctor {esc(str(result.out))}")


# --- campaigns, replay, shrink ----------------------------------------------------------------


@contextmanager
def campaign_progress(total: int, enabled: bool = True) -> Iterator[Callable[[Any, Any], None]]:
    """Live campaign progress: a bar over cells and one line per finished cell. Yields the
    runner's hook, called with (cell, None) on start and (cell, result) on end."""
    con = console(stderr=True)
    if not enabled:
        yield lambda cell, result: None
        return
    progress = Progress(TextColumn("[bold]campaign"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[cell]}"), TimeElapsedColumn(), console=con,
                        transient=True)
    with progress:
        task = progress.add_task("cells", total=total, cell="")

        def hook(cell: Any, result: Any) -> None:
            if result is None:
                progress.update(task, cell=esc(cell.id))
                return
            progress.console.print(_cell_line(result), soft_wrap=True)
            progress.advance(task)

        yield hook


def _cell_mark(r: Any) -> str:
    if r.skipped is not None:
        return f"[{STYLE_WARN}]skip[/]"
    return f"[{STYLE_OK}]pass[/]" if r.passed else f"[{STYLE_BAD}]FAIL[/]"


def _cell_line(r: Any) -> str:
    mark = _cell_mark(r)
    return f"{mark} {esc(r.id)}  [{STYLE_DIM}]{esc(r.observed)}, {r.wall_s:.1f}s[/]"


def campaign_summary(result: Any) -> None:
    con = console()
    # No ``expand``/``ratio``: rich gives ratio columns their share with no regard for
    # ``min_width``, which folded cells to a character per line on narrow terminals. Below
    # WIDE the expectation, the observation and the outcome share one column (signature ids
    # stay whole at 80 columns) and the bundle column is left out: the bundle root (and each
    # failing cell's bundle) is printed below the table in any case.
    wide = con.width >= WIDE
    table = Table(title=f"campaign {esc(result.name)}", title_justify="left")
    _long(table, "cell")
    if wide:
        _long(table, "expected")
        _long(table, "observed")
        _short(table, "outcome")
    else:
        _long(table, "expected / observed")
    _short(table, "wall s", justify="right")
    _short(table, "result")
    if wide:
        _long(table, "bundle")
    for c in result.cells:
        obs = c.observed + (f" ({c.confidence:.2f})" if c.confidence is not None else "")
        mark = _cell_mark(c)
        outcome = f"[{OUTCOME_STYLE.get(c.outcome, STYLE_WARN)}]{esc(c.outcome)}[/]"
        expect = esc(c.expect.replace("|", " | "))
        if wide:
            row = [esc(c.id), expect, esc(obs), outcome, f"{c.wall_s:.1f}", mark,
                   esc(Path(c.bundle).name) if c.bundle else ""]
        else:
            row = [esc(c.id), f"{expect}\n→ {esc(obs)}, {outcome}", f"{c.wall_s:.1f}", mark]
        table.add_row(*row)
    con.print(_fit(con, table, {"cell": 16, "expected": 10, "observed": 10, "bundle": 12,
                                "expected / observed": 16}))
    weak = {k: v for c in result.cells for k, v in c.not_a_release.items()}
    if weak:
        kinds = ", ".join(f"{k} ({v})" for k, v in sorted(weak.items()))
        con.print(f"[{STYLE_DIM}]not evidence about a release: cells with {esc(kinds)} "
                  "reproduce a hazard no release met that way (hicache profiles show)[/]",
                  soft_wrap=True)
    style = STYLE_OK if result.failed == 0 else STYLE_BAD
    skipped = f", {result.skipped} skipped on this machine" if result.skipped else ""
    con.print(f"[{style}]{result.passed} of {len(result.cells)} cells behaved as expected[/]"
              f"{skipped} in {result.wall_s:.0f}s")
    roots = sorted({str(Path(c.bundle).parent) for c in result.cells if c.bundle})
    if roots:
        con.print(f"bundles under {esc(', '.join(roots))}", soft_wrap=True)
    for c in result.cells:
        if c.skipped is not None:
            con.print(f"  [{STYLE_WARN}]{esc(c.id)}[/]: {esc(c.detail)}", soft_wrap=True)
        if c.rerun_note:
            con.print(f"  [{STYLE_WARN}]{esc(c.id)}[/]: {esc(c.rerun_note)}", soft_wrap=True)
    for key, group in result.failure_groups():  # one line per way of failing
        c = group[0]
        more = f" and {len(group) - 1} more cell(s) that failed alike ({esc(key)})" \
            if len(group) > 1 else ""
        con.print(f"  [{STYLE_BAD}]{esc(c.id)}[/]{more}: {esc(c.detail)}"
                  + (f" [{STYLE_DIM}]{esc(c.error)}[/]" if c.error else ""), soft_wrap=True)
        if c.bundle:
            con.print(f"    bundle {esc(c.bundle)}  (hicache inject --replay "
                      f"{esc(c.bundle)} --shrink)", soft_wrap=True)
    if result.properties:
        campaign_properties(result)


def campaign_properties(result: Any) -> None:
    """A property campaign's properties: one row each (cells checked, violations, cells it
    could not be read in), then each violated property's cells with their bundles."""
    con = console()
    table = Table(title=f"properties of {esc(result.name)}", title_justify="left")
    _short(table, "property")
    _short(table, "checked", justify="right")
    _short(table, "violations", justify="right")
    _short(table, "unchecked", justify="right")
    _long(table, "meaning")
    for p in result.properties:
        style = STYLE_OK if p.holds else STYLE_BAD
        table.add_row(f"[{style}]{esc(p.property)}[/]", str(p.checked),
                      f"[{style}]{p.violations}[/]", str(len(p.unchecked)), esc(p.meaning))
    con.print(_fit(con, table, {"meaning": 16}))
    held = sum(p.holds for p in result.properties)
    style = STYLE_OK if held == len(result.properties) else STYLE_BAD
    con.print(f"[{style}]{held} of {len(result.properties)} properties held[/] over "
              f"{len(result.cells)} cells")
    for p in result.properties:
        if p.holds:
            continue
        con.print(f"[{STYLE_BAD}]{esc(p.property)}[/] violated in {p.violations} cell(s):")
        for v in p.violating:
            con.print(f"  {esc(v.cell)}: {esc(v.detail)}", soft_wrap=True)
            if v.bundle:
                con.print(f"    bundle {esc(v.bundle)}", soft_wrap=True)


def _not_a_release(con: Console, cell: str) -> None:
    """Under a catalog campaign cell whose switch no release ran as the runtime does: that
    it is a reproduction, not evidence about a release."""
    from signatures.models import cell_not_a_release

    for switch, why in cell_not_a_release(cell).items():
        para(con, esc(f"{switch} is {why.rstrip('.')}. The cell reproduces the hazard; it is "
                      "no evidence about a release (hicache profiles show)."),
             f"[{STYLE_DIM}]not a release[/]")


def campaign_cells(cells: list[Any], defaults: dict[str, Any]) -> None:
    """``campaign --list``: the settings every cell shares, then each cell (its id whole, to
    copy into ``--only``), what it must show and what it sets on top."""
    con = console()
    shared = ", ".join(f"{k}={v}" for k, v in defaults.items()) or "the runtime's defaults"
    para(con, f"{len(cells)} cells; each runs with {esc(shared)} unless it sets otherwise",
         f"[{STYLE_DIM}]campaign[/]")
    for c in cells:
        con.print(esc(c.id), soft_wrap=True)
        extra = ", ".join(f"{k}={v}" for k, v in c.config.items() if defaults.get(k) != v)
        parts = [f"expect {esc(c.expect.replace('|', ' | '))}",
                 *(["warm-up run first (fills L3)"] if c.warm else []),
                 *([f"seed {c.seed}"] if c.seed else []),
                 *([f"sets {esc(extra)}"] if extra else [])]
        para(con, "; ".join(parts), indent=4)


def replay_summary(r: Any) -> None:
    con = console()
    style = STYLE_OK if r.reproduced else STYLE_BAD
    verdict = "reproduced" if r.reproduced else "did not reproduce"
    con.print(f"[{style}]{verdict}[/]: expected {esc(r.signature)} ({r.outcome}), observed "
              f"{esc(r.trial.observed)} ({r.trial.outcome}) in {r.trial.wall_s:.1f}s",
              soft_wrap=True)
    schedule = "the same" if r.same_fault_schedule else "a different"
    con.print(f"  {r.trial.faults_fired} fault firing(s), {schedule} schedule as the original")
    if r.cell:
        con.print(f"  campaign cell {esc(r.cell)}")
    if r.trial.bundle:
        con.print(f"  bundle {esc(r.trial.bundle)}", soft_wrap=True)


def shrink_step(t: Any, done: int, planned: int) -> None:
    """One line on stderr per run of ``inject --shrink`` as it ends (stdout stays the
    result): which change, whether it failed the same way, how long it took."""
    how = (f"[{STYLE_OK}]same failure[/]" if t.reproduced
           else f"[{STYLE_DIM}]not reproduced[/] ({esc(t.observed)})")
    para(console(stderr=True), f"{esc(t.change)}: {how}, {t.wall_s:.1f}s",
         f"[{STYLE_DIM}]run {done}/{planned}[/]")


def shrink_summary(r: Any) -> None:
    con = console()
    if not r.reproduced:
        con.print(f"[{STYLE_BAD}]the replay did not show {esc(r.signature)}[/]: nothing to "
                  "shrink (is the failure timing-dependent? try again, or raise the lag)")
    table = Table(title=f"shrinking {esc(r.signature)}", title_justify="left")
    _short(table, "#", justify="right")
    _long(table, "change")
    _short(table, "requests", justify="right")
    _long(table, "observed")
    _short(table, "wall s", justify="right")
    _short(table, "kept")
    for i, t in enumerate(r.trials):
        # kept: the candidate became the case; same: this run failed the same way but the
        # candidate was not (yet) kept; confirmation runs say only whether they reproduced.
        mark = (f"[{STYLE_OK}]kept[/]" if t.kept else
                f"[{STYLE_DIM}]same[/]" if t.reproduced else
                f"[{STYLE_BAD}]no[/]" if t.confirm else f"[{STYLE_DIM}]no[/]")
        table.add_row(str(i), esc(t.change), str(t.requests), esc(t.observed),
                      f"{t.wall_s:.1f}", mark)
    con.print(_fit(con, table, {"change": 16, "observed": 12}))
    o, s = r.original, r.shrunk
    con.print(f"requests {o.requests} -> {s.requests}; faults {esc('; '.join(o.faults))} -> "
              f"{esc('; '.join(s.faults))}; firings {o.faults_fired} -> {s.faults_fired}; "
              f"{r.runs} run(s)" + (" (budget spent)" if r.budget_exhausted else ""),
              soft_wrap=True)
    if r.confirm_runs:
        rate = f"reproduced {r.confirmed}/{r.confirm_runs} confirmation runs"
        con.print(f"[{STYLE_BAD}]flaky[/]: {rate}; as a campaign cell it will not fail every "
                  "time" if r.flaky else f"[{STYLE_OK}]{rate}[/]", soft_wrap=True)
    if r.final_bundle:
        con.print(f"bundle {esc(r.final_bundle)}", soft_wrap=True)
    if r.cell_spec:
        con.print(f"rerun: hicache campaign {esc(r.cell_spec)}", soft_wrap=True)


def inject_summary(done: Any) -> None:
    """``hicache inject``: how the run ended and what the doctor names (a ``DiagnosedRun``)."""
    con = console()
    style = OUTCOME_STYLE.get(done.outcome, STYLE_WARN)
    con.print(f"outcome [{style}]{esc(done.outcome)}[/]"
              + ("" if done.output_match is None else
                 f", outputs {'identical to' if done.output_match else 'differ from'} the "
                 "cache-disabled run") + f"; {done.faults_fired} fault firing(s)")
    if done.error:
        con.print(f"[{STYLE_BAD}]{esc(done.error)}[/]", soft_wrap=True)
    if done.signature:
        con.print(f"the doctor names [{STYLE_BAD}]{esc(done.signature)}[/] "
                  f"({done.confidence:.2f}); hicache doctor {esc(done.bundle or '')}",
                  soft_wrap=True)
    elif done.bundle:
        con.print(f"no known signature fits; bundle {esc(done.bundle)}", soft_wrap=True)
    if done.bundle:
        con.print(f"replay: hicache inject --replay {esc(done.bundle)} [--shrink]",
                  soft_wrap=True)


def fault_listing(listing: Any) -> None:
    """``hicache faults list``: kinds with their parameters, then selectors and points."""
    con = console()
    con.print(f"fault spec: {esc(listing.syntax)}", soft_wrap=True)
    table = Table(title="fault kinds", title_justify="left")
    _short(table, "kind")
    _long(table, "parameters")
    _long(table, "what it does")
    for k in listing.kinds:
        params = "\n".join(f"{p.name}: {p.description}" for p in k.params) or "-"
        acts = f"\n[{STYLE_DIM}]acts at {k.point}[/]" if k.point else ""
        table.add_row(k.kind, esc(params), esc(k.summary) + acts)
    con.print(_fit(con, table, {"parameters": 18, "what it does": 24}))
    table = Table(title="selectors (every kind; unset = everywhere)", title_justify="left")
    _short(table, "selector")
    _long(table, "meaning")
    for s in listing.selectors:
        table.add_row(s.name, esc(s.description))
    con.print(_fit(con, table, {"meaning": 20}))
    table = Table(title="fault points", title_justify="left")
    _short(table, "point")
    _long(table, "where")
    for p in listing.points:
        table.add_row(p.point + (" *" if p.crashable else ""), esc(p.summary))
    con.print(_fit(con, table, {"where": 20}))
    con.print(f"[{STYLE_DIM}]* crash and hang may name this point with point=[/]")


def profile_table(rows: list[dict[str, Any]]) -> None:
    """``hicache profiles list``."""
    con = console()
    table = Table(title="release profiles (--profile)", title_justify="left")
    _short(table, "profile")
    _short(table, "host pages")
    _long(table, "switches on")
    _long(table, "what it is")
    for r in rows:
        name = r["name"] + (" *" if r["default"] else "")
        switches = "\n".join(s["switch"] for s in r["switches"]) or "-"
        table.add_row(esc(name), esc(r["host_alloc"]), esc(switches), esc(r["summary"]))
    con.print(_fit(con, table, {"switches on": 23, "what it is": 16}))
    con.print(f"[{STYLE_DIM}]* the default; hicache profiles show NAME for what each leaves "
              "off and does not model[/]")


def profile_detail(r: dict[str, Any]) -> None:
    """``hicache profiles show NAME``."""
    con = console()
    head = r["name"] + (" (the default)" if r["default"] else "")
    con.print(f"[bold]{esc(head)}[/]: {esc(r['summary'])}", soft_wrap=True)
    para(con, r["host_alloc"], "host pages:")
    policies = r["policies"]
    para(con, f"timeout clock {policies['prefetch_timeout_clock']}, budget by "
              f"{policies['prefetch_timeout_budget']}; write_through_selective counts "
              f"{policies['write_through_hit_counting']}; eviction orders offered: "
              f"{', '.join(policies['eviction_policies'])}", "policies:")
    if r["switches"]:
        con.print("switches on:")
        for s in r["switches"]:
            para(con, f"{s['switch']} (fixed by {', '.join(s['fixed_by'])})", "-", 2)
    else:
        para(con, "none: every protocol fix this runtime models is in", "switches on:")
    if r["left_out"]:
        con.print("pre-fix code the release ran that the profile leaves off:")
        for switch, why in r["left_out"].items():
            para(con, f"{switch}: {why}", "-", 2)
    if r["not_modelled"]:
        con.print("not modelled (the release differs here; this runtime does not):")
        for line in r["not_modelled"]:
            para(con, line, "-", 2)


def release_matrix(result: Any) -> None:
    """``hicache campaign --profiles``: cells by profiles, then where each signature
    reproduces."""
    from faults.campaign.releases import cell_mark

    con = console()
    table = Table(title=f"release matrix of {esc(result.campaign)} ({result.wall_s:.0f} s)",
                  title_justify="left")
    _long(table, "cell")
    for p in result.profiles:
        _short(table, esc(p.removeprefix("sglang-")))
    at = {(c.row, c.column): c for c in result.cells}
    for row in dict.fromkeys(c.row for c in result.cells):
        marks = []
        for p in result.profiles:
            c = at.get((row, p))
            mark = cell_mark(c) if c is not None else ""
            style = STYLE_DIM if mark == "skipped" else STYLE_OK if mark == "clean" else STYLE_BAD
            marks.append(f"[{style}]{esc(mark)}[/]" if mark else "")
        table.add_row(esc(row), *marks)
    con.print(_fit(con, table, {"cell": 16}))
    found = result.reproduces()
    for sig, profiles in found.items():
        para(con, ", ".join(profiles), f"{esc(sig)}:")
    con.print(f"[{STYLE_DIM}]clean: healthy, outputs identical to a cache-disabled run; a "
              "profile is this runtime's rendering of a release (hicache profiles show)[/]")


def store_audit(a: StoreAudit) -> None:
    """``hicache doctor --store``: what the L3 file store holds and what is wrong with it."""
    con = console()
    formats = ", ".join(f"{n} {k}" for k, n in sorted(a.formats.items())) or "none"
    para(con, f"{esc(a.root)}: {a.pages} page(s), {a.bytes:,} bytes of payload "
              f"({formats})", "[bold]L3 store[/]")
    if a.stopped_at is not None:
        para(con, f"read the first {a.stopped_at:,} names only", f"[{STYLE_WARN}]partial:[/]")
    for label, n in sorted(a.stages.items()):
        para(con, f"{esc(label)}: {n} page(s)", "-", 2)
    if a.not_pages_count:
        para(con, f"{a.not_pages_count} file(s) that are no page, e.g. "
                  f"{', '.join(esc(repr(n)) for n in a.not_pages)}", f"[{STYLE_DIM}]ignored:[/]")
    problems = a.problems
    if not problems:
        con.print(f"[{STYLE_OK}]no problem found[/]")
        return
    for line in problems:
        para(con, esc(line), f"[{STYLE_BAD}]problem:[/]")
    examples = [("corrupt", a.corrupt), ("unreadable", a.unreadable),
                ("lacking ranks", a.rank_gap_examples)]
    for what, names in examples:
        if names:
            para(con, ", ".join(esc(n) for n in names), f"{what}, e.g.", 2)
    for label, per in sorted(a.rank_gaps.items()):
        missing = ", ".join(f"rank {r}: {n}" for r, n in per.items())
        para(con, f"{esc(label)}: pages missing per TP rank: {missing}", "-", 2)
    for label, sizes in sorted(a.size_mismatches.items()):
        shown = ", ".join(f"{n} of {size:,} bytes" for size, n in sizes.items())
        para(con, f"{esc(label)}: {shown}", "-", 2)
