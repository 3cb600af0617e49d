"""The tree records its own splits (the cache records matches, inserts and evictions)."""

from __future__ import annotations

from typing import Any

import torch

from hicache_runtime.contracts.events import Ev
from hicache_runtime.kv.radix_tree import RadixTree


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, /, **attrs: Any) -> None:
        self.events.append((kind, attrs))

    def emit_durable(self, kind: str, /, **attrs: Any) -> None:
        self.emit(kind, **attrs)


def test_a_split_is_an_event_naming_both_nodes_and_the_cut() -> None:
    sink = Recorder()
    tree = RadixTree(page_size=4, events=sink)
    tree.insert([1] * 8, torch.arange(8))
    assert sink.events == []  # no split yet
    tree.insert([1] * 4 + [2] * 4, torch.arange(8, 16))  # diverges inside the first node
    (kind, attrs), = sink.events
    assert kind == Ev.SPLIT
    assert attrs["at"] == 4
    upper = tree.root.children[tree._child_key([1] * 4)]
    assert attrs["upper"] == upper.id
    assert attrs["node"] in {c.id for c in upper.children.values()}
    tree.check_structure()
