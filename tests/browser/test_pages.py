"""The HTML pages in a real browser (headless Chromium, driven by Playwright): the incident
page of a real runtime bundle, the catalog's runbooks and a campaign's matrix load with no
console error, their lists are lists, every link resolves, and a screenshot shows what the page
must show: a lane per rank, the fault's window drawn on the rank it fired on, the collective a
rank never left. Chromium comes from the system (``apt-get install chromium``; CI installs
it); without it these tests skip and say so."""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import app
from tests.readme_blocks import narrowed, readme_line, run_line

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "doctor"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
Image = pytest.importorskip("PIL.Image", reason="pillow is not installed")
pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="Chromium is not installed (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Visit:
    """A page opened in the browser, with what it logged."""

    def __init__(self, browser: Any, path: Path) -> None:
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1100, "height": 900},
                                     device_scale_factor=1)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error"
                     else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(path.resolve().as_uri())
        self.path = path

    def check_structure(self) -> None:
        """No console error, list items in lists, every link resolving."""
        assert self.errors == [], self.errors
        orphans = self.page.eval_on_selector_all(
            "li", "els => els.filter(e => !['OL', 'UL'].includes(e.parentElement.tagName))"
                  ".length")
        assert orphans == 0, f"{orphans} list item(s) outside a list in {self.path.name}"
        for href in self.page.eval_on_selector_all("a[href]",
                                                   "els => els.map(e => e.getAttribute('href'))"):
            if href.startswith(("http://", "https://")):
                continue  # outside addresses are shown, never fetched (the page's CSP)
            assert (self.path.parent / href.split("#")[0]).is_file(), \
                f"{self.path.name} links to {href}, which is not there"

    def shot(self, selector: str) -> Any:
        """A screenshot of the first element matching ``selector``, and its box on the page."""
        el = self.page.locator(selector).first
        return Image.open(io.BytesIO(el.screenshot())).convert("RGB"), el.bounding_box()


def _reddish(img: Any, box: dict[str, float], origin: dict[str, float]) -> bool:
    """Whether the screenshot shows red or pink across ``box`` (page coordinates): most of
    the pixels of a row just inside its top edge (marks and bars drawn over its middle
    aside)."""
    y = min(int(box["y"] - origin["y"] + 2), img.height - 1)
    xs = range(int(box["x"] - origin["x"]) + 1, int(box["x"] - origin["x"] + box["width"]))
    pixels = [img.getpixel((x, y)) for x in xs if 0 <= x < img.width]
    red = [p for p in pixels if p[0] > p[1] + 25 and p[0] > p[2] + 25]
    return bool(pixels) and len(red) >= len(pixels) / 2


