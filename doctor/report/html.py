"""HTML pages: runbooks, the incident page (verdict, timeline, evidence, playbook), and the
page shell a campaign's report uses too.

Markdown becomes HTML through markdown-it (CommonMark: real ``<ol>``/``<ul>`` lists, code
blocks, tables), with raw HTML and images off: a diagnosis is untrusted (it may come with an
incident from anyone), so its text is always escaped, a link is made only to an ``http(s)``
address or to a sibling page that is written beside this one (any other target stays text, its
address in parentheses), and the page's Content-Security-Policy lets it load nothing from
anywhere: no script, no remote style, no image.
"""

from __future__ import annotations

import html
import re
from collections.abc import Collection
from typing import Any

from markdown_it import MarkdownIt

from doctor.report.model import Diagnosis
from doctor.report.svg import activity_end, timeline_svg

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
STYLE = """
body{font:15px/1.5 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.25em;margin-top:1.6em}h3{font-size:1.05em}
code,pre{font:13px ui-monospace,monospace;background:#f3f4f6}pre{padding:.6em;overflow-x:auto}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}
.verdict{border-left:6px solid #d64545;padding:.4em .9em;background:#fbf2f2}
.verdict.none{border-color:#9aa5b1;background:#f5f6f7}
.pass{background:#e3f4ea}.fail{background:#fbe4e4}.skip{background:#f1f1f1}
figure{margin:1em 0;overflow-x:auto}figcaption{color:#555;font-size:.9em}
"""
ZOOM_BELOW = 0.4
"""A second, zoomed timeline when everything happened in less than this share of it."""
_WEB = re.compile(r"https?://[^\s<>\"'`]+", re.IGNORECASE)
_SIBLING = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.(md|html)$")  # a whole name, from its start


def _markdown(pages: Collection[str]) -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")

    def link_open(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        href = _href(tokens[idx].attrGet("href") or "", pages)
        env.setdefault("links", []).append((href, tokens[idx].attrGet("href") or ""))
        if href is None:
            return ""
        tokens[idx].attrSet("href", href)
        return str(self.renderToken(tokens, idx, options, env))

    def link_close(self: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        href, raw = env["links"].pop()
        return "</a>" if href is not None else f" ({html.escape(raw)})"

    md.add_render_rule("link_open", link_open)
    md.add_render_rule("link_close", link_close)
    return md


def _href(target: str, pages: Collection[str]) -> str | None:
    """The ``href`` of a link, or None when it must stay text: an http(s) address, or a
    sibling page that exists beside this one (``x.md`` points at ``x.html``)."""
    if _WEB.fullmatch(target):
        return target
    if _SIBLING.fullmatch(target):
        page = re.sub(r"\.md$", ".html", target)
        return page if page in pages else None
    return None


def markdown_html(markdown: str, pages: Collection[str] = ()) -> str:
    """``markdown`` as an HTML fragment; ``pages`` are the sibling pages links may point to."""
    return _markdown(pages).render(markdown, {})


#: Controls HTML text may not hold, and the line separators a Python reader would split at:
#: untrusted text carries them (U+001C, U+2028), the pages never do.
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def page(title: str, body: str) -> str:
    """A whole page around an HTML ``body`` fragment: nothing loads from anywhere, and no
    control character from untrusted text is left in it."""
    title, body = _CONTROLS.sub(" ", title), _CONTROLS.sub(" ", body)
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
            f"{body}\n</body></html>\n")


def runbook_page(markdown: str, title: str, pages: Collection[str] = ()) -> str:
    """A runbook (Markdown) as a page."""
    return page(title, markdown_html(markdown, pages))


def incident_page(d: Diagnosis, runbook_markdown: str, pages: Collection[str] = ()) -> str:
    """One incident: the verdict, the timeline of the ranks' runs (when the inputs held
    traces), then the incident runbook (evidence, ranks, first divergence, playbook)."""
    e = html.escape
    if d.verdicts:
        v = d.verdicts[0]
        head = (f'<div class="verdict" data-signature="{e(v.signature)}"><strong>'
                f"{e(v.signature)}</strong> ({v.confidence:.2f}): {e(v.title)}</div>")
    else:
        head = f'<div class="verdict none">{e(d.summary)}</div>'
    job = ", ".join(f"{k}={v}" for k, v in d.topology.items()
                    if v not in (None, "", [], {}) and not isinstance(v, (list, dict)))
    parts = [f"<h1>Incident: {e(d.summary)}</h1>", head,
             f"<p>Catalog {e(d.catalog_version)}; {e(job) or 'topology unknown'}.</p>"]
    if d.timeline is not None and d.timeline.lanes:
        t = d.timeline
        caption = (f"Each rank's traced run on one clock ({len(t.lanes)} lane(s), "
                   f"{t.end_ms:g} ms). Bars are collectives (red: never left), shaded "
                   "windows are where a fault acted, ticks are fault firings, step starts and "
                   "transfers, the dashed line is the first divergent decision"
                   + (f" ({e(t.divergence)})" if t.divergence else "")
                   + ", the triangle is where the rank's evidence ends. Hover for details.")
        parts.append(f'<h2>Timeline</h2><figure class="timeline">{timeline_svg(t)}'
                     f"<figcaption>{caption}</figcaption></figure>")
        busy = activity_end(t)
        if 0 < busy < ZOOM_BELOW * t.end_ms:  # the run mostly waited: show what came before
            until = float(f"{busy * 1.15:.3g}")
            parts.append(f'<figure class="timeline zoom">{timeline_svg(t, until)}<figcaption>'
                         f"The first {until:g} ms, before every rank only waited.</figcaption>"
                         "</figure>")
    parts.append(markdown_html(_without_title(runbook_markdown), pages))
    return page(f"Incident: {d.summary}", "\n".join(parts))


def _without_title(markdown: str) -> str:
    """The runbook without its ``# Incident runbook: ...`` line (the page has its own)."""
    lines = markdown.splitlines()
    return "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines)


def incidents_index(rows: list[tuple[str, str, str, Diagnosis]]) -> str:
    """Several incidents, newest first: (page, bundle, written at, diagnosis) each."""
    e = html.escape
    body = ["<h1>Incidents, newest first</h1>", "<table><thead><tr><th>#</th><th>bundle</th>"
            "<th>written</th><th>outcome</th><th>verdict</th></tr></thead><tbody>"]
    for n, (href, bundle, created, d) in enumerate(rows, 1):
        verdict = (f"{e(d.verdicts[0].signature)} ({d.verdicts[0].confidence:.2f})"
                   if d.verdicts else e(d.summary))
        body.append(f'<tr class="{"fail" if d.verdicts else "skip"}"><td>{n}</td>'
                    f'<td><a href="{e(href)}">{e(bundle)}</a></td><td>{e(created)}</td>'
                    f"<td>{e(str(d.topology.get('outcome') or '-'))}</td><td>{verdict}</td></tr>")
    body.append("</tbody></table>")
    return page("Incidents", "\n".join(body))
