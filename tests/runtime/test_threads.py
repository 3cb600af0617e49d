"""An in-process (single-rank) run uses as many torch threads as a rank process does: one,
unless ``OMP_NUM_THREADS`` says otherwise; the caller's own setting is restored afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hicache_runtime.launch.run import run
from tests.helpers import small_config


@pytest.fixture
def unpinned() -> Iterator[None]:
    """A host process that left torch at more than one thread (a new user's shell)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_during_run(bundle_root: Path) -> set[int]:
    seen: set[int] = set()

    def progress(step: int, finished: int, total: int) -> None:
        seen.add(torch.get_num_threads())

    s = run(small_config(**{"workload.requests": 4}), progress=progress,
            bundle_root=bundle_root)
    assert s.outcome.value == "healthy"
    return seen


def test_a_single_rank_run_pins_torch_threads(unpinned: None, bundle_root: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _threads_during_run(bundle_root) == {1}
    assert torch.get_num_threads() == 2, "the caller's setting is restored"


def test_an_explicit_omp_num_threads_wins(unpinned: None, bundle_root: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads_during_run(bundle_root) == {3}
    assert torch.get_num_threads() == 2
