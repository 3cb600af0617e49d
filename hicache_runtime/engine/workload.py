"""Seeded request streams: multi-turn chats, shared system prompts, long contexts.

A workload is closed-loop: independent requests arrive on a seeded schedule, and a chat's next
turn arrives a few steps after the previous turn finished, its prompt being the whole history
(previous prompt + reply + a new user message). That is what makes prefixes recur and exercises
every tier. The same config and seed always yield the same stream, whatever the cache does,
as long as outputs are the same.

The step loop reads its requests through :class:`Intake`: a run of one DP group polls its
:class:`Workload` itself; with several DP groups the DP controller owns the workload and each
group's entry rank polls the controller's feed instead (``launch/dp_intake.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from hicache_runtime.config import WorkloadConfig
from hicache_runtime.kv.request import Req

#: Token 0 is never generated as input, so a zeroed (corrupt) page shows up in attention.
_FIRST_TOKEN = 1


class Intake(Protocol):
    """Where a rank's step loop takes its new requests and client aborts from (polled once per
    step by the rank that reads the request stream)."""

    @property
    def total(self) -> int:
        """Requests the whole stream will have (progress reports)."""
        ...

    def poll(self, step: int, finished: dict[str, Req]) -> list[Req]:
        """Requests arriving at ``step``; ``finished`` maps rid -> finished request."""
        ...

    def aborts(self, step: int) -> list[str]:
        """Client aborts due at ``step``."""
        ...

    def exhausted(self) -> bool:
        """True once no request will arrive any more."""
        ...


@dataclass
class _Plan:
    """One request to issue: its own new tokens, and the request whose history it extends."""

    rid: str
    new_tokens: list[int]
    prefix_tokens: list[int]
    follows: str | None
    arrival: int | None
    """Arrival step for independent requests; None for follow-ups (scheduled on finish)."""
    gap: int
    abort_after: int | None = None


@dataclass
class Workload:
    """The request stream of a run. ``poll`` is called once per scheduler step."""

    cfg: WorkloadConfig
    vocab_size: int
    seed: int
    client_aborts: bool = True
    """False: do not issue the seeded client aborts (a reference run replays the judged run's
    aborts instead, through ``caps``)."""
    caps: dict[str, int] = field(default_factory=dict)
    """Reference runs: requests the judged run's clients aborted, and how many tokens they had
    by then. Such a request is issued with that many tokens to generate (or aborted at
    arrival when it had none), so every prompt built on it stays identical."""
    plans: dict[str, _Plan] = field(default_factory=dict)
    _pending: list[_Plan] = field(default_factory=list)
    _due: dict[str, int] = field(default_factory=dict)
    _issued: set[str] = field(default_factory=set)
    _aborts: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(f"workload/{self.seed}")
        for plan in _build(self.cfg, self.vocab_size, rng):
            self.plans[plan.rid] = plan
            self._pending.append(plan)
            if plan.arrival is not None:
                self._due[plan.rid] = plan.arrival

    @property
    def total(self) -> int:
        return len(self.plans)

    def poll(self, step: int, finished: dict[str, Req]) -> list[Req]:
        """Requests arriving at ``step``. ``finished`` maps rid -> finished request."""
        for plan in self._pending:
            if plan.rid not in self._due and plan.follows in finished:
                prev = finished[plan.follows]
                self._due[plan.rid] = max(step, (prev.finish_step or step) + plan.gap)
        out: list[Req] = []
        for plan in list(self._pending):
            due = self._due.get(plan.rid)
            if due is None or due > step:
                continue
            history: list[int] = []
            if plan.follows is not None:
                prev = finished[plan.follows]
                history = prev.input_ids + prev.output_ids
            cap = self.caps.get(plan.rid)
            req = Req(rid=plan.rid, input_ids=plan.prefix_tokens + history + plan.new_tokens,
                      max_new_tokens=self.cfg.max_new_tokens if cap is None
                      else max(1, min(cap, self.cfg.max_new_tokens)), arrival_step=step)
            out.append(req)
            if cap == 0:
                self._aborts.setdefault(step, []).append(plan.rid)
            self._pending.remove(plan)
            self._issued.add(plan.rid)
            if plan.abort_after is not None and self.client_aborts:
                self._aborts.setdefault(step + plan.abort_after, []).append(plan.rid)
        return out

    def aborts(self, step: int) -> list[str]:
        """Client aborts due at ``step``."""
        return self._aborts.pop(step, [])

    def exhausted(self) -> bool:
        """True when every planned request has been issued."""
        return not self._pending


#: Distinct system prompts shared by sessions across the whole run (a handful of "apps"): the
#: long-range reuse that makes a prompt come back after it aged out of L1 and L2.
_SYSTEM_PROMPTS = 3


def _build(cfg: WorkloadConfig, vocab: int, rng: random.Random) -> list[_Plan]:
    kinds = ["multi_turn", "shared_prefix", "long_context"] if cfg.kind == "mixed" \
        else [cfg.kind]
    plans: list[_Plan] = []
    arrival = 0
    session = 0
    systems = [_tokens(rng, vocab, cfg.system_prompt_tokens) for _ in range(_SYSTEM_PROMPTS)]
    while len(plans) < cfg.requests:
        kind = kinds[session % len(kinds)]
        made = _SESSIONS[kind](cfg, vocab, rng, session, arrival, cfg.requests - len(plans),
                               systems)
        plans.extend(made)
        session += 1
        if cfg.burst_sessions:
            arrival = session // cfg.burst_sessions * cfg.arrival_gap_steps
        else:
            arrival += cfg.arrival_gap_steps * sum(1 for p in made if p.arrival is not None)
    for plan in plans:
        if cfg.abort_fraction and rng.random() < cfg.abort_fraction:
            plan.abort_after = rng.randint(0, 6)
    return plans


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(_FIRST_TOKEN, vocab) for _ in range(n)]


def _multi_turn(cfg: WorkloadConfig, vocab: int, rng: random.Random, s: int, arrival: int,
                budget: int, systems: list[list[int]]) -> list[_Plan]:
    turns = min(budget, rng.randint(2, 4))
    system = rng.choice(systems)[: cfg.system_prompt_tokens // 2]
    plans, prev = [], None
    for t in range(turns):
        rid = f"chat{s}-t{t}"
        plans.append(_Plan(rid, _tokens(rng, vocab, cfg.turn_tokens), system if t == 0 else [],
                           prev, arrival if t == 0 else None, gap=_think_time(cfg, rng)))
        prev = rid
    return plans


def _shared_prefix(cfg: WorkloadConfig, vocab: int, rng: random.Random, s: int, arrival: int,
                   budget: int, systems: list[list[int]]) -> list[_Plan]:
    system = rng.choice(systems)
    n = min(budget, rng.randint(3, 5))
    return [_Plan(f"sys{s}-q{i}", _tokens(rng, vocab, cfg.turn_tokens), system, None,
                  arrival + i * cfg.arrival_gap_steps + rng.randint(0, 2), 0) for i in range(n)]


def _long_context(cfg: WorkloadConfig, vocab: int, rng: random.Random, s: int, arrival: int,
                  budget: int, systems: list[list[int]]) -> list[_Plan]:
    doc = _tokens(rng, vocab, cfg.long_context_tokens)
    n = min(budget, rng.randint(2, 3))
    # Questions about one document arrive spread out, so its pages age through the tiers.
    plans, at = [], arrival
    for i in range(n):
        plans.append(_Plan(f"doc{s}-q{i}", _tokens(rng, vocab, cfg.turn_tokens // 2), doc, None,
                           at, 0))
        at += _think_time(cfg, rng) + 3
    return plans


def _think_time(cfg: WorkloadConfig, rng: random.Random) -> int:
    """Steps before a user comes back: usually soon, sometimes after a long pause."""
    if rng.random() < 0.6:
        return rng.randint(1, 3)
    return rng.randint(max(1, cfg.revisit_gap_steps // 2), cfg.revisit_gap_steps)


_SESSIONS = {"multi_turn": _multi_turn, "shared_prefix": _shared_prefix,
             "long_context": _long_context}
