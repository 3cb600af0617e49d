"""Stateful property tests of the radix tree, the L1/L2 pools and the controller together.

Rules drive a real one-rank HiCache the way the scheduler does (match + load-back, lock,
allocate, write KV, insert, evict on both tiers, drain acks). Invariants: pool/tree integrity
(``free + evictable + protected + request_owned == capacity`` and the structural rules) after
every step; every matched slot holds exactly the KV written for that token prefix (so a bad
load-back, a bad backup or a slot reused under a live node is caught); and matches never claim
more than was inserted (a dict model of inserted sequences is the oracle).
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from hicache_runtime.kv.request import Req
from tests.helpers import CacheRig

_BASES = [[(b * 7 + i) % 50 + 1 for i in range(40)] for b in range(3)]


@st.composite
def sequences(draw: st.DrawFn) -> list[int]:
    base = _BASES[draw(st.integers(0, len(_BASES) - 1))]
    keep = draw(st.integers(0, len(base)))
    tail = draw(st.lists(st.integers(1, 50), min_size=1, max_size=24))
    return base[:keep] + tail


class CacheMachine(RuleBasedStateMachine):
    policy = "write_through"
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.rig = CacheRig.make(**{"cache.write_policy": self.policy,
                                    "cache.device_tokens": 96, "cache.host_tokens": 160,
                                    "cache.load_back_threshold": 0})
        self.inserted: list[list[int]] = []
        self.live: dict[str, Req] = {}
        self.n = 0

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.rig.finish(req)
        self.rig.drain()
        self.rig.cache.check_integrity(0, [])
        self.rig.close()

    def _rid(self) -> str:
        self.n += 1
        return f"r{self.n}"

    @rule(tokens=sequences())
    def run_request(self, tokens: list[int]) -> None:
        req = self.rig.admit(self._rid(), tokens)
        if req is not None:
            self._check_oracle(tokens, req.prefix_len)
            self.rig.finish(req)
            self.inserted.append(tokens)

    @rule(target=held, tokens=sequences())
    def hold_request(self, tokens: list[int]) -> str:
        req = self.rig.admit(self._rid(), tokens)
        if req is None:
            return ""
        self._check_oracle(tokens, req.prefix_len)
        self.live[req.rid] = req
        return req.rid

    @rule(rid=consumes(held))
    def release_request(self, rid: str) -> None:
        req = self.live.pop(rid, None)
        if req is not None:
            self.rig.finish(req)
            self.inserted.append(req.input_ids)

    @rule(n=st.integers(1, 64))
    def evict_device(self, n: int) -> None:
        self.rig.cache.evict(n)

    @rule(n=st.integers(1, 64))
    def evict_host(self, n: int) -> None:
        self.rig.cache.evict_host(n)

    @rule()
    def consume_completions(self) -> None:
        self.rig.cache.check_events()

    @invariant()
    def integrity(self) -> None:
        owned = sum(int(r.kv_slots.numel()) - r.prefix_len for r in self.live.values())
        self.rig.cache.check_integrity(owned, [r.last_node for r in self.live.values()])

    def _check_oracle(self, tokens: list[int], matched: int) -> None:
        best = max((_common(tokens, seq) for seq in self.inserted), default=0)
        ps = self.rig.cache.page_size
        assert matched <= best - best % ps, f"matched {matched} > inserted prefix {best}"


class SelectiveMachine(CacheMachine):
    policy = "write_through_selective"


class WriteBackMachine(CacheMachine):
    policy = "write_back"


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


TestWriteThrough = CacheMachine.TestCase
TestSelective = SelectiveMachine.TestCase
TestWriteBack = WriteBackMachine.TestCase
for case in (TestWriteThrough, TestSelective, TestWriteBack):
    case.settings = settings(case.settings, stateful_step_count=30)
del case  # a module-level TestCase name would be collected a second time
