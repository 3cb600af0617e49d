"""How many intra-op threads torch gets in a rank, in-process or spawned.

One by default: ranks share the machine with each other (and with the reference run's ranks),
and a small model gains nothing from OpenMP threads that spin against each other; on a loaded
two-core machine an unpinned single-rank run was 3 to 10 times slower. An explicit
``OMP_NUM_THREADS`` is the user's choice and wins.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

DEFAULT_THREADS = 1
P = ParamSpec("P")
R = TypeVar("R")


def torch_threads() -> int:
    """``OMP_NUM_THREADS`` when it is a positive integer, else :data:`DEFAULT_THREADS`."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and 0 < int(text) <= 4096:
        return int(text)
    return DEFAULT_THREADS


@contextlib.contextmanager
def pinned_torch_threads() -> Iterator[int]:
    """Run the block with :func:`torch_threads` intra-op threads; restore the caller's count
    afterwards (a library call must not change its host process for good)."""
    before = torch.get_num_threads()
    n = torch_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def pinned_threads(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator: ``fn`` runs under :func:`pinned_torch_threads` (an in-process rank)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with pinned_torch_threads():
            return fn(*args, **kwargs)

    return wrapper
