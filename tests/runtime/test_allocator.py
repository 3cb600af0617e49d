"""The page allocator catches double allocation and double free, and maps pages to slots."""

from __future__ import annotations

import pytest
import torch

from hicache_runtime.contracts.errors import DoubleAllocation, DoubleFree, InvariantViolation
from hicache_runtime.kv.allocator import PageAllocator


def test_alloc_returns_whole_pages_and_none_when_full() -> None:
    a = PageAllocator(num_pages=4, page_size=4, name="host")
    slots = a.alloc(8)
    assert slots is not None
    assert slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert a.available_tokens == 8
    assert a.alloc(12) is None
    assert a.available_tokens == 8, "a failed alloc takes nothing"


def test_double_free_is_detected_and_frees_nothing() -> None:
    a = PageAllocator(num_pages=4, page_size=2, name="host")
    slots = a.alloc(4)
    assert slots is not None
    a.free(slots)
    with pytest.raises(DoubleFree, match="Double-free detected"):
        a.free(slots)
    assert a.available_pages == 4


def test_double_alloc_is_detected() -> None:
    a = PageAllocator(num_pages=2, page_size=2, name="host")
    pages = a.alloc_pages(1)
    assert pages == [0]
    a._free.append(0)  # a corrupted free list: page 0 is free and in use at once
    a._free.rotate(1)
    with pytest.raises(DoubleAllocation, match="Double-alloc detected"):
        a.alloc_pages(1)


def test_alloc_of_partial_page_is_refused() -> None:
    a = PageAllocator(num_pages=2, page_size=4, name="device")
    with pytest.raises(InvariantViolation):
        a.alloc(3)


def test_slots_pages_round_trip() -> None:
    a = PageAllocator(num_pages=8, page_size=4, name="device")
    slots = a.pages_to_slots([5, 2])
    assert a.slots_to_pages(slots) == [5, 2]
    assert torch.equal(slots[:4], torch.arange(20, 24))