@pytest.fixture(scope="module")
def incident(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The incident page of a real tp2 bundle: skip-empty-sync with host allocations failing
    on rank 1, which skipped a collective rank 0 then waited in until the timeout."""
    work = tmp_path_factory.mktemp("incident")
    case = FIXTURES / "collective-order-deadlock" / "runtime-tp2-skip-empty-sync"
    with tarfile.open(case / "bundle.tar.gz") as tar:
        tar.extractall(work, filter="data")
    bundle = next(p for p in work.iterdir() if p.is_dir())
    res = CliRunner().invoke(app, ["doctor", str(bundle), "--html", str(work / "incident.html")])
    assert res.exit_code == 0, res.output
    return work / "incident.html"


def test_the_incident_page_shows_each_rank_and_what_happened(browser: Any,
                                                             incident: Path) -> None:
    v = Visit(browser, incident)
    v.check_structure()
    assert v.page.locator(".verdict").first.get_attribute("data-signature") == \
        "collective-order-deadlock"
    svg = "figure.timeline svg"
    lanes = v.page.locator(f"{svg} >> nth=0").locator("g.lane")
    assert sorted(lanes.nth(i).get_attribute("data-rank") for i in range(lanes.count())) == \
        ["0", "1"]
    img, origin = v.shot(svg)
    assert img.width >= 900
    # a lane per rank, drawn: its background band is there in the picture
    for i in range(lanes.count()):
        band = lanes.nth(i).locator("rect.lane-bg").bounding_box()
        x, y = int(band["x"] - origin["x"] + 3), int(band["y"] - origin["y"] + 2)
        assert img.getpixel((x, y)) == (247, 248, 250), f"lane {i} not drawn"
    # rank 1's host allocations failed: the fault's window is on its lane, not on rank 0's
    rank1 = v.page.locator(f"{svg} >> nth=0").locator('g.lane[data-rank="1"]')
    rank0 = v.page.locator(f"{svg} >> nth=0").locator('g.lane[data-rank="0"]')
    assert rank0.locator("rect.fault-window").count() == 0
    assert rank1.locator('line.mark[data-kind="fault"]').count() >= 1
    zoom = "figure.zoom svg"  # the stall takes the whole first picture: the zoom shows it
    zimg, zorigin = v.shot(zoom)
    window = v.page.locator(zoom).locator('g.lane[data-rank="1"] rect.fault-window').first
    assert _reddish(zimg, window.bounding_box(), zorigin), "the fault window is not drawn"
    # rank 0 waited in the collective rank 1 skipped until it failed: a long red bar
    stuck = rank0.locator("rect.collective.failed, rect.collective.open").first
    box = stuck.bounding_box()
    assert box["width"] > 0.5 * lanes.nth(0).locator("rect.lane-bg").bounding_box()["width"]
    assert _reddish(img, box, origin)
    assert "_classic_writing_check" in stuck.locator("title").text_content()
    # each rank's end is marked
    assert v.page.locator(f"{svg} >> nth=0").locator("path.stop").count() == 2


def test_a_folder_of_bundles_is_an_index_and_a_page_per_incident(browser: Any,
                                                                 tmp_path: Path) -> None:
    """hicache doctor DIR --html OUT with two runs' bundles in DIR: an index that lists both
    incidents and links to each page, and each page with its own verdict and a lane per rank
    of its own run (never one merged world)."""
    work = tmp_path / "bundles"
    work.mkdir()
    cases = {"collective-order-deadlock": "runtime-tp2-skip-empty-sync",
             "host-capacity-divergence": "runtime-pp2-local-host-capacity"}
    for sig, case in cases.items():
        with tarfile.open(FIXTURES / sig / case / "bundle.tar.gz") as tar:
            tar.extractall(work, filter="data")
    assert len([p for p in work.iterdir() if p.is_dir()]) == 2
    out = tmp_path / "pages"
    res = CliRunner().invoke(app, ["doctor", str(work), "--html", str(out)])
    assert res.exit_code == 0, res.output
    index = Visit(browser, out / "index.html")
    index.check_structure()
    links = index.page.eval_on_selector_all("a[href]",
                                            "els => els.map(e => e.getAttribute('href'))")
    pages = sorted({h for h in links if h.startswith("incident-")})
    assert pages == ["incident-1.html", "incident-2.html"]
    index.page.close()
    seen = set()
    for name in pages:
        v = Visit(browser, out / name)
        v.check_structure()
        sig = v.page.locator(".verdict").first.get_attribute("data-signature")
        seen.add(sig)
        lanes = v.page.locator("figure.timeline svg >> nth=0").locator("g.lane")
        assert lanes.count() == 2, f"{name}: {lanes.count()} lanes (each run has two ranks)"
        v.page.close()
    assert seen == set(cases)


def test_an_incident_runbook_from_a_stored_diagnosis_draws_the_same_timeline(
        browser: Any, incident: Path, tmp_path: Path) -> None:
    """hicache runbook --from DIAGNOSIS.json --html: the stored diagnosis carries the run's
    timeline, and the page draws it as the doctor's own page does (a lane per rank, the
    fault on rank 1's)."""
    bundle = next(p for p in incident.parent.iterdir() if p.is_dir())
    diag = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["doctor", str(bundle), "--json", "--out", str(diag)])
    assert res.exit_code == 0, res.output
    page = tmp_path / "rb" / "incident.md"
    res = CliRunner().invoke(app, ["runbook", "--from", str(diag), "--html", "-o", str(page)])
    assert res.exit_code == 0, res.output
    v = Visit(browser, page.with_suffix(".html"))
    v.check_structure()
    svg = v.page.locator("figure.timeline svg >> nth=0")
    lanes = svg.locator("g.lane")
    assert sorted(lanes.nth(i).get_attribute("data-rank") for i in range(lanes.count())) == \
        ["0", "1"]
    assert svg.locator('g.lane[data-rank="1"] line.mark[data-kind="fault"]').count() >= 1
    assert svg.locator('g.lane[data-rank="0"] line.mark[data-kind="fault"]').count() == 0
    img, origin = v.shot("figure.timeline svg")
    band = lanes.nth(0).locator("rect.lane-bg").bounding_box()
    assert img.getpixel((int(band["x"] - origin["x"] + 3), int(band["y"] - origin["y"] + 2))) \
        == (247, 248, 250), "lane not drawn"


