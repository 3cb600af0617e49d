"""The L3 threads under a backend that raises, and the per-step agreement they feed."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from faults.spec import parse_fault
from hicache_runtime.contracts.events import Ev
from hicache_runtime.dist.protocols import DrainCounts
from hicache_runtime.launch.run import run_single
from tests.runtime.test_l3 import healthy, l3_config


def test_a_backend_that_raises_is_a_miss_and_the_threads_go_on(tmp_path: Path,
                                                               bundle_root: Path) -> None:
    store = tmp_path / "l3"
    healthy(run_single(l3_config(store), compare=False, bundle_root=bundle_root))  # warm L3
    cfg = l3_config(store, faults=(parse_fault("storage-error:mode=raise,p=0.5"),))
    s = run_single(cfg, bundle_root=bundle_root)
    healthy(s)
    assert s.output_match is True
    l3 = s.cache_stats.total.l3
    assert l3 is not None
    assert l3.io_errors > 0, "page reads raised in the prefetch IO thread"
    assert l3.backup_errors > 0, "page writes raised in the backup thread"
    assert l3.prefetched_tokens > 0, "reads that did not raise still served hits"


def test_every_slot_of_the_step_agreement_is_fed(tmp_path: Path, bundle_root: Path) -> None:
    """Each count in the per-step vector is some queue's real length: a slot nothing ever
    feeds is a vote about nothing (and a trap for whoever reads it as a count)."""
    store = tmp_path / "l3"
    healthy(run_single(l3_config(store), compare=False, bundle_root=bundle_root))  # warm L3
    trace = tmp_path / "run.jsonl"
    s = run_single(l3_config(store, **{"observability.trace_path": trace}),
                   bundle_root=bundle_root)
    healthy(s)
    seen = [0] * len(DrainCounts._fields)
    for line in trace.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == Ev.VOTE and event["attrs"].get("site") == "drain_counts":
            agreed = event["attrs"]["agreed"]
            assert len(agreed) == len(seen)
            seen = [max(a, b) for a, b in zip(seen, agreed)]
    never = [name for name, n in zip(DrainCounts._fields, seen) if n == 0]
    assert not never, f"agreement slots never fed: {never}"


def test_an_interrupt_stops_the_rank_s_threads_before_it_unwinds(tmp_path: Path) -> None:
    """Ctrl-C in the middle of a single-rank run (a campaign's tp1 cell runs in the
    campaign's own process): by the time the interrupt leaves ``run_single`` the rank's L3
    threads are joined, so nothing writes into the store the campaign then removes. Before,
    the rank was closed only on the way out of a run that ended, and a full suite's
    interrupted campaign failed its cleanup with "Directory not empty: l3"."""
    before = set(threading.enumerate())

    def interrupt(step: int, finished: int, total: int) -> None:
        if finished >= 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_single(l3_config(tmp_path / "l3"), progress=interrupt, bundle_root=tmp_path / "b")
    left = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == []
