"""Adding a fault kind is one object in one file: this one. Its hooks are all the runtime asks
of it, ``register_kind`` makes it a kind everywhere (specs, the injector, ``hicache faults
list``), and the doctor reads what it did from the effect its events carry, never from its
name. Two kinds, as a user would write them:

* ``storage-timeout`` (survivable): an L3 read that waits ``ms`` and then gives up, as a client
  with a read timeout does; acts through the storage hooks only.
* ``lock-hang`` (the failure itself): the scheduler thread blocks on a lock nobody releases,
  at ``cache.events``; the doctor must call the run's hang injected, as for ``hang``.

The kinds are registered for each test and removed after it: other tests in this process see
only the built-ins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from doctor.diagnose import diagnose
from faults.describe import describe_faults
from faults.kinds import KINDS, Kind, Param, StepVisit, StorageOp, register_kind, unregister_kind
from faults.points import FaultPoint
from faults.spec import FaultSpec, parse_fault
from hicache_runtime.config import load_config
from hicache_runtime.contracts.errors import InvalidFaultSpec
from hicache_runtime.contracts.fault_effects import FaultEffect
from hicache_runtime.contracts.outcome import RunOutcome
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config


@dataclass(frozen=True)
class StorageTimeout(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.STORAGE_ERROR

    def before_storage(self, spec: FaultSpec, op: StorageOp) -> None:
        time.sleep(spec.lag_s)  # the client waits its timeout out...

    def fails_storage(self, spec: FaultSpec, op: StorageOp) -> bool:
        return True  # ...and gives up: every page of the read is a miss


@dataclass(frozen=True)
class LockHang(Kind):
    def effect(self, spec: FaultSpec) -> FaultEffect:
        return FaultEffect.HANG

    def on_step(self, spec: FaultSpec, visit: StepVisit) -> None:
        held = threading.Lock()
        held.acquire()
        held.acquire()  # a lock its holder never releases


STORAGE_TIMEOUT = StorageTimeout(
    "storage-timeout", "L3 reads wait `ms` and then fail, as a client whose read times out.",
    (FaultPoint.STORAGE_GET,), (Param("ms", float, "the read timeout, milliseconds", "20"),))
LOCK_HANG = LockHang(
    "lock-hang", "The scheduler thread blocks on a lock no one releases, at `cache.events`.",
    (FaultPoint.CACHE_EVENTS,), survivable=False, stepped=True)


@pytest.fixture(autouse=True)
def _kinds() -> Iterator[None]:
    for kind in (STORAGE_TIMEOUT, LOCK_HANG):
        register_kind(kind)
    yield
    for kind in (STORAGE_TIMEOUT, LOCK_HANG):
        unregister_kind(kind.name)


def test_a_registered_kind_is_a_kind_everywhere() -> None:
    spec = parse_fault("storage-timeout:ms=5,p=0.5")
    assert (spec.kind, spec.ms, spec.compact()) == ("storage-timeout", 5.0,
                                                    "storage-timeout:p=0.5,ms=5")
    with pytest.raises(InvalidFaultSpec, match=r"storage-timeout has no key 'pages'"):
        parse_fault("storage-timeout:pages=2")  # its own parameters only
    listed = {k.kind: k for k in describe_faults().kinds}
    assert listed["lock-hang"].point == "cache.events"
    assert [p.name for p in listed["storage-timeout"].params] == ["ms"]
    # as a config file or a bundle spells it
    assert load_config({"faults": [{"kind": "lock-hang", "steps": [3, 3]}]}).faults[0].kind \
        == "lock-hang"


def test_a_kind_must_say_what_it_does() -> None:
    @dataclass(frozen=True)
    class Silent(Kind):
        pass

    with pytest.raises(ValueError, match="states no effect"):
        register_kind(Silent("silent", "does nothing", (FaultPoint.FORWARD,)))
    with pytest.raises(ValueError, match="already registered"):
        register_kind(LOCK_HANG)
    with pytest.raises(ValueError, match="built-in"):
        unregister_kind("crash")
    assert "silent" not in KINDS


def test_storage_timeouts_slow_reads_and_outputs_stay_right(tmp_path: Path) -> None:
    cfg = load_config({
        "storage.backend": "file", "storage.path": tmp_path / "l3", "workload.requests": 48,
        "cache.device_tokens": 512, "cache.host_tokens": 768, "storage.io_batch_pages": 4,
        "observability.watchdog_timeout_s": 30.0})
    warm = run_single(cfg, compare=False, bundle_root=tmp_path)  # fills L3
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    timed_out = cfg.with_overrides(faults=(parse_fault("storage-timeout:ms=2"),))
    s = run_single(timed_out, bundle_root=tmp_path)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is not False
    assert s.faults_fired > 0
    l3 = s.cache_stats.total.l3
    assert l3 is not None
    assert l3.prefetched_tokens == 0, "every read timed out: nothing came back from L3"


def test_the_doctor_reads_a_new_kind_by_what_it_did(tmp_path: Path) -> None:
    cfg = small_config(faults=(parse_fault("lock-hang:step=5"),),
                       **{"observability.watchdog_timeout_s": 1.0})
    summary = run_single(cfg, compare=False, bundle_root=tmp_path)
    assert summary.outcome is RunOutcome.HANG
    assert summary.bundle is not None
    d = diagnose([summary.bundle])
    # Named by its effect (a hang injected on purpose), never as a protocol bug, although no
    # line of the doctor knows the name lock-hang.
    assert d.exit_code == 1, d.summary
    assert "injected on purpose" in d.summary
    assert any("was made to hang at cache.events, step 5 by the injected fault lock-hang" in o
               for o in d.observations), d.observations