def test_runbook_pages_link_only_to_pages_that_exist(browser: Any, tmp_path: Path) -> None:
    out = tmp_path / "runbooks"
    res = CliRunner().invoke(app, ["runbook", "--out", str(out), "--html"])
    assert res.exit_code == 0, res.output
    pages = sorted(out.glob("*.html"))
    assert len(pages) > 10
    for path in pages:
        v = Visit(browser, path)
        v.check_structure()
        if path.name != "index.html":  # numbered steps stay numbered
            assert v.page.locator("ol > li").count() >= 2, path.name
        v.page.close()
    # an incident runbook alone: its "related" signatures are not written, so not links
    diag = tmp_path / "d.json"
    CliRunner().invoke(app, ["doctor", str(FIXTURES / "mixed" / "tp4-rank2-missing"), "--json",
                             "--out", str(diag)])
    single = tmp_path / "single" / "incident.md"
    res = CliRunner().invoke(app, ["runbook", "--from", str(diag), "--html", "-o", str(single)])
    assert res.exit_code == 0, res.output
    Visit(browser, single.with_suffix(".html")).check_structure()


@pytest.mark.slow
def test_the_campaign_page_is_a_matrix_with_an_incident_page_per_bundle(
        browser: Any, tmp_path: Path) -> None:
    """The README's campaign line with its three reports, narrowed to a slow stage under the
    fixed protocol and under unbounded-pp-sends."""
    line = narrowed(readme_line("hicache campaign --only 'pp2/*'"), "pp2/*/stage-lag:pp=1,ms=10")
    proc = run_line(line, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert (tmp_path / "out.xml").read_text().count("<testcase") == 2
    assert "pp-sync-send-leak" in (tmp_path / "out.md").read_text()
    out = tmp_path / "report"
    v = Visit(browser, out / "index.html")
    v.check_structure()
    cells = v.page.locator("table.matrix td[data-cell]")
    assert cells.count() == 2
    states = {cells.nth(i).get_attribute("data-cell"): cells.nth(i).get_attribute("data-state")
              for i in range(2)}
    assert set(states.values()) == {"pass"}, states
    headers = v.page.locator("table.matrix thead th").all_text_contents()
    assert headers[1:] == ["fixed", "unbounded-pp-sends"]
    img, origin = v.shot("table.matrix")
    box = cells.nth(0).bounding_box()
    assert img.getpixel((int(box["x"] - origin["x"] + 4), int(box["y"] - origin["y"] + 4))) \
        == (227, 244, 234)  # a passing cell is green
    link = v.page.locator("table.matrix td a").first
    target = out / link.get_attribute("href")
    w = Visit(browser, target)
    w.check_structure()
    assert w.page.locator(".verdict").first.get_attribute("data-signature") == \
        "pp-sync-send-leak"
    assert w.page.locator("figure.timeline svg g.lane").count() >= 1
