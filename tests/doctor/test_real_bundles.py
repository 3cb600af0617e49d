"""The doctor on real runtime bundles (``runtime-*`` fixtures, written by
``tools/runtime_bundles.py``): each legacy switch's signature first, with evidence that cites
the bundle; the rank table names callers, not plumbing; exit codes read as what they mean;
bundles that fit no signature are said plainly."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from doctor.report.model import Diagnosis
from signatures.loader import load_catalog
from tests.doctor.conftest import FIXTURES

LEGACY = {
    "collective-order-deadlock/runtime-tp2-skip-empty-sync": "skip-empty-sync",
    "write-ack-pop-empty/runtime-pp2-skip-empty-sync": "skip-empty-sync",
    "prefix-length-mismatch/runtime-pp2-local-ack-drain": "local-ack-drain",
    "prefix-length-mismatch/runtime-pp2-local-prefetch-progress": "local-prefetch-progress",
    "collective-shape-mismatch/runtime-tp2-local-prefetch-progress": "local-prefetch-progress",
    "prefetch-abort-ack-starvation/runtime-tp2-abort-early-exit": "abort-early-exit",
    "pp-sync-send-leak/runtime-pp2-unbounded-pp-sends": "unbounded-pp-sends",
    "host-capacity-divergence/runtime-pp2-local-host-capacity": "local-host-capacity",
    "lru-clock-divergence/runtime-tp2-wallclock-lru": "wallclock-lru",
    "prefetch-abort-use-after-free/runtime-tp2-abort-frees-in-flight": "abort-frees-in-flight",
    "prefetch-gap-overcount/runtime-tp1-sum-hit-pages": "sum-hit-pages",
    "prefetch-abort-ack-starvation/runtime-tp2-abort-early-exit-divergence": "abort-early-exit",
    "prefetch-abort-ack-starvation/runtime-tp2-abort-early-exit-unwound": "abort-early-exit",
}


def _bundle(case: str) -> str:
    return str(FIXTURES / case / "bundle.tar.gz")


_CACHE: dict[str, Diagnosis] = {}


def _diagnose(case: str) -> Diagnosis:
    if case not in _CACHE:
        _CACHE[case] = diagnose([_bundle(case)])
    return _CACHE[case]


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_each_legacy_bundle_names_its_signature_first_with_cited_evidence(case: str) -> None:
    d = _diagnose(case)
    v = d.verdicts[0]
    assert v.signature == case.split("/")[0]
    assert v.confidence >= 0.75
    assert LEGACY[case] in d.topology["legacy"]
    cited = [e for e in v.evidence if e.file and "bundle.tar.gz!" in e.file]
    assert cited, v.evidence
    # evidence beyond the switch itself: a stack, a trace line or a flight-recorder entry
    assert any(e.line is not None for e in cited)


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_pipeline_groups_are_never_aligned_like_collectives(case: str) -> None:
    for f in _diagnose(case).collectives:
        if f.group.startswith("pp_"):
            assert f.kind in ("unreceived-send", "unmatched-recv", "size-mismatch"), f


def test_skip_empty_sync_rank_table_shows_the_callers() -> None:
    d = _diagnose("collective-order-deadlock/runtime-tp2-skip-empty-sync")
    frames = {r.rank: r.frame or "" for r in d.ranks}
    assert frames[0].startswith("_classic_writing_check (hicache.py:")
    assert frames[1].startswith("_attention (model.py:")
    assert not any("comm.py" in f or "lambda" in f for f in frames.values())
    assert len({s.site for s in d.blocked_sites}) == 2


def test_local_ack_drain_first_divergence_is_the_drain_vote() -> None:
    d = _diagnose("prefix-length-mismatch/runtime-pp2-local-ack-drain")
    fd = d.first_divergence
    assert fd is not None
    assert (fd.kind, fd.key) == ("sync.vote", "writing_check")
    assert len(set(fd.values.values())) == 2
    texts = " ".join(e.text for e in d.verdicts[0].evidence)
    assert "received the batch of step" in texts  # the downstream stage's own view
    assert d.ranks[0].frame is not None
    assert d.ranks[0].frame.startswith("_result_tokens")


def test_local_ack_drain_hang_is_a_stage_that_skipped_the_batch() -> None:
    """The same switch and fault, the other way the run can go (a run under load, kept as it
    came): PP1's view of step 38's batch was empty, so it ran none where PP0 sent one; PP0
    waits for the result and PP1 for PP0's next step until gloo times both out. The ranks wait
    in different exchanges (collective-order-deadlock, certain) because the stages' views of
    the batch diverged at the drain (the cause, named first)."""
    d = _diagnose("prefix-length-mismatch/runtime-pp2-local-ack-drain-hang")
    assert [v.signature for v in d.verdicts] == ["prefix-length-mismatch",
                                                 "collective-order-deadlock"]
    assert "message-skipped" in d.fingerprint.facts
    fd = d.first_divergence
    assert fd is not None
    assert (fd.kind, fd.key) == ("sync.vote", "writing_check")
    skipped = [f for f in d.collectives if f.kind == "unreceived-send"]
    assert [(f.group, f.ranks, f.peer) for f in skipped] == [("pp_act", [0, 1], 1)]
    waits = {(f.group, f.peer) for f in d.collectives if f.kind == "unmatched-recv"}
    assert ("pp_sync", 0) in waits  # PP1 went past the batch and waits for PP0's next step


def test_host_capacity_first_divergence_is_a_host_eviction() -> None:
    d = _diagnose("host-capacity-divergence/runtime-pp2-local-host-capacity")
    fd = d.first_divergence
    assert fd is not None
    assert fd.kind == "tree.evict_host"
    assert all("victims" in v for v in fd.values.values())
    texts = " ".join(e.text for e in d.verdicts[0].evidence)
    assert "never synced" in texts


def test_tp_size_abort_is_a_crash_inside_the_collective() -> None:
    d = _diagnose("collective-shape-mismatch/runtime-tp2-local-prefetch-progress")
    row = d.ranks[0]
    assert row.state == "crashed"
    assert row.error is not None
    assert "EnforceNotMet" in row.error
    assert "SIGABRT" in row.error
    assert row.site is not None
    assert row.site.startswith("_attention (model.py:")
    assert any("bytes arrived where it expected" in e.text for e in d.verdicts[0].evidence)


def test_injected_crash_is_no_known_signature_said_plainly() -> None:
    d = _diagnose("no-fit/runtime-tp2pp2-injected-crash")
    assert (d.status, d.exit_code, d.verdicts) == ("no-known-signature", 1, [])
    assert "injected on purpose" in d.summary
    assert any("injected fault" in o and "not a cache protocol bug" in o for o in d.observations)
    rank0 = d.ranks[0]
    assert rank0.state == "blocked"
    assert rank0.error is not None
    assert "stopped by the launcher (SIGTERM) after its dump" in \
        rank0.error


def test_wrong_output_bundle_is_said_plainly() -> None:
    d = _diagnose("no-fit/runtime-tp2-wrong-output")
    assert (d.status, d.exit_code) == ("no-known-signature", 1)
    assert d.topology["outcome"] == "wrong-output"
    assert "wrong output: 1 request(s) differ" in d.summary
    text = " ".join(d.observations)
    assert "Wrong output" in text
    assert "expected" in text
    assert "No decision differs between the ranks' traces" in text


def test_healthy_control_names_nothing() -> None:
    d = _diagnose("no-fit/runtime-pp2-fixed-protocols-healthy")
    assert (d.status, d.verdicts, d.near_misses) == ("no-known-signature", [], [])
    assert any("healthy run" in o for o in d.observations)


def test_incident_runbooks_read_well() -> None:
    from doctor.report.runbook import incident_runbook

    catalog = load_catalog()
    md = incident_runbook(_diagnose("prefix-length-mismatch/runtime-pp2-local-ack-drain"),
                          catalog)
    assert "### First divergent decision" in md
    assert "`sync.vote writing_check`" in md
    assert "at step" in md
    assert "bundle.tar.gz!runtime-pp2-local-ack-drain/rank1/" in md
    md = incident_runbook(_diagnose("no-fit/runtime-tp2-wrong-output"), catalog)
    assert "## No known signature" in md
    assert "Wrong output" in md


def _edited_crash_bundle(tmp: Path, exits: dict[int, tuple[int, bool]]) -> str:
    """The injected-crash bundle unpacked, with rank exit codes (and dumps) replaced."""
    with tarfile.open(_bundle("no-fit/runtime-tp2pp2-injected-crash")) as tar:
        tar.extractall(tmp, filter="data")
    root = tmp / "runtime-tp2pp2-injected-crash"
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["ranks"]:
        if entry["rank"] in exits:
            code, dumped = exits[entry["rank"]]
            entry["exit_code"] = code
            if not dumped:
                entry["files"] = dict.fromkeys(entry["files"])
                entry["error"] = f"no dump: exited with code {code}"
                for f in (root / f"rank{entry['rank']}").iterdir():
                    f.unlink()
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


def test_sigkill_without_a_dump_is_a_kill_and_after_a_dump_the_launcher(tmp_path: Path) -> None:
    d = diagnose([_edited_crash_bundle(tmp_path, {3: (-9, False), 0: (-9, True)})])
    rows = {r.rank: r for r in d.ranks}
    assert rows[3].error is not None
    assert "killed (SIGKILL) before it could dump" in rows[3].error
    assert rows[0].error is not None
    assert "stopped by the launcher (SIGKILL)" in rows[0].error
    oom = [line for line in d.rule_log if line.startswith("fact oom-killed")]
    assert len(oom) == 1
    assert "rank 3" in oom[0]


def test_sum_hit_pages_counts_sidecar_pages_past_a_hole() -> None:
    """The settlement's own record (which pages each pool found, how many it counted) is
    the evidence: the fact reads fields the runtime writes."""
    d = _diagnose("prefetch-gap-overcount/runtime-tp1-sum-hit-pages")
    texts = [e.text for e in d.verdicts[0].evidence]
    assert any("counted" in t and "pool all_pages" in t and "only the first" in t
               for t in texts), texts


def test_a_prefetch_vote_only_the_flight_recorders_show_names_the_ack_starvation() -> None:
    """A run on a loaded machine: the peer's prefetch sync thread timed out in its vote and
    died before the dumps, so no stack shows it there; both main threads wait in different
    collectives, which alone reads as a collective-order deadlock (it was named so, tied at
    0.75). The flight recorders still hold the mechanism: rank 1 entered vote #2 of the
    prefetch progress group and rank 0 never did."""
    d = _diagnose("prefetch-abort-ack-starvation/runtime-tp2-abort-early-exit-unwound")
    assert [v.signature for v in d.verdicts][:2] == ["prefetch-abort-ack-starvation",
                                                     "collective-order-deadlock"]
    assert d.verdicts[0].confidence > d.verdicts[1].confidence
    vote = [e for e in d.verdicts[0].evidence if "the prefetch vote of group" in e.text]
    assert vote, d.verdicts[0].evidence
    assert "prefetch_progress" in vote[0].text
    assert "ranks [1] entered #2" in vote[0].text
    assert not any(s.role == "prefetch" for s in d.blocked_sites)  # no stack shows it
