"""The doctor on real crash reports (``tests/corpus``): verbatim excerpts of public issue threads,
labelled from the catalog's definitions before the doctor saw them.

Floors are set a little under what the doctor reaches (``bench/triage_accuracy.py`` prints the
figures); a change that makes triage of real reports worse fails here. The excerpts are read as
files, inside Markdown and HTML pages of our own, from stdin, and as another deployment would
print them (paths, ranks, line numbers, timestamps, addresses changed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from doctor.diagnose import diagnose
from doctor.report.model import Diagnosis
from signatures.loader import load_catalog
from tests.corpus import (
    NONE,
    Case,
    answer,
    as_blockquote,
    as_container_log,
    as_html,
    as_markdown,
    diagnose_bytes,
    load_cases,
    perturb,
)

#: Floors, each under what the doctor reaches today (see the module docstring). Rounds 10 to
#: 12 (87 reports from threads no earlier round used) took the whole corpus from 0.843 to
#: 0.829 (perturbed 0.827, positives 0.677): the floors follow the corpus, not the other way
#: round.
FLOOR_ALL = 0.82
FLOOR_POSITIVES = 0.66
FLOOR_NEGATIVES = 0.97
FLOOR_PERTURBED = 0.82
FLOOR_PAGES = 0.82
HIGH = 0.8


@cache
def _cases() -> tuple[Case, ...]:
    return tuple(load_cases())


@cache
def _plain(case_id: str) -> Diagnosis:
    """The excerpt's diagnosis, made once per session: several tests read the same one."""
    c = next(c for c in _cases() if c.id == case_id)
    return diagnose_bytes(f"{c.id}.log", c.text)


@cache
def _perturbed(case_id: str) -> Diagnosis:
    """The diagnosis of the excerpt as another deployment would print it (other paths, ranks,
    line numbers, timestamps, addresses, and another file name), made once per session."""
    c = next(c for c in _cases() if c.id == case_id)
    return diagnose_bytes(f"copy-of-{c.id}.log",
                          perturb(c.text.decode("utf-8", "replace"), seed=len(c.id)).encode())


def _accuracy(run: Callable[[Case], Diagnosis]) -> tuple[float, list[str]]:
    wrong = []
    for c in _cases():
        said, conf = answer(run(c))
        if said not in c.label:
            wrong.append(f"{c.id}: said {said} ({conf:.2f}), label {list(c.label)}")
    return 1 - len(wrong) / len(_cases()), wrong


def test_the_corpus_is_real_labelled_and_large_enough() -> None:
    cases = _cases()
    ids = {s.id for s in load_catalog().signatures}
    assert len(cases) >= 100
    assert sum(not c.positive for c in cases) >= 40
    urls = [c.url for c in cases]
    for c in cases:
        assert re.match(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+", c.url), c.id
        assert c.label, c.id
        assert set(c.label) <= ids | {NONE}, c.id
        assert len(c.reason) > 20, c.id
        text = c.text.decode("utf-8")
        assert text.strip(), c.id
        # evidence only: no page wrapping of the thread it came from
        assert "```" not in text, c.id
        assert "<details" not in text, c.id
    assert max(urls.count(u) for u in urls) <= 2, "at most two excerpts of one thread"


def test_top1_on_excerpts_read_as_files(tmp_path: Path) -> None:
    def run(c: Case) -> Diagnosis:
        path = tmp_path / f"{c.id}.log"
        path.write_bytes(c.text)
        return diagnose([str(path)])

    acc, wrong = _accuracy(run)
    positives = [c for c in _cases() if c.positive]
    pos_wrong = [w for w in wrong if any(w.startswith(c.id + ":") for c in positives)]
    neg_acc = 1 - (len(wrong) - len(pos_wrong)) / (len(_cases()) - len(positives))
    assert acc >= FLOOR_ALL, "\n".join(wrong)
    assert 1 - len(pos_wrong) / len(positives) >= FLOOR_POSITIVES, "\n".join(pos_wrong)
    assert neg_acc >= FLOOR_NEGATIVES, "\n".join(sorted(set(wrong) - set(pos_wrong)))


@pytest.mark.parametrize("page", [as_markdown, as_html], ids=["markdown", "html"])
def test_top1_on_excerpts_inside_issue_pages(page: Callable[[Case], bytes],
                                             tmp_path: Path) -> None:
    suffix = ".md" if page is as_markdown else ".html"

    def run(c: Case) -> Diagnosis:
        path = tmp_path / f"{c.id}{suffix}"
        path.write_bytes(page(c))
        return diagnose([str(path)])

    acc, wrong = _accuracy(run)
    assert acc >= FLOOR_PAGES, "\n".join(wrong)


@pytest.mark.parametrize("wrap", [as_blockquote, as_container_log],
                         ids=["blockquote", "container-log"])
def test_quoted_and_container_logs_read_as_the_logs_they_are(
        wrap: Callable[[Case], bytes]) -> None:
    """Evidence quoted in Markdown (``> `` before every line) and as a container runtime
    stores it (``<RFC 3339 time> stderr F ``) gets the answers the plain excerpt gets."""
    differ = []
    for c in _cases():
        plain = answer(_plain(c.id))[0]
        wrapped = answer(diagnose_bytes(f"{c.id}.log", wrap(c)))[0]
        if wrapped != plain:
            differ.append(f"{c.id}: {plain} -> {wrapped}")
    assert not differ, "\n".join(differ)


def test_top1_on_excerpts_piped_on_stdin() -> None:
    runner = CliRunner()

    def run(c: Case) -> Diagnosis:
        res = runner.invoke(app, ["doctor", "-", "--json"], input=c.text)
        assert res.exit_code in (0, 1), res.output
        return Diagnosis.model_validate(json.loads(res.stdout))

    acc, wrong = _accuracy(run)
    assert acc >= FLOOR_ALL, "\n".join(wrong)


def test_top1_on_a_perturbed_copy() -> None:
    """Other install paths, ranks, line numbers, timestamps, addresses: the same answers."""
    acc, wrong = _accuracy(lambda c: _perturbed(c.id))
    assert acc >= FLOOR_PERTURBED, "\n".join(wrong)


def test_no_wrong_answer_at_high_confidence() -> None:
    """Calibration: a verdict at confidence >= 0.8 is right (plain and perturbed copies)."""
    wrong = []
    for c in _cases():
        for d in (_plain(c.id), _perturbed(c.id)):
            said, conf = answer(d)
            if said != NONE and conf >= HIGH and said not in c.label:
                wrong.append(f"{c.id}: {said} at {conf:.2f}")
    assert not wrong


def test_a_look_alike_says_what_it_does_see() -> None:
    """Hard negatives are not met with silence: the report names what the doctor sees."""
    silent = []
    for c in _cases():
        if c.positive:
            continue
        d = _plain(c.id)
        if not d.verdicts and not d.observations and not d.lookalikes:
            silent.append(c.id)
    assert len(silent) <= 2, silent


def test_fingerprints_group_the_same_failure_and_split_different_ones() -> None:
    ids = {}
    unstable = []
    for c in _cases():
        fp = _plain(c.id).fingerprint
        again = _perturbed(c.id)
        assert fp is not None
        assert again.fingerprint is not None
        if fp.id != again.fingerprint.id:
            unstable.append(c.id)
        ids.setdefault(fp.id, []).append(c.id)
    assert len(unstable) <= 2, unstable
    # (rounds 10 and 11 brought reports of one failure from sibling threads: they group)
    assert len(ids) >= 0.87 * len(_cases()), "different failures must mostly differ"
