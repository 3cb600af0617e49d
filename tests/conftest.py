"""Shared test setup: Hypothesis profiles, stable terminal output, small configs, a real
redis-server."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.testing
from hypothesis import HealthCheck, Verbosity, settings

from hicache_runtime.contracts.event_payloads import STRICT_ENV
from hicache_runtime.l3.backends.redis_server import LocalRedisServer, redis_server_binary

try:
    import torch
except ImportError:  # the triage install (no [runtime] extra): the doctor's tests still run
    torch = None  # type: ignore[assignment]

# Bytecode for every interpreter the suite starts (xdist's workers, CLI commands, zygotes,
# nested pytest sessions), where the environment asks for none (PYTHONDONTWRITEBYTECODE, as
# container images set it): kept under a prefix in the user's cache directory (not a shared
# temporary one, where another user could plant bytecode first), so the tree stays as clean as
# that setting keeps it, while the hundreds of processes the suite starts compile each module
# (and pytest rewrites each test module) once instead of each time. On a CLI-heavy subset of
# the suite: 12% less CPU once the prefix is warm.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    _cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    os.environ.setdefault("PYTHONPYCACHEPREFIX", str(_cache_home / "hicache-doctor" / "pycache"))

# Every event any test makes (in this process and in the rank processes it starts, which
# inherit the environment) is checked against its payload model.
os.environ[STRICT_ENV] = "1"

# One intra-op thread per process: tests run several ranks (and other tests) on two cores,
# where spinning OpenMP threads make everything many times slower.
if torch is not None:
    torch.set_num_threads(1)

# typer's CliRunner.invoke builds the whole click command tree from the app's functions on
# every call (about 0.1 s for hicache's, from their signatures and type hints; the corpus tests
# alone invoke it hundreds of times): build each app's tree once. Nothing the tests change
# between invocations (environment, monkeypatched helpers) is read while building it.
typer.testing._get_command = functools.cache(typer.testing._get_command)  # type: ignore[attr-defined]

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("debug", max_examples=10, deadline=None, verbosity=Verbosity.verbose)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _stable_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_WIDTH", "120")
    monkeypatch.setenv("NO_COLOR", "1")


@pytest.fixture
def bundle_root(tmp_path: Path) -> Path:
    path = tmp_path / "bundles"
    path.mkdir()
    return path


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedisServer]:
    """A real redis-server on 127.0.0.1 on a free port, killed at teardown.

    Tests may ``kill()`` it and ``start()`` it again on the same port (it keeps no data: a
    restarted server is empty). Skips the test when the binary is not installed.
    """
    if redis_server_binary() is None:
        pytest.skip("redis-server binary not found on PATH (apt-get install redis-server)")
    server = LocalRedisServer(workdir=tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.close()


_TORCH_FREE_RUN = ("tests/test_light_install.py::"
                   "test_the_doctor_and_catalog_tests_pass_without_torch")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The doctor's and the catalog's tests run once: when this session also runs them in a
    torch-free interpreter (tests/test_light_install.py, as the triage install runs them),
    they are not run here a second time; alone (``pytest tests/doctor``) they run here.
    ``gpu`` tests skip cleanly on a machine without CUDA."""
    if torch is not None and any(item.nodeid.startswith(_TORCH_FREE_RUN + "[")
                                 for item in items):
        from tests.test_light_install import NEEDS_TORCH_MODULES, NEEDS_TORCH_TESTS

        def torch_free(item: pytest.Item) -> bool:
            path = item.nodeid.split("::", 1)[0]
            return path.startswith(("tests/doctor/", "tests/signatures/")) \
                and path not in NEEDS_TORCH_MODULES \
                and not any(item.nodeid.startswith(t) for t in NEEDS_TORCH_TESTS)

        twice = [item for item in items if torch_free(item)]
        if twice:
            config.hook.pytest_deselected(items=twice)
            items[:] = [item for item in items if not torch_free(item)]
    workers = getattr(config, "workerinput", {}).get("workercount", 0)
    if workers > 1:
        items[:] = _spread_long_first(items, workers)
    if torch is not None and torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: The tests that take a minute or more on two shared cores (``--durations``): each worker
#: should start its share of them first, so that none is left to start while the other
#: worker has nothing it can take over.
LONG_TESTS = (
    "tests/test_light_install.py::test_the_doctor_and_catalog_tests_pass_without_torch",
    "tests/multirank/test_property_campaign.py::",
    "tests/multirank/test_campaigns.py::test_default_campaign_every_cell_behaves",
    "tests/runtime/test_l3_mooncake.py::test_tp2xpp2_second_run_from_l3_then_master_killed",
    "tests/runtime/test_mooncake_campaign.py::",
    "tests/test_typecheck.py::",
    "tests/test_readme_examples.py::test_flake_hunting_seeds_as_written",
    "tests/multirank/test_profiles.py::test_release_matrix_of_a_failed_host_allocation",
    "tests/multirank/test_readme_runs.py::test_four_ranks_on_a_file_store",
    "tests/faults/test_ray_executor.py::test_shards_and_resume_on_the_cluster",
    "tests/multirank/test_campaigns.py::test_replay_and_shrink_a_pipeline_crash",
)


def _spread_long_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """The order for pytest-xdist's ``worksteal`` scheduling (``--dist worksteal`` in
    pyproject.toml), which hands the first ``len/workers`` items to one worker, the next
    share to the next, and later moves queued (never running) items to a worker that ran dry:
    each share opens with its part of the long tests (longest known first, dealt round
    robin), then the other items in file order. The same order on every worker."""
    long_ = [i for i in items if i.nodeid.startswith(LONG_TESTS)]
    if not long_:
        return items
    rank = {prefix: n for n, prefix in enumerate(LONG_TESTS)}
    long_.sort(key=lambda i: next(rank[p] for p in LONG_TESTS if i.nodeid.startswith(p)))
    rest = [i for i in items if not i.nodeid.startswith(LONG_TESTS)]
    out: list[pytest.Item] = []
    left = len(items)
    for k in range(workers):
        # the share xdist sends this worker first: what is left, over the workers still to serve
        size = left // (workers - k)
        mine = long_[k::workers]
        take = max(0, size - len(mine))
        share = mine + rest[:take]
        del rest[:take]
        out += share
        left -= len(share)
    return out + rest
