"""Runtime configuration: one pydantic model, validated once at the boundary.

``load_config`` is the only way the CLI, campaigns and tests build a config from loose values; it
turns every validation failure into a :class:`ConfigError` that names the offending field, so the
CLI can print one line and exit 2. Inside the runtime, configs are frozen and trusted.
"""

from __future__ import annotations

import math
import os
import re
import resource
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from faults.spec import FaultSpec, check_topology
from hicache_runtime.config_files import short_repr
from hicache_runtime.contracts import l3_backends
from hicache_runtime.contracts.errors import ConfigError, validation_problem
from hicache_runtime.contracts.l3_backends import NO_BACKEND, StorageFormat
from hicache_runtime.contracts.legacy import LegacySwitch
from hicache_runtime.contracts.profiles import (
    DEFAULT_PROFILE,
    EVICTION_SETTINGS,
    PROFILES,
    EvictionPolicy,
    HitCounting,
    HostAlloc,
    Policies,
    TimeoutBudget,
    TimeoutClock,
)
from hicache_runtime.contracts.profiles import unknown as unknown_profile

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class WritePolicy(str, Enum):
    """When L1 pages are copied to L2 (SGLang ``--hicache-write-policy``)."""

    WRITE_THROUGH = "write_through"
    """Back up every node on insert."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up a node once its hit count reaches ``write_through_threshold``."""
    WRITE_BACK = "write_back"
    """Back up only when a node is evicted from L1."""


class PrefetchPolicy(str, Enum):
    """When a waiting request stops waiting for its L3 prefetch."""

    BEST_EFFORT = "best_effort"
    """Take whatever has arrived when the request is scheduled."""
    WAIT_COMPLETE = "wait_complete"
    """Wait until every hit page has arrived."""
    TIMEOUT = "timeout"
    """Wait until complete or until a length-dependent deadline (PP0 decides)."""


class ModelConfig(BaseModel):
    """The small decoder-only transformer. Weights are a pure function of ``weight_seed``."""

    model_config = _FROZEN
    vocab_size: int = Field(256, ge=2)
    num_layers: int = Field(4, ge=1)
    hidden_size: int = Field(64, ge=2)
    num_heads: int = Field(4, ge=1)
    head_dim: int = Field(16, ge=2)
    ffn_size: int = Field(128, ge=1)
    dtype: Literal["float64", "float32", "bfloat16", "float16"] = "float64"
    weight_seed: int = 1234
    rope_theta: float = Field(10000.0, gt=0)
    kv_replicated: bool = False
    """MLA-style: every TP rank keeps K/V of all heads (the latent cache is not sharded), so
    TP ranks hold identical pages and one writer can store them for all (``single_writer``)."""
    sidecars: tuple[Literal["all_pages", "trailing_pages"], ...] = ()
    """Hybrid-model sidecar pools next to K/V: ``all_pages`` (a KV-derived per-token indexer
    value attention adds to its scores; every prefix page needs it) and ``trailing_pages`` (a
    per-page recurrent state added to the attention output; a prefix needs its last page's)."""

    @model_validator(mode="after")
    def _even_head_dim(self) -> ModelConfig:
        if self.head_dim % 2:
            raise ValueError(_at("model.head_dim", "must be even (rotary embedding pairs)"))
        return self


class TopologyConfig(BaseModel):
    """Tensor-, pipeline- and data-parallel sizes; one rank process per (dp, pp, tp) triple."""

    model_config = _FROZEN
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    """DP groups: each a whole ``tp × pp`` grid with its own cache and its own process-group
    world, fed requests by the DP controller (``launch/dp_controller.py``). Fault selectors
    name ranks within a group, so a fault acts in every group."""
    dp_policy: Literal["round-robin", "shortest-queue"] = "round-robin"
    """How the DP controller picks a group for a request (``launch/dp_routing.py``)."""

    @property
    def world_size(self) -> int:
        """Ranks of one DP group: the size of its torch.distributed world."""
        return self.tp * self.pp

    @property
    def grid_size(self) -> int:
        """Rank processes of the whole run, every DP group's."""
        return self.dp * self.world_size


