"""The suite's order under pytest-xdist's work stealing (tests/conftest.py): each worker's
first share opens with its part of the long tests, and no test is lost or run twice."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conftest import LONG_TESTS, _spread_long_first


@dataclass(frozen=True)
class _Item:
    nodeid: str


def test_each_worker_s_first_share_opens_with_its_long_tests() -> None:
    short = [_Item(f"tests/test_x.py::test_{n}") for n in range(40)]
    long_ = [_Item(LONG_TESTS[0] + "[0]"), _Item(LONG_TESTS[0] + "[1]"),
             _Item(LONG_TESTS[2]), _Item(LONG_TESTS[5] + "test_mypy_clean")]
    items = [*short[:10], long_[2], *short[10:30], *long_[:2], *short[30:], long_[3]]
    order = _spread_long_first(items, 2)  # type: ignore[arg-type]
    assert sorted(i.nodeid for i in order) == sorted(i.nodeid for i in items)
    # xdist's worksteal sends the first len//2 to one worker and the rest to the other
    half = len(order) // 2
    first, second = order[:half], order[half:]
    assert first[:2] == [long_[0], long_[2]]  # the longest known first, dealt round robin
    assert second[:2] == [long_[1], long_[3]]
    # the other tests keep their file order
    assert [i for i in order if i in short] == short


def test_a_collection_without_long_tests_keeps_its_order() -> None:
    items = [_Item(f"tests/test_x.py::test_{n}") for n in range(5)]
    assert _spread_long_first(items, 2) == items  # type: ignore[arg-type]
