"""All terminal rendering. The only module that imports rich.

Every human-readable report is drawn here from typed results (pydantic models); nothing else
prints except ``cli.py``'s plain ``--json`` output. Width and colour follow the environment
(``TERMINAL_WIDTH``, ``NO_COLOR``, ``FORCE_COLOR``) so tests get stable output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from hicache_runtime.run import RunSummary

STYLE_OK = "bold green"
STYLE_BAD = "bold red"
STYLE_WARN = "yellow"
STYLE_DIM = "dim"
STYLE_KEY = "cyan"

OUTCOME_STYLE = {"healthy": STYLE_OK, "crash": STYLE_BAD, "hang": STYLE_BAD,
                 "wrong-output": STYLE_BAD}


def console(stderr: bool = False) -> Console:
    width = os.environ.get("TERMINAL_WIDTH")
    return Console(stderr=stderr, width=int(width) if width and width.isdigit() else None,
                   no_color=bool(os.environ.get("NO_COLOR")), highlight=False,
                   soft_wrap=False)


def error(message: str, hint: str = "") -> None:
    """One line on stderr (plus a hint line): how user errors are shown."""
    con = console(stderr=True)
    con.print(f"[{STYLE_BAD}]error:[/] {message}", soft_wrap=True)
    if hint:
        con.print(f"[{STYLE_DIM}]hint:[/] {hint}", soft_wrap=True)


def warn(message: str) -> None:
    console(stderr=True).print(f"[{STYLE_WARN}]warning:[/] {message}")


def info(message: str) -> None:
    console().print(message)


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
    table.add_column(style=STYLE_KEY)
    table.add_column()
    match = {True: f"[{STYLE_OK}]identical to the cache-disabled run[/]",
             False: f"[{STYLE_BAD}]{len(s.mismatches)} request(s) differ[/]",
             None: f"[{STYLE_DIM}]not compared[/]"}[s.output_match]
    rows: list[tuple[str, str]] = [
        ("outcome", f"[{style}]{s.outcome.value}[/]"),
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
        rows.append(("legacy", ", ".join(s.legacy)))
    if s.faults:
        rows.append(("faults", f"{', '.join(s.faults)} (fired {s.faults_fired}x)"))
    if s.error:
        rows.append(("error", f"[{STYLE_BAD}]{s.error}[/]"))
    if s.bundle:
        rows.append(("bundle", s.bundle))
    for k, v in rows:
        table.add_row(k, v)
    con.print(Panel(table, title="hicache run", expand=False))
    for m in s.mismatches[:5]:
        con.print(f"  [{STYLE_BAD}]{m.rid}[/] first differs at token {m.index}: "
                  f"expected {m.expected[:8]} got {m.got[:8]} {m.note}")


def key_values(title: str, data: dict[str, Any]) -> None:
    table = Table(title=title, show_header=False)
    table.add_column(style=STYLE_KEY)
    table.add_column()
    for k, v in data.items():
        table.add_row(str(k), str(v))
    console().print(table)