class CacheConfig(BaseModel):
    """L1 (device) and L2 (host) tiers and their policies."""

    model_config = _FROZEN
    enable_prefix_cache: bool = True
    """False gives the cache-disabled reference run: every request computes from scratch."""
    enable_hicache: bool = True
    """False keeps L1 only (a plain radix cache)."""
    page_size: int = Field(8, ge=1)
    device_tokens: int = Field(1024, gt=0)
    host_tokens: int | None = Field(None, gt=0)
    host_ratio: float = Field(2.0, gt=0)
    host_bytes: int | None = Field(None, gt=0)
    """Fixed host pool in bytes (``--hicache-size``); converted to tokens per stage."""
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = Field(2, ge=1)
    load_back_threshold: int = Field(10, ge=0)
    """Skip load-back of fewer tokens than this; recompute them instead."""
    host_alloc: HostAlloc | None = None
    """How write-backups and prefetches take host pages: ``per-rank`` (every release) or
    ``agreed`` (the vote of #31425, the ``proposed`` profile); None: the profile's."""
    hit_counting: HitCounting | None = None
    """Which inserts count as hits for ``write_through_selective``: ``skip-chunked`` (0.5.5 to
    0.5.20) or ``past-own-inserts`` (0.5.23); None: the profile's."""
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    """Which unlocked leaf L1 and L2 eviction take first (SGLang ``--radix-eviction-policy``;
    ``kv/evict_order.py``): lru, lfu, fifo, mru, filo, priority, slru or tlru, as far as the
    profile's release offers it. lru is every release's default (0.5.23
    ``cache_init_params.py`` ``eviction_policy`` L31)."""
    eviction_policy_config: dict[str, int] = {}
    """The policy's settings (SGLang ``--radix-eviction-policy-config``): ``slru``
    ``protected_threshold`` (2); ``tlru`` ``threshold`` and ``next_prompt_estimate`` (0, in
    tokens)."""
    mem_layout: Literal["layer_first", "page_first", "page_first_direct"] = "layer_first"
    """Host pool memory layout (SGLang ``--hicache-mem-layout``): ``layer_first`` (each layer
    of a page is its own block), ``page_first`` (a page holds every layer, token by token) or
    ``page_first_direct`` (a page holds every layer, layer by layer)."""

    @model_validator(mode="after")
    def _pages_divide(self) -> CacheConfig:
        if self.device_tokens % self.page_size:
            raise ValueError(
                _at("cache.device_tokens", f"{self.device_tokens} is not a multiple of "
                    f"page_size {self.page_size}")
            )
        if self.host_tokens is not None and self.host_tokens % self.page_size:
            raise ValueError(
                _at("cache.host_tokens", f"{self.host_tokens} is not a multiple of "
                    f"page_size {self.page_size}")
            )
        if self.device_tokens < 4 * self.page_size:
            raise ValueError(_at("cache.device_tokens", "must hold at least 4 pages"))
        known = EVICTION_SETTINGS[self.eviction_policy]
        for key, value in self.eviction_policy_config.items():
            if key not in known:
                offered = ", ".join(known) or "none"
                raise ValueError(_at("cache.eviction_policy_config",
                                     f"{short_repr(key)} is no setting of "
                                     f"{self.eviction_policy.value} (its settings: {offered})"))
            if value < 0:
                raise ValueError(_at("cache.eviction_policy_config",
                                     f"{key} must be 0 or more, not {value}"))
        return self


