"""Bundles written by the runtime itself are read by the doctor."""

from __future__ import annotations

from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from faults.spec import parse_fault
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.launch.run import run, run_single
from tests.helpers import small_config


def test_crash_bundle_from_run_single(tmp_path: Path) -> None:
    cfg = small_config(faults=(parse_fault("crash:point=model.forward,step=5"),))
    summary = run_single(cfg, compare=False, bundle_root=tmp_path)
    assert summary.bundle is not None
    d = diagnose([summary.bundle])
    assert all(i.status == "read" for i in d.inputs), d.inputs
    assert d.topology["outcome"] == "crash"
    assert d.topology["faults"] == ["crash:steps=5-5,point=model.forward"]
    (row,) = d.ranks
    assert row.state == "crashed"
    assert row.error is not None
    assert "InjectedFault" in row.error
    assert row.frame is not None
    assert "builtin.py" in row.frame  # the crash kind raises in its own hook
    assert {"bundle", "trace", "state", "faulthandler", "traceback"} <= set(row.sources)
    # an injected crash is no known signature: said plainly, nothing forced
    assert d.status == "no-known-signature"
    assert d.exit_code == 1
    assert any("InjectedFault" in o for o in d.observations)


@pytest.mark.slow
@pytest.mark.multiproc
def test_legacy_run_bundle_names_the_switch_signature(tmp_path: Path) -> None:
    """tp2 + skip-empty-sync + host-alloc-fail on TP1: the ack-count all_reduce is skipped on
    one rank and the run hangs; the doctor names collective-order-deadlock."""
    cfg = small_config(**{"topology.tp": 2, "workload.requests": 24,
                          "observability.watchdog_timeout_s": 8.0},
                       faults=(parse_fault("host-alloc-fail:tp=1"),),
                       legacy=frozenset({LegacySwitch.SKIP_EMPTY_SYNC}))
    summary = run(cfg, compare=True, bundle_root=tmp_path)
    if summary.bundle is None:
        pytest.skip(f"the runtime did not reproduce the bug this time ({summary.outcome.value})")
    d = diagnose([summary.bundle])
    assert d.verdicts[0].signature == "collective-order-deadlock"
    assert "skip-empty-sync" in d.topology["legacy"]


@pytest.mark.parametrize("spec", ["crash:point=model.forward,step=5",
                                  "hang:point=cache.events,step=5"])
def test_an_injected_failure_is_said_to_be_one(tmp_path: Path, spec: str) -> None:
    """A crash or a hang the test asked for is named as injected, never as a protocol bug
    (a hang used to be read as collective-order-deadlock with an upstream fix to install)."""
    cfg = small_config(faults=(parse_fault(spec),),
                       **{"observability.watchdog_timeout_s": 1.0})
    summary = run_single(cfg, compare=False, bundle_root=tmp_path)
    assert summary.bundle is not None
    assert summary.faults_fired == 1
    d = diagnose([summary.bundle])
    assert d.exit_code == 1, d.summary
    assert "injected on purpose" in d.summary
    assert any("by the injected fault " + spec.split(":")[0] in o for o in d.observations), \
        d.observations


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(("spec", "what"), [
    ("rank-kill:rank=1,step=5", "was killed (SIGKILL)"),
    ("hang:rank=1,point=scheduler.step,step=5", "was made to hang"),
])
def test_an_injected_failure_on_one_rank_of_two(tmp_path: Path, spec: str, what: str) -> None:
    """tp2, a fatal fault on rank 1: the summary counts its firing (a killed rank reports
    nothing; its journal does), and the doctor says what the test did, not the OOM killer or
    a deadlock."""
    cfg = small_config(faults=(parse_fault(spec),),
                       **{"topology.tp": 2, "observability.watchdog_timeout_s": 3.0,
                          "observability.protocol_timeout_s": 6.0})
    summary = run(cfg, compare=False, bundle_root=tmp_path)
    assert summary.bundle is not None
    assert summary.faults_fired == 1
    assert not list(Path(summary.bundle).glob("rank*/faults_fired.json"))  # folded in
    d = diagnose([summary.bundle])
    assert d.exit_code == 1, (d.summary, [v.signature for v in d.verdicts])
    assert "injected on purpose" in d.summary
    assert any(f"Rank 1 {what}" in o for o in d.observations), d.observations
    assert not any("OOM killer" in o for o in d.observations), d.observations
