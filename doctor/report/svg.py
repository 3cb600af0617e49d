"""The timeline as an inline SVG: one lane per rank, time left to right.

Drawn with plain SVG elements, each carrying its meaning in ``class`` and ``data-*``
attributes (``g.lane[data-rank]``, ``rect.collective``, ``rect.collective.open`` for one never
exited, ``rect.fault-window``, ``line.mark[data-kind]``, ``line.divergence``, ``path.stop``)
and a ``<title>`` a browser shows on hover, so a page is readable without script and testable
by its elements. Every text comes from untrusted evidence and is escaped here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable

from doctor.report.model import Timeline, TimelineLane

WIDTH = 960
GUTTER = 170
"""Room left of the lanes for each rank's name, role and state."""
LANE = 38
AXIS = 28
LEGEND = 50
MARK_COLOURS = {"step": "#9aa5b1", "fault": "#d64545", "abort": "#e08a00", "transfer": "#3f7fbf",
                "storage": "#8a4fbf", "check": "#2f9e6e"}
LEGEND_ITEMS = (("collective", "#6b8fc7", "in a collective"),
                ("failed", "#b03a3a", "a collective that failed"),
                ("open", "#d64545", "in a collective it never left"),
                ("fault-window", "#f3c4c4", "a fault's window"),
                ("fault", MARK_COLOURS["fault"], "fault fired"),
                ("transfer", MARK_COLOURS["transfer"], "transfer"),
                ("divergence", "#111111", "first divergent decision"))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _ticks(end_ms: float) -> list[float]:
    """About six round tick values from 0 to ``end_ms``."""
    raw = max(end_ms, 1e-3) / 6
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(end_ms / step) + 1)]


def _label_ms(v: float) -> str:
    return f"{v / 1000:g} s" if v >= 1000 else f"{v:g} ms"


def activity_end(t: Timeline) -> float:
    """When the last thing began on any lane (a span, a mark): after it, every rank only
    waited. A hang spends most of its timeline there; a second picture up to this point shows
    what happened before it."""
    return max((max([s.start_ms for s in lane.spans] + [m.at_ms for m in lane.marks]
                    + [0.0]) for lane in t.lanes), default=0.0)


def timeline_svg(t: Timeline, until_ms: float | None = None) -> str:
    """The whole picture, one ``<svg>`` element; ``until_ms`` draws only the start of the run
    (what lies beyond is cut at the right edge)."""
    span = max(until_ms if until_ms is not None else t.end_ms, 1e-3)
    plot = WIDTH - GUTTER - 12

    def x(ms: float) -> float:
        return round(GUTTER + plot * min(max(ms, 0.0), span) / span, 2)

    height = AXIS + LANE * len(t.lanes) + LEGEND
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {WIDTH} '
           f'{height}" width="{WIDTH}" height="{height}" role="img" aria-label="timeline of '
           f'{len(t.lanes)} rank(s) over {_e(_label_ms(span))}" data-until-ms="{span:g}">',
           "<style>text{font:11px sans-serif;fill:#222}.tick{stroke:#ddd}"
           ".lane-bg{fill:#f7f8fa}.collective{fill:#6b8fc7}.collective.open{fill:#d64545}"
           ".collective.failed{fill:#b03a3a}"
           ".fault-window{fill:#f3c4c4;opacity:.8}.divergence{stroke:#111;stroke-width:2;"
           "stroke-dasharray:4 2}.stop{fill:#222}</style>"]
    for v in _ticks(span):
        out.append(f'<line class="tick" x1="{x(v)}" x2="{x(v)}" y1="{AXIS - 6}" '
                   f'y2="{AXIS + LANE * len(t.lanes)}"/>'
                   f'<text x="{x(v)}" y="{AXIS - 10}" text-anchor="middle">'
                   f'{_e(_label_ms(v))}</text>')
    for i, lane in enumerate(t.lanes):
        out += _lane(lane, AXIS + i * LANE, x)
    out += _legend(AXIS + LANE * len(t.lanes) + 12)
    out.append("</svg>")
    return "\n".join(out)


def _lane(lane: TimelineLane, top: int, x: Callable[[float], float]) -> list[str]:
    mid = top + LANE // 2
    name = f"rank {lane.rank}" + (f" · {lane.role}" if lane.role else "")
    out = [f'<g class="lane" data-rank="{lane.rank}" data-state="{_e(lane.state)}">',
           f'<rect class="lane-bg" x="{GUTTER}" y="{top + 3}" width="{WIDTH - GUTTER - 12}" '
           f'height="{LANE - 6}"/>',
           f'<text x="6" y="{mid - 2}">{_e(name)}</text>',
           f'<text x="6" y="{mid + 11}" class="state">{_e(lane.state or "-")}</text>']
    for s in lane.spans:
        end = s.end_ms if s.end_ms is not None else lane.end_ms
        cls = s.kind + (" open" if s.kind == "collective" and s.end_ms is None else
                        " failed" if s.kind == "collective" and s.state not in ("", "completed")
                        else "")
        y, h = (top + 5, LANE - 10) if s.kind == "fault-window" else (mid - 6, 12)
        width = max(1.5, x(end) - x(s.start_ms))
        out.append(f'<rect class="{cls}" data-kind="{s.kind}" x="{x(s.start_ms)}" y="{y}" '
                   f'width="{round(width, 2)}" height="{h}"><title>{_e(s.label)} '
                   f'({_e(_label_ms(s.start_ms))} to '
                   f'{_e(_label_ms(end)) if s.end_ms is not None else "the end"})'
                   "</title></rect>")
    for m in lane.marks:
        colour = MARK_COLOURS.get(m.kind, "#555")
        y1, y2 = (top + 4, top + 10) if m.kind == "step" else (top + 4, top + LANE - 4)
        out.append(f'<line class="mark" data-kind="{_e(m.kind)}" x1="{x(m.at_ms)}" '
                   f'x2="{x(m.at_ms)}" y1="{y1}" y2="{y2}" stroke="{colour}" '
                   f'stroke-width="{2 if m.kind in ("fault", "abort") else 1}">'
                   f"<title>{_e(m.label)} at {_e(_label_ms(m.at_ms))}</title></line>")
    if lane.divergence_ms is not None:
        out.append(f'<line class="divergence" x1="{x(lane.divergence_ms)}" '
                   f'x2="{x(lane.divergence_ms)}" y1="{top + 1}" y2="{top + LANE - 1}">'
                   f"<title>first divergent decision at "
                   f"{_e(_label_ms(lane.divergence_ms))}</title></line>")
    end = x(lane.end_ms)
    out.append(f'<path class="stop" d="M{end} {mid - 7} L{end + 7} {mid} L{end} {mid + 7} Z">'
               f"<title>rank {lane.rank}'s evidence ends here "
               f"({_e(_label_ms(lane.end_ms))}): {_e(lane.state or 'state unknown')}"
               "</title></path>")
    out.append("</g>")
    return out


def _legend(y: int) -> list[str]:
    """The legend, in rows that fit the plot's width."""
    out = [f'<g class="legend" transform="translate({GUTTER},{y})">']
    pos, row = 0, 0
    for cls, colour, text in LEGEND_ITEMS:
        width = 24 + 6 * len(text)
        if pos and pos + width > WIDTH - GUTTER - 12:
            pos, row = 0, row + 1
        out.append(f'<rect x="{pos}" y="{row * 16}" width="12" height="10" fill="{colour}" '
                   f'data-legend="{cls}"/><text x="{pos + 16}" y="{row * 16 + 9}">'
                   f"{_e(text)}</text>")
        pos += width
    out.append("</g>")
    return out