class StorageConfig(BaseModel):
    """L3 storage and the prefetch/backup pipeline."""

    model_config = _FROZEN
    backend: str = NO_BACKEND
    """``none``, a built-in backend (``file``, ``redis``), one registered at run time, or an
    installed plug-in's (entry point group ``hicache.l3_backends``);
    :mod:`hicache_runtime.contracts.l3_backends` holds the names."""
    path: Path | None = None
    url: str | None = None
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_threshold: int = Field(16, ge=1)
    """Tokens; prefetches shorter than this are revoked (clamped to at least one page)."""
    prefetch_timeout_base_s: float = Field(1.0, gt=0)
    prefetch_timeout_per_ki_token_s: float = Field(0.25, ge=0)
    io_batch_pages: int = Field(8, ge=1)
    """Pages per L3 batch (SGLang uses 128; small pools want small batches)."""
    prefetch_capacity_fraction: float = Field(0.5, gt=0, le=1)
    """Prefetches may reserve at most this fraction of the host pool (rate limit)."""
    single_writer: bool = False
    """MLA-style: only TP rank 0 writes to L3; the others skip but still ack."""
    reconnect_backoff_s: float = Field(0.5, gt=0)
    reconnect_backoff_max_s: float = Field(5.0, gt=0)
    required: bool = True
    """False: start even if the backend is unreachable (it fails soft and reconnects)."""
    format: StorageFormat = StorageFormat.ENVELOPE
    """How pages are stored: ``envelope`` (checksummed, self-describing; the default) or
    ``upstream``, the raw page bytes SGLang's file backend reads and writes
    (``l3/formats.py``; file backend, MHA-style pages without sidecar pools)."""
    model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9._/-]{1,200}$")
    """The ``<model>`` part of object keys (``/`` becomes ``-``): SGLang's served model name,
    to share a store with a deployment; None: an id of this run's model config."""
    prefetch_timeout_clock: TimeoutClock | None = None
    """When the ``timeout`` policy's clock starts: ``submission`` (0.5.5 to 0.5.20) or
    ``first-blocked-poll`` (0.5.23); None: the profile's."""
    prefetch_timeout_budget: TimeoutBudget | None = None
    """What its budget grows with: ``hit-tokens`` (0.5.5 to 0.5.20) or ``requested-tokens``
    (0.5.23); None: the profile's."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        # Names only: no backend module is imported to check one.
        problem = None if name == NO_BACKEND else l3_backends.problem(name)
        if problem:
            raise ValueError(_at("storage.backend", problem))
        return name

    @model_validator(mode="after")
    def _url_fits_backend(self) -> StorageConfig:
        # The backend's own check (``StorageBackend.url_problem``): importing a backend module
        # is cheap (client libraries load lazily), and no backend is named anywhere here.
        if self.backend != NO_BACKEND:
            problem = l3_backends.url_problem(self.backend, self.url)
            if problem:
                raise ValueError(_at("storage.url", problem))
        return self


class SchedulerConfig(BaseModel):
    """Batch formation limits."""

    model_config = _FROZEN
    max_running_requests: int = Field(16, ge=1)
    max_prefill_tokens: int = Field(1024, ge=1)
    chunked_prefill_size: int = Field(256, ge=1)
    schedule_policy: Literal["fcfs", "lpm"] = "fcfs"
    decode_reserve_ratio: float = Field(0.5, ge=0, le=1)
    """Fraction of running requests' remaining decode tokens kept free when admitting prefills."""
    enable_dynamic_chunking: bool = False
    """PP only: size continuation chunks of a long prefill for equal forward latency
    (``engine/chunking.py``) from a latency profile PP0 takes at start-up and shares."""
    dynamic_chunking_samples: int = Field(128, ge=2, le=1024)
    """Chunk sizes the start-up profile times (upstream's 128), from 1.25 x
    ``chunked_prefill_size`` down, each a page multiple: fewer when the pages leave fewer
    distinct sizes (40 at the defaults, under a second on one CPU core)."""


class WorkloadConfig(BaseModel):
    """The seeded request stream."""

    model_config = _FROZEN
    kind: Literal["multi_turn", "shared_prefix", "long_context", "mixed"] = "mixed"
    requests: int = Field(32, ge=1)
    max_new_tokens: int = Field(8, ge=1)
    system_prompt_tokens: int = Field(96, ge=0)
    turn_tokens: int = Field(24, ge=1)
    long_context_tokens: int = Field(384, ge=1)
    arrival_gap_steps: int = Field(1, ge=0)
    burst_sessions: int = Field(0, ge=0)
    """Bursty arrival: sessions start this many at once, a burst every ``arrival_gap_steps``
    (0: one independent request after the other, ``arrival_gap_steps`` apart)."""
    revisit_gap_steps: int = Field(40, ge=1)
    """Longest pause before a user comes back (next chat turn, next question on a document):
    long pauses let prefixes age out of L1 and L2, which is what L3 is for."""
    abort_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of requests a client aborts at a seeded step after arrival."""

    @field_validator("kind", mode="before")
    @classmethod
    def _dashed_kind(cls, kind: object) -> object:
        # ``--workload long-context`` reads as the command-line spelling of long_context.
        return kind.replace("-", "_") if isinstance(kind, str) else kind


class ObservabilityConfig(BaseModel):
    """Tracing, bundles, watchdogs."""

    model_config = _FROZEN
    tracing: bool = True
    """The always-on event ring. Off only for overhead benchmarks."""
    ring_size: int = Field(65536, ge=16)
    trace_path: Path | None = None
    bundle_dir: Path | None = None
    watchdog_timeout_s: float = Field(60.0, gt=0)
    protocol_timeout_s: float = Field(30.0, gt=0)
    consensus_check: bool = False
    pending_send_limit: int = Field(64, ge=0)
    """Fail a rank whose PP count-chain sends pile up past this many (0: never): the memory
    guard that turns an unbounded send leak (#28916) into a bundle instead of an OOM kill."""
    check_integrity_every: int = Field(0, ge=0)
    """Run the pool/tree integrity check every N steps (0: only when idle and at drain)."""
    sample_every: int = Field(0, ge=0)
    """Multi-rank runs: each rank appends a resource sample (pending sends, pages in use, RSS,
    L3 objects) to ``<run>/rank<N>.samples.jsonl`` every N steps (0: never; ``bench/soak.py``)."""


class RuntimeConfig(BaseModel):
    """Everything a run needs. Build it with :func:`load_config`."""

    model_config = _FROZEN
    seed: int = 0
    model: ModelConfig = ModelConfig()
    topology: TopologyConfig = TopologyConfig()
    cache: CacheConfig = CacheConfig()
    storage: StorageConfig = StorageConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    workload: WorkloadConfig = WorkloadConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    profile: str = DEFAULT_PROFILE
    """The release this run stands for (``contracts/profiles.py``): its switches are added to
    ``legacy``, and its host allocation is used unless ``cache.host_alloc`` is set."""
    legacy: frozenset[LegacySwitch] = frozenset()
    """Every legacy switch on: the profile's and any asked for besides."""
    faults: tuple[FaultSpec, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _apply_profile(cls, data: Any) -> Any:
        """Add the profile's switches to ``legacy`` (idempotent: a dumped config reloads to
        itself). A profile named in :meth:`with_overrides` adds its switches to those already
        on; it removes none."""
        if not isinstance(data, dict):
            return data
        name = data.get("profile", DEFAULT_PROFILE)
        problem = unknown_profile(name)
        if problem is not None:
            raise ValueError(_at("profile", problem))
        chosen = PROFILES[name]
        data = dict(data)
        asked = data.get("legacy") or ()
        if chosen.switches and isinstance(asked, (list, tuple, set, frozenset)):
            data["legacy"] = [*asked, *(s.value for s in chosen.switches)]
        return data

    @property
    def host_alloc(self) -> HostAlloc:
        """How host pages are taken (the profile's unless set)."""
        return self.cache.host_alloc or PROFILES[self.profile].host_alloc

    @property
    def policies(self) -> Policies:
        """The release policies this run follows: the profile's, each unless set."""
        chosen = PROFILES[self.profile].policies
        return Policies(self.storage.prefetch_timeout_clock or chosen.timeout_clock,
                        self.storage.prefetch_timeout_budget or chosen.timeout_budget,
                        self.cache.hit_counting or chosen.hit_counting,
                        chosen.eviction_policies)

    @model_validator(mode="after")
    def _cross_checks(self) -> RuntimeConfig:
        m, t, s, c = self.model, self.topology, self.scheduler, self.cache
        if m.num_heads % t.tp:
            raise ValueError(_at("topology.tp", f"{t.tp} does not divide num_heads {m.num_heads}"))
        if m.ffn_size % t.tp:
            raise ValueError(_at("topology.tp", f"{t.tp} does not divide ffn_size {m.ffn_size}"))
        if m.num_layers < t.pp:
            raise ValueError(_at("topology.pp", f"{t.pp} stages but only {m.num_layers} layers"))
        if s.chunked_prefill_size % c.page_size:
            raise ValueError(
                _at("scheduler.chunked_prefill_size", f"{s.chunked_prefill_size} is not a "
                    f"multiple of page_size {c.page_size}")
            )
        if s.enable_dynamic_chunking and t.pp < 2:
            raise ValueError(_at("scheduler.enable_dynamic_chunking", "needs pipeline "
                                 "parallelism (pp > 1): chunk sizes are sized to even out "
                                 "the stages"))
        if self.storage.backend != NO_BACKEND:
            problem = l3_backends.load(self.storage.backend).format_problem(
                self.storage.format, c.mem_layout, PROFILES[self.profile].release, t.pp)
            if problem:
                raise ValueError(_at("storage.format", problem))
        if self.storage.format is StorageFormat.UPSTREAM and (m.sidecars or m.kv_replicated):
            raise ValueError(_at("storage.format", "upstream pages are MHA pages without "
                                 "sidecar pools (upstream's MLA page is one latent row per "
                                 "token, its sidecars other objects)"))
        offered = PROFILES[self.profile].policies.eviction_policies
        if c.eviction_policy not in offered:
            names = ", ".join(e.value for e in EvictionPolicy if e in offered)
            raise ValueError(_at("cache.eviction_policy", f"{c.eviction_policy.value} is not in "
                                 f"profile {self.profile} (it offers {names})"))
        if self.storage.single_writer and t.tp > 1 and not m.kv_replicated:
            raise ValueError(_at("storage.single_writer", "needs model.kv_replicated with tp > 1 "
                                 "(head-sharded pages differ per TP rank)"))
        if self.storage.backend != "none" and not c.enable_hicache:
            raise ValueError(_at("storage.backend", "L3 needs the host tier (enable_hicache)"))
        # A selector naming a rank the run does not have would never fire: the run would look
        # healthy while testing nothing.
        problem = check_topology(self.faults, t.tp, t.pp)
        if problem:
            raise ValueError(_at("faults", problem))
        return self

    def with_overrides(self, **changes: Any) -> RuntimeConfig:
        """A copy with dotted-path overrides, validated (``{"cache.page_size": 16}``)."""
        data = self.model_dump(mode="python")
        for dotted, value in changes.items():
            _set_dotted(data, dotted, value)
        return load_config(data)

    def reference(self) -> RuntimeConfig:
        """The cache-disabled twin: same model, TP × PP topology, workload and seed; no
        faults. One DP group: which group serves a request must not change its tokens, so the
        run of every request in one group is the reference for any ``dp``."""
        return self.with_overrides(
            **{"cache.enable_prefix_cache": False, "cache.eviction_policy": "lru",
               "cache.eviction_policy_config": {}, "storage.backend": "none", "faults": (),
               "legacy": frozenset(), "profile": "proposed", "observability.trace_path": None,
               "topology.dp": 1, "topology.dp_policy": "round-robin"}
        )


# --- loading --------------------------------------------------------------------------------

_AT_RE = re.compile(r"^@([\w.]+): (.*)$", re.S)


LOCATION_KEYS: frozenset[str] = frozenset({
    "observability.trace_path", "observability.bundle_dir", "storage.path", "storage.url"})
"""The config keys that name a place: a file or directory the run writes, a server it
contacts. An untrusted config source (a campaign spec, a bundle being replayed) may not set
them; only the command line does (``docs/threat-model.md``)."""


def location_keys(data: dict[str, Any]) -> list[str]:
    """The :data:`LOCATION_KEYS` that ``data`` sets (dotted keys, nested sections, or both)."""
    merged: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(key, str):
            _set_dotted(merged, key, value)
    found = []
    for dotted in sorted(LOCATION_KEYS):
        section, _, name = dotted.partition(".")
        node = merged.get(section)
        if isinstance(node, dict) and node.get(name) is not None:
            found.append(dotted)
    return found


MAX_PROBLEMS = 8
"""The most problems one configuration error lists (a file may hold thousands)."""


def load_config(data: dict[str, Any] | None = None, *, names: Mapping[str, str] | None = None,
                **top: Any) -> RuntimeConfig:
    """Validate loose values into a :class:`RuntimeConfig`.

    ``data`` may nest sections (``{"cache": {"page_size": 16}}``) or use dotted keys
    (``{"cache.page_size": 16}``). Raises :class:`ConfigError` naming every bad field found
    (up to :data:`MAX_PROBLEMS`), each as ``names`` calls it (the flag the user typed) or by
    its dotted key.
    """
    merged: dict[str, Any] = {}
    for key, value in {**(data or {}), **top}.items():
        _set_dotted(merged, key, value)
    try:
        return RuntimeConfig.model_validate(merged)
    except ValidationError as exc:
        raise _config_error(exc, names or {}) from None


def _config_error(exc: ValidationError, names: Mapping[str, str]) -> ConfigError:
    problems = [_problem(err) for err in exc.errors()[:MAX_PROBLEMS]]
    (field, msg), rest = problems[0], problems[1:]
    more = "".join(f"; {names.get(f, f)}: {m}" for f, m in rest)
    if exc.error_count() > MAX_PROBLEMS:
        more += f"; and {exc.error_count() - MAX_PROBLEMS} more"
    return ConfigError(field, msg + more, shown=names.get(field))


def _problem(err: Any) -> tuple[str, str]:
    """One validation error as (the field's dotted key, what is wrong with it)."""
    field, msg = validation_problem(err)
    m = _AT_RE.match(msg)
    if m:
        field, msg = m.group(1), m.group(2)
    if "input" in err and err["type"] not in ("value_error", "assertion_error"):
        # The input may be huge (a file's value, aliases expanded): quote a bounded repr.
        msg = f"{msg} (got {short_repr(err['input'])})"
    return _short_field(field) or "config", msg


def _short_field(field: str) -> str:
    """A field path as named in an error: keys come from files, so bound and flatten them."""
    field = " ".join(field.split())
    return field if len(field) <= 80 else field[:77] + "..."


# --- what one run may ask of this machine --------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """Upper bounds on what a config may ask of this machine: rank processes, and the largest
    value of each listed field. ``who`` says whose bounds they are in an error (a run, a
    replay). Checked by :func:`check_limits`."""

    who: str
    ranks: int
    values: Mapping[str, int | float]


#: A run's bounds: far above what a toy-sized runtime is for, small enough that a typo (an
#: extra dozen digits) is an error, not hours of work and all of memory.
RUN_LIMITS = Limits("a run", 64, {
    "workload.requests": 100_000,
    "workload.max_new_tokens": 1 << 16,
    "workload.system_prompt_tokens": 1 << 20,
    "workload.turn_tokens": 1 << 20,
    "workload.long_context_tokens": 1 << 20,
    "scheduler.max_running_requests": 1 << 20,
    "observability.ring_size": 1 << 24,
})

_ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_MEMORY_HEADROOM = 0.8
"""Pools and weights may take at most this fraction of the memory available."""


@dataclass(frozen=True)
class MemoryNeed:
    """What the KV pools and weights of every rank of a run allocate, in bytes."""

    device_pools: int
    host_pools: int
    weights: int

    @property
    def total(self) -> int:
        return self.device_pools + self.host_pools + self.weights

    def describe(self, *, device: bool = True) -> str:
        parts = ([f"device pools {_gib(self.device_pools)}"] if device else []) + [
            f"host pools {_gib(self.host_pools)}", f"weights {_gib(self.weights)}"]
        return ", ".join(parts)


def memory_need(cfg: RuntimeConfig) -> MemoryNeed:
    """Bytes the run's pools and weights take over all its ranks (the largest stage and TP
    shard times the number of ranks: an upper bound, computed without allocating)."""
    m, t, c = cfg.model, cfg.topology, cfg.cache
    elem = _ELEMENT_BYTES[m.dtype]
    layers = math.ceil(m.num_layers / t.pp)
    heads = m.num_heads if m.kv_replicated else math.ceil(m.num_heads / t.tp)
    sidecar = sum(heads if name == "all_pages" else heads * m.head_dim for name in m.sidecars)
    per_token = layers * (2 * heads * m.head_dim + sidecar) * elem
    if c.host_tokens is not None:
        host = c.host_tokens
    elif c.host_bytes is not None:
        host = c.host_bytes // max(per_token, 1)
    else:
        host = int(min(c.device_tokens * c.host_ratio, float(1 << 62)))
    host = host if c.enable_hicache and c.enable_prefix_cache else 0
    h, d = m.hidden_size, m.num_heads * m.head_dim
    weights = (2 * m.vocab_size * h + layers * (4 * h * d + 3 * h * m.ffn_size)) * elem
    n = t.grid_size
    return MemoryNeed(device_pools=n * c.device_tokens * per_token,
                      host_pools=n * host * per_token, weights=n * weights)


def check_limits(cfg: RuntimeConfig, limits: Limits, field: str | None = None) -> None:
    """Raise :class:`ConfigError` at the first bound of ``limits`` the config passes (named
    by its field, or all under ``field``)."""
    t = cfg.topology
    if t.grid_size > limits.ranks:
        raise ConfigError(field or "topology",
                          f"tp={t.tp} pp={t.pp} dp={t.dp} is {t.grid_size} rank processes; "
                          f"{limits.who} starts at most {limits.ranks}")
    data = cfg.model_dump(mode="python")
    for dotted, cap in limits.values.items():
        section, _, name = dotted.partition(".")
        value = data[section][name]
        if value is not None and value > cap:
            raise ConfigError(field or dotted, f"{dotted} is {short_repr(value)}; "
                                               f"{limits.who} allows at most {cap}")


def check_run_limits(cfg: RuntimeConfig, *, memory: bool = True, accelerator: bool = False,
                     device_free: int | None = None) -> None:
    """Refuse a run this machine cannot hold, before anything is allocated or started.

    ``memory``: also compare what the pools and weights need with this machine's memory
    (False when the ranks run elsewhere). ``accelerator``: the device pools live on an
    accelerator, not in host memory; ``device_free`` is its free memory when known (the
    caller knows; this module does not import torch). Raises :class:`ConfigError` naming the
    field.
    """
    check_limits(cfg, RUN_LIMITS)
    if not memory:
        return
    need = memory_need(cfg)
    on_host = need.host_pools + need.weights + (0 if accelerator else need.device_pools)
    host_free = host_memory_available()
    if host_free is not None and on_host > host_free * _MEMORY_HEADROOM:
        raise ConfigError(_costliest(cfg, need, accelerator),
                          f"the run needs {_gib(on_host)} of memory "
                          f"({need.describe(device=not accelerator)}); this machine has "
                          f"{_gib(host_free)} available",
                          hint="use smaller --device-tokens / --host-tokens")
    if device_free is not None and need.device_pools > device_free * _MEMORY_HEADROOM:
        raise ConfigError("cache.device_tokens",
                          f"the device pools need {_gib(need.device_pools)}; the accelerator "
                          f"has {_gib(device_free)} free", hint="use smaller --device-tokens")


def _costliest(cfg: RuntimeConfig, need: MemoryNeed, accelerator: bool) -> str:
    """The field to name: the one behind the largest share (a host pool sized from the device
    pool, by ``host_ratio``, is the device pool's)."""
    shares = {"model": need.weights, "cache.device_tokens": 0 if accelerator else need.device_pools}
    host_field = "cache.host_tokens" if cfg.cache.host_tokens is not None else (
        "cache.host_bytes" if cfg.cache.host_bytes is not None else "cache.device_tokens")
    shares[host_field] = shares.get(host_field, 0) + need.host_pools
    return max(shares, key=lambda k: shares[k])


def host_memory_available() -> int | None:
    """Bytes this process could still allocate: the kernel's MemAvailable, lowered to what
    an address-space limit (``RLIMIT_AS``) leaves; None when neither is known."""
    limits: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(max(soft - _address_space_used(), 0))
    return min(limits) if limits else None


def _address_space_used() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``1.5 GiB``)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB")
    value, i = float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.1f} {units[i]}" if i else f"{n} B"


def _at(field: str, message: str) -> str:
    """Encode a cross-field error so ``load_config`` can name the field."""
    return f"@{field}: {message}"


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value
