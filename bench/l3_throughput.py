"""L3 throughput: the storage backends against raw I/O of the same bytes, in one run.

Section "backend bandwidth": pages from a real host pool (encoded once, encoding not timed) are
written and read through

* the ``file`` backend (checksummed envelope, temp file + atomic rename, skip-if-exists check)
  vs raw ``open().write()`` / ``open().read()`` of the same payloads, one file per page;
* the ``redis`` backend (envelope, pipelined SET NX / GET per batch) vs raw pipelined
  SET / GET of the same payloads on the same server;
* the ``mooncake`` backend (envelope, ``batch_is_exist`` then ``batch_put_from`` of the missing
  keys, ``batch_get_into``, all through its registered buffers) vs raw zero-copy
  ``batch_put_from`` / ``batch_get_into`` of the same payloads from and into one registered
  buffer that already holds them (upstream SGLang's path, the floor), on a throwaway local
  store (``mooncake_master`` and a segment holder); without the Mooncake client the Mooncake
  ratios are ``null``,

in batches of ``--batch`` pages. Each side keeps its best of ``--repeat`` rounds (fresh keys
per round, so writes are never skipped); the two sides alternate within a round so drift hits
both. Ratios are backend bandwidth / raw bandwidth (1.0 = no overhead). Redis runs on
``--redis-url`` or, by default, a throwaway local ``redis-server``; without one the Redis
ratios are ``null``.

Sections "TTFT" and "TTFT, Mooncake": time to first token of a multi-turn chat workload served
with L1/L2/L3 hits vs full recompute (the cache-disabled twin), on a model large enough that
prefill compute dominates (``--ttft-hidden`` x ``--ttft-layers``, float32). The runtime runs
with an L3 (a file store; in the second section a Mooncake store) and pools too small for the
working set. Before timing, one untimed pass of the same chats with 1-token replies stores every
chat's opening context in L3 (conversations seen before a restart); the timed pass generates
full replies, so a first turn finds its context in L3 (or in L1/L2 once an earlier request
brought it back) and each later turn, whose history holds a reply no tier has seen, hits about
90% of its prompt (printed as ``ttft_prefix_hit``, with the tokens each tier served). Requests
enter one at a time (the next once every earlier one has its first token), so TTFT measures
serving a request, not queueing behind others. TTFT is measured per request, from its arrival at
the scheduler to the step that appends its first output token, without touching the runtime: the
workload's ``poll`` is extended to pace and stamp arrivals and the engine's step callback stamps
first tokens. Cached and recompute passes alternate ``--ttft-repeat`` times (each cached pass on
a fresh copy of the warm L3: a copied directory, or a restarted Mooncake master warmed again,
untimed) and each request keeps its best TTFT, which damps noise from a shared machine. Outputs
of the two sides must be identical. The figure: mean TTFT cached / mean TTFT recompute (goal <=
0.2 at ~90% prefix hit).

Section "TTFT, host layouts": the same TTFT comparison with the host pool (L2) in each memory
layout (``layer_first``, ``page_first``, ``page_first_direct``) on a scattered pool: before each
pass the host allocator's free pages are handed back in a shuffled order, so every page a run
takes lies anywhere in the pool (an L2 after hours of eviction and reuse). Each layout warms its
own L3 (its own payload order); recompute passes are shared. Figures per layout
(``ttft_scattered_<layout>_ratio``, goal <= 0.2) and ``ttft_scattered_page_first_vs_layer_first``
(mean cached TTFT of page_first / of layer_first; below 1 is an improvement).

Each section returns a dict merged into the final JSON line, which is always the last line
printed; more sections append themselves to ``SECTIONS``.

Usage: python bench/l3_throughput.py [--pages N] [--batch B] [--repeat R] [--dir DIR]
                                     [--redis-url URL | --no-redis] [--no-mooncake]
                                     [--ttft-requests N] [--ttft-hidden H] [--ttft-layers L]
                                     [--ttft-prompt P] [--ttft-turn T] [--ttft-repeat R]
                                     [--ttft-device-tokens N] [--ttft-policy POLICY]
                                     [--no-ttft | --ttft-only] [--no-ttft-layouts]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hicache_runtime.config import RuntimeConfig, load_config
from hicache_runtime.engine.loop import Engine, EngineResult
from hicache_runtime.engine.rank import build_rank
from hicache_runtime.engine.workload import Workload
from hicache_runtime.kv.layouts import MEM_LAYOUTS
from hicache_runtime.kv.pools import HostKVPool, KVShape
from hicache_runtime.kv.request import Req
from hicache_runtime.l3.backend import StorageBackend
from hicache_runtime.l3.backends.file import FileBackend
from hicache_runtime.l3.backends.mooncake_master import LocalMooncakeStore
from hicache_runtime.l3.backends.redis_server import LocalRedisServer, redis_server_binary
from hicache_runtime.l3.keys import KeyScheme, chain_hashes
from hicache_runtime.l3.pages import PageCodec
from hicache_runtime.launch.run import compare_outputs

SCHEME = KeyScheme("_bench_0_1")


# --- inputs -----------------------------------------------------------------------------------


def make_pages(args: argparse.Namespace) -> list[bytes]:
    """``args.pages`` page payloads of a KV layout the size of a small real model's page."""
    shape = KVShape(args.layers, args.heads, args.head_dim, torch.bfloat16)
    pool = HostKVPool(shape, args.pages * args.page_size, args.page_size, pin=False)
    gen = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen).to(torch.bfloat16))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen).to(torch.bfloat16))
    slots = pool.alloc(args.pages * args.page_size)
    assert slots is not None
    return PageCodec.for_pool(pool).read_pages(pool, slots)


def round_keys(n: int, round_no: int) -> list[str]:
    """Fresh page hashes per round (so a set is a real write, never a skip)."""
    return chain_hashes(list(range(round_no * 1_000_003, round_no * 1_000_003 + n)), 1)


def batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- one side of a comparison -----------------------------------------------------------------


class Side:
    """Set and get of all pages one way (a backend, or raw I/O); keeps the best times."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.best_set = float("inf")
        self.best_get = float("inf")

    def run(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        self.best_set = min(self.best_set, timed(lambda: self.put(keys, pages, batch)))
        got: list[bytes | None] = []
        self.best_get = min(self.best_get, timed(lambda: got.extend(self.get(keys, batch))))
        if got != pages:
            raise AssertionError(f"{self.name}: pages read back differ from pages written")
        self.cleanup(keys)

    def put(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        raise NotImplementedError

    def get(self, keys: list[str], batch: int) -> list[bytes | None]:
        raise NotImplementedError

    def cleanup(self, keys: list[str]) -> None:
        raise NotImplementedError


class BackendSide(Side):
    def __init__(self, backend: StorageBackend) -> None:
        super().__init__(f"{backend.name} backend")
        self.backend = backend

    def put(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        for ks, ps in zip(batches(keys, batch), batches(pages, batch)):
            if not all(self.backend.batch_set(ks, ps)):
                raise AssertionError(f"{self.name}: a set failed")

    def get(self, keys: list[str], batch: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for ks in batches(keys, batch):
            out.extend(self.backend.batch_get(ks))
        return out

    def cleanup(self, keys: list[str]) -> None:
        self.backend.clear()


class RawFileSide(Side):
    """One plain file per page, written and read whole: the floor for the file backend."""

    def __init__(self, root: Path) -> None:
        super().__init__("raw file")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def put(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        for key, page in zip(keys, pages):
            with open(self.root / key, "wb") as fh:
                fh.write(page)

    def get(self, keys: list[str], batch: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            with open(self.root / key, "rb") as fh:
                out.append(fh.read())
        return out

    def cleanup(self, keys: list[str]) -> None:
        for key in keys:
            (self.root / key).unlink()


class RawRedisSide(Side):
    """Pipelined SET / GET of the same payloads, one pipeline per batch."""

    def __init__(self, url: str) -> None:
        import redis

        super().__init__("raw redis")
        self.client = redis.Redis.from_url(url)

    def put(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        for ks, ps in zip(batches(keys, batch), batches(pages, batch)):
            pipe = self.client.pipeline(transaction=False)
            for k, p in zip(ks, ps):
                pipe.set("raw:" + k, p)
            pipe.execute()

    def get(self, keys: list[str], batch: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        for ks in batches(keys, batch):
            pipe = self.client.pipeline(transaction=False)
            for k in ks:
                pipe.get("raw:" + k)
            out.extend(pipe.execute())
        return out

    def cleanup(self, keys: list[str]) -> None:
        self.client.delete(*["raw:" + k for k in keys])


class RawMooncakeSide(Side):
    """The same payloads through the client's own batched calls, one call per batch: ``bytes``
    in and out (``put_batch`` / ``get_batch``: the raw ``put`` / ``get`` the backend is held
    to), or with ``zero_copy`` ``batch_put_from`` / ``batch_get_into`` from and into registered
    buffers that hold the pages before timing starts (upstream SGLang's path on its host pool:
    no checksum, no copy, the floor); zero-copy reads come back as views of the read buffer,
    which is zeroed between rounds (untimed) so a view shows what was read."""

    def __init__(self, url: str, pages: list[bytes], *, zero_copy: bool) -> None:
        import ctypes

        from hicache_runtime.l3.backends import mooncake_client as mc

        super().__init__("raw mooncake" + (" zero-copy" if zero_copy else ""))
        self.zero_copy = zero_copy
        self.client = mc.open_client(mc.parse_url(url))
        self.sizes = [len(p) for p in pages]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(pages))]
        self.src, self.dst = bytearray(b"".join(pages)), bytearray(sum(self.sizes))
        self.addrs = [ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))
                      for b in (self.src, self.dst)]
        for addr in self.addrs if zero_copy else []:
            if self.client.register_buffer(addr, len(self.src)) != 0:
                raise RuntimeError("raw mooncake: register_buffer failed")

    def _slots(self, keys: list[str], base: int,
               batch: int) -> list[tuple[list[str], list[int], list[int]]]:
        return [(["raw:" + keys[i] for i in ii], [base + self.offsets[i] for i in ii],
                 [self.sizes[i] for i in ii]) for ii in batches(list(range(len(keys))), batch)]

    def put(self, keys: list[str], pages: list[bytes], batch: int) -> None:
        if not self.zero_copy:
            for ks, ps in zip(batches(keys, batch), batches(pages, batch)):
                if self.client.put_batch(["raw:" + k for k in ks], ps) != 0:
                    raise AssertionError("raw mooncake: a put failed")
            return
        for ks, ptrs, sizes in self._slots(keys, self.addrs[0], batch):
            if any(rc != 0 for rc in self.client.batch_put_from(ks, ptrs, sizes)):
                raise AssertionError("raw mooncake: a put failed")

    def get(self, keys: list[str], batch: int) -> list[bytes | None]:
        if not self.zero_copy:
            return [bytes(v) or None for ks in batches(keys, batch)
                    for v in self.client.get_batch(["raw:" + k for k in ks])]
        for ks, ptrs, sizes in self._slots(keys, self.addrs[1], batch):
            if any(n <= 0 for n in self.client.batch_get_into(ks, ptrs, sizes)):
                raise AssertionError("raw mooncake: a get failed")
        view = memoryview(self.dst)
        return [view[o : o + n] for o, n in zip(self.offsets, self.sizes)]  # type: ignore[misc]

    def cleanup(self, keys: list[str]) -> None:
        self.client.batch_remove(["raw:" + k for k in keys], True)
        if self.zero_copy:
            self.dst[:] = bytes(len(self.dst))

    def close(self) -> None:
        for addr in self.addrs if self.zero_copy else []:
            self.client.unregister_buffer(addr)
        self.client.close()


def compare(label: str, backend: Side, raw: Side, pages: list[bytes],
            args: argparse.Namespace) -> dict[str, float]:
    """Alternate the two sides for ``args.repeat`` rounds; print and return bandwidths."""
    for r in range(args.repeat):
        keys = round_keys(len(pages), r)
        first, second = (backend, raw) if r % 2 == 0 else (raw, backend)
        first.run(keys, pages, args.batch)
        second.run(keys, pages, args.batch)
    nbytes = sum(len(p) for p in pages)
    bw = {name: nbytes / t / 1e9 for name, t in (
        ("set", backend.best_set), ("get", backend.best_get),
        ("raw_set", raw.best_set), ("raw_get", raw.best_get))}
    for op in ("set", "get"):
        ratio = bw[op] / bw[f"raw_{op}"]
        print(f"{label:5s} {op}: backend {bw[op]:6.2f} GB/s   raw {bw[f'raw_{op}']:6.2f} GB/s   "
              f"ratio {ratio:.2f}")
    return {f"{label}_{op}_ratio": round(bw[op] / bw[f"raw_{op}"], 3) for op in ("set", "get")} \
        | {f"{label}_{k}_gb_s": round(v, 3) for k, v in bw.items()}


# --- sections ---------------------------------------------------------------------------------


def backend_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    """File and Redis backend page bandwidth vs raw I/O of the same bytes."""
    pages = make_pages(args)
    print(f"pages: {len(pages)} x {len(pages[0]) / 1024:.0f} KiB, batch {args.batch}, "
          f"best of {args.repeat}")
    out: dict[str, Any] = {"page_bytes": len(pages[0]), "pages": len(pages)}

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="l3-bench-"))
    try:
        backend = FileBackend(root / "backend", SCHEME)
        out |= compare("file", BackendSide(backend), RawFileSide(root / "raw"), pages, args)
        backend.close()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    out |= redis_bandwidth(pages, args)
    out |= mooncake_bandwidth(pages, args)
    return out


def mooncake_unavailable() -> str | None:
    from hicache_runtime.config import StorageConfig
    from hicache_runtime.l3.backends.mooncake import MooncakeBackend

    return MooncakeBackend.unavailable(StorageConfig(backend="mooncake"))


def mooncake_bandwidth(pages: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    from hicache_runtime.l3.backends.mooncake import MooncakeBackend

    nulls: dict[str, Any] = {"mooncake_set_ratio": None, "mooncake_get_ratio": None}
    missing = "--no-mooncake" if args.no_mooncake else mooncake_unavailable()
    if missing is not None:
        print(f"mooncake: skipped ({missing})")
        return nulls
    # A side holds one round's pages at a time (it removes them before the next side runs):
    # twice that leaves the master far from eviction (90% full), and small enough that the
    # untimed rounds below touch all of it.
    need_mib = 2 * sum(len(p) for p in pages) // (1 << 20) + 64
    with LocalMooncakeStore(segment_mib=need_mib) as store:
        backend = BackendSide(MooncakeBackend(store.url, SCHEME, max_payload_bytes=len(pages[0])))
        raws = [RawMooncakeSide(store.url, pages, zero_copy=z) for z in (False, True)]
        try:
            # Untimed: the holder's segment memory is committed on first write; touch it all.
            for warm_round in (998, 999):
                for side in (backend, *raws):
                    side.run(round_keys(len(pages), warm_round), pages, args.batch)
                    side.best_set = side.best_get = float("inf")
            out = compare("mooncake", backend, raws[0], pages, args)
            backend.best_set = backend.best_get = float("inf")
            zero = compare("mooncake_zero_copy", backend, raws[1], pages, args)
            return out | {k: v for k, v in zero.items() if "ratio" in k or "raw" in k}
        finally:
            backend.backend.close()
            for raw in raws:
                raw.close()


def redis_bandwidth(pages: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    from hicache_runtime.l3.backends.redis import RedisBackend

    nulls: dict[str, Any] = {"redis_set_ratio": None, "redis_get_ratio": None}
    if args.no_redis:
        print("redis: skipped (--no-redis)")
        return nulls
    server: LocalRedisServer | None = None
    url = args.redis_url
    if url is None:
        if redis_server_binary() is None:
            print("redis: skipped (no redis-server on PATH and no --redis-url)")
            return nulls
        server = LocalRedisServer().start()
        url = server.url
    try:
        backend = RedisBackend(url, SCHEME)
        raw = RawRedisSide(url)
        result = compare("redis", BackendSide(backend), raw, pages, args)
        backend.close()
        raw.client.close()
        return result
    finally:
        if server is not None:
            server.close()


# --- TTFT with L2/L3 hits vs full recompute -------------------------------------------------


def ttft_config(args: argparse.Namespace, l3_dir: Path | None) -> RuntimeConfig:
    """The cached side: a model where prefill compute dominates, multi-turn chats with long
    contexts, L1/L2 smaller than the working set, a file L3 at ``l3_dir``."""
    h = args.ttft_hidden
    return load_config({
        "model.hidden_size": h, "model.num_layers": args.ttft_layers,
        "model.num_heads": h // 64, "model.head_dim": 64, "model.ffn_size": 4 * h,
        "model.vocab_size": 512, "model.dtype": "float32",
        "cache.page_size": 16, "cache.device_tokens": args.ttft_device_tokens,
        "cache.host_tokens": 2 * args.ttft_device_tokens,
        "workload.kind": "multi_turn", "workload.requests": args.ttft_requests,
        # multi_turn gives each chat half of system_prompt_tokens as its opening context
        "workload.system_prompt_tokens": 2 * args.ttft_prompt,
        "workload.turn_tokens": args.ttft_turn, "workload.max_new_tokens": 8,
        "workload.arrival_gap_steps": 8,
        "scheduler.chunked_prefill_size": 512, "scheduler.max_prefill_tokens": 2048,
        "storage.backend": "file", "storage.path": l3_dir,
        "storage.prefetch_policy": args.ttft_policy, "storage.io_batch_pages": 32,
        "observability.watchdog_timeout_s": 600.0,
    })


@dataclass
class PacedWorkload(Workload):
    """The workload's request stream, released one request at a time: the next request enters
    the scheduler only once every earlier one has its first token. Records per-request arrival
    and first-token times (``time.perf_counter``).

    Why paced: the workload schedules arrivals in scheduler steps, and a step that waits on a
    prefetch lasts a fraction of a millisecond while a recompute step lasts hundreds, so
    step-based arrivals would reach the cached side in a burst the recompute side never sees,
    and queueing would dominate both. With one prefill in flight at a time, TTFT is the cost of
    serving that one request (plus at most the decode step it arrives during), on either side,
    however fast the machine is.

    Arrival: when a request is handed to the scheduler. First token: the end of the step whose
    results appended its first output token (``on_step`` is the engine's step callback, which
    runs right after ``process_result``). Observation only: the runtime is unchanged.
    """

    arrived: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    _held: list[Req] = field(default_factory=list)
    _no_token: dict[str, Req] = field(default_factory=dict)

    def poll(self, step: int, finished: dict[str, Req]) -> list[Req]:
        self._held.extend(super().poll(step, finished))
        if not self._held or self._no_token:
            return []
        req = self._held.pop(0)
        self.arrived[req.rid] = time.perf_counter()
        self._no_token[req.rid] = req
        return [req]

    def exhausted(self) -> bool:
        return super().exhausted() and not self._held

    def on_step(self, step: int, finished: int, total: int) -> None:
        now = time.perf_counter()
        for rid in [rid for rid, r in self._no_token.items() if r.output_ids or r.done]:
            if self._no_token.pop(rid).output_ids:
                self.first[rid] = now

    def ttft(self) -> dict[str, float]:
        """Seconds from arrival to first token, per request that produced one."""
        return {rid: t - self.arrived[rid] for rid, t in self.first.items()}


def timed_run(cfg: RuntimeConfig) -> tuple[EngineResult, dict[str, float]]:
    """One engine run of ``cfg``'s workload, paced; its result and per-request TTFT."""
    rt = build_rank(cfg)
    try:
        workload = PacedWorkload(cfg.workload, cfg.model.vocab_size, cfg.seed)
        result = Engine(rt, workload, on_step=workload.on_step).run()
        return result, workload.ttft()
    finally:
        rt.close()


def prefix_hit(result: EngineResult) -> float:
    """Fraction of prompt tokens served from a cache tier instead of being computed."""
    prompt = sum(len(r.input_ids) for r in result.reqs.values())
    return sum(result.cached_tokens().values()) / max(prompt, 1)


@dataclass
class TtftSide:
    """One side of the comparison: its passes' per-request TTFT and its last result."""

    runs: list[dict[str, float]] = field(default_factory=list)
    result: EngineResult | None = None

    def add(self, result: EngineResult, ttft: dict[str, float]) -> None:
        self.result = result
        self.runs.append(ttft)

    def best(self) -> dict[str, float]:
        """Per request, its lowest TTFT over the passes."""
        return {rid: min(run[rid] for run in self.runs) for rid in self.runs[0]}


def ttft_figures(name: str, ttft: dict[str, float]) -> dict[str, float]:
    values = list(ttft.values())
    return {f"ttft_{name}_mean_ms": round(statistics.mean(values) * 1e3, 1),
            f"ttft_{name}_p50_ms": round(statistics.median(values) * 1e3, 1)}


def ttft_section(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT of a multi-turn workload with L1/L2/L3 hits (file L3) vs full recompute."""
    if args.no_ttft:
        print("ttft: skipped (--no-ttft)")
        return {"ttft_ratio": None}
    root = Path(tempfile.mkdtemp(prefix="l3-ttft-"))
    try:
        cfg = ttft_config(args, root / "warm")
        # Untimed: warms torch, and stores every chat's opening context in L3.
        timed_run(warm_config(cfg))

        def fresh(r: int) -> RuntimeConfig:
            l3_copy = root / f"l3-{r}"
            shutil.rmtree(root / f"l3-{r - 1}", ignore_errors=True)
            shutil.copytree(root / "warm", l3_copy)  # each cached pass starts from the warm L3
            return cfg.with_overrides(**{"storage.path": l3_copy})

        return ttft_compare(args, "", cfg, fresh, "file L3")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ttft_mooncake_section(args: argparse.Namespace) -> dict[str, Any]:
    """The same with a Mooncake L3: prefixes served from a real store vs full recompute."""
    missing = "--no-ttft" if args.no_ttft else "--no-mooncake" if args.no_mooncake \
        else mooncake_unavailable()
    if missing is not None:
        print(f"ttft mooncake: skipped ({missing})")
        return {"ttft_mooncake_ratio": None}
    with LocalMooncakeStore(segment_mib=1024) as store:
        cfg = ttft_config(args, None).with_overrides(**{
            "storage.backend": "mooncake", "storage.url": store.url, "storage.path": None})

        def fresh(r: int) -> RuntimeConfig:
            store.restart_master()  # empty, as a copied directory starts from the warm one
            timed_run(warm_config(cfg))  # untimed (the first one also warms torch)
            return cfg

        return ttft_compare(args, "mooncake_", cfg, fresh, "Mooncake L3")


def warm_config(cfg: RuntimeConfig) -> RuntimeConfig:
    """The untimed pass: the same chats with 1-token replies store every chat's opening context
    in L3, so later turns of the timed passes extend beyond what L3 holds."""
    return cfg.with_overrides(**{"workload.max_new_tokens": 1})


def ttft_compare(args: argparse.Namespace, prefix: str, cfg: RuntimeConfig,
                 fresh: Callable[[int], RuntimeConfig], l3: str) -> dict[str, Any]:
    """Cached passes (``fresh(r)``: the config of pass ``r``, its L3 warm) and recompute passes,
    alternating; outputs must match; the figures under ``ttft_<prefix>``."""
    params = layer_params(cfg)
    print(f"ttft {prefix.rstrip('_') or 'file'}: model {args.ttft_hidden}x{args.ttft_layers} "
          f"({params / 1e6:.0f}M layer params, float32), {args.ttft_requests} multi-turn "
          f"requests, {args.ttft_prompt}-token contexts, {args.ttft_turn}-token turns, one "
          f"prefill at a time, L1 {args.ttft_device_tokens} / L2 {2 * args.ttft_device_tokens} "
          f"tokens, {l3}, {args.ttft_policy}; best of {args.ttft_repeat}")
    cached, ref = TtftSide(), TtftSide()
    for r in range(args.ttft_repeat):
        passes: list[tuple[TtftSide, Callable[..., RuntimeConfig]]] = [
            (cached, lambda r=r: fresh(r)), (ref, cfg.reference)]
        for side, side_cfg in passes if r % 2 == 0 else passes[::-1]:
            side.add(*timed_run(side_cfg()))
    assert cached.result is not None
    assert ref.result is not None
    if compare_outputs(cached.result.reqs, ref.result.reqs):
        raise AssertionError(f"ttft {l3}: cached outputs differ from the recompute outputs")
    return ttft_report(prefix, cached.best(), ref.best(), cached.result)


def ttft_report(prefix: str, cached: dict[str, float], ref: dict[str, float],
                result: EngineResult) -> dict[str, Any]:
    """Print and return the TTFT figures (ratios of means and of medians), keys
    ``ttft_<prefix>...``."""
    p = f"ttft_{prefix}"
    out: dict[str, Any] = {f"{p}requests": len(cached),
                           f"{p}prefix_hit": round(prefix_hit(result), 3),
                           f"{p}cached_tokens": result.cached_tokens()}
    out |= ttft_figures(f"{prefix}cached", cached) | ttft_figures(f"{prefix}recompute", ref)
    out[f"{p}ratio"] = round(out[f"{p}cached_mean_ms"] / out[f"{p}recompute_mean_ms"], 3)
    out[f"{p}p50_ratio"] = round(out[f"{p}cached_p50_ms"] / out[f"{p}recompute_p50_ms"], 3)
    tiers = ", ".join(f"{k} {v}" for k, v in out[f"{p}cached_tokens"].items())
    print(f"{p.rstrip('_')}: prefix hit {out[f'{p}prefix_hit']:.1%} (tokens from {tiers})")
    for side in ("cached", "recompute"):
        print(f"{p}{side:9s}: mean {out[f'{p}{side}_mean_ms']:7.1f} ms   "
              f"p50 {out[f'{p}{side}_p50_ms']:7.1f} ms")
    print(f"{p}ratio (cached / recompute): mean {out[f'{p}ratio']:.3f}   "
          f"p50 {out[f'{p}p50_ratio']:.3f}   (goal <= 0.2)")
    return out


def layer_params(cfg: RuntimeConfig) -> int:
    """Weights in the model's layers (Q, K, V, O projections and the gated MLP)."""
    m = cfg.model
    qkv = m.num_heads * m.head_dim
    return m.num_layers * (4 * m.hidden_size * qkv + 3 * m.hidden_size * m.ffn_size)


# --- TTFT per host memory layout, on a scattered L2 -----------------------------------------


def scattered_run(cfg: RuntimeConfig, seed: int) -> tuple[EngineResult, dict[str, float]]:
    """``timed_run`` on a scattered L2: the host allocator's free pages are first taken and
    handed back in a shuffled order, so the run's host pages lie anywhere in the pool."""
    rt = build_rank(cfg)
    try:
        if rt.host_pool is not None:
            allocator = rt.host_pool.allocator
            pages = allocator.alloc_pages(allocator.available_pages)
            assert pages is not None
            random.Random(seed).shuffle(pages)
            allocator.free_pages(pages)
        workload = PacedWorkload(cfg.workload, cfg.model.vocab_size, cfg.seed)
        result = Engine(rt, workload, on_step=workload.on_step).run()
        return result, workload.ttft()
    finally:
        rt.close()


def ttft_layouts_section(args: argparse.Namespace) -> dict[str, Any]:
    """TTFT with a scattered L2 in each host memory layout (file L3) vs full recompute."""
    if args.no_ttft or args.no_ttft_layouts:
        print("ttft layouts: skipped (--no-ttft)" if args.no_ttft else
              "ttft layouts: skipped (--no-ttft-layouts)")
        return {"ttft_scattered_page_first_vs_layer_first": None}
    root = Path(tempfile.mkdtemp(prefix="l3-ttft-layouts-"))
    try:
        cfgs = {layout: ttft_config(args, root / f"warm-{layout}").with_overrides(
            **{"cache.mem_layout": layout}) for layout in MEM_LAYOUTS}
        for cfg in cfgs.values():  # untimed: each layout stores the opening contexts in L3
            scattered_run(warm_config(cfg), seed=0)
        print(f"ttft layouts: model {args.ttft_hidden}x{args.ttft_layers}, "
              f"{args.ttft_requests} multi-turn requests, L1 {args.ttft_device_tokens} / L2 "
              f"{2 * args.ttft_device_tokens} tokens (host pages shuffled), file L3, "
              f"{args.ttft_policy}; best of {args.ttft_repeat}")
        cached = {layout: TtftSide() for layout in MEM_LAYOUTS}
        ref = TtftSide()
        for r in range(args.ttft_repeat):
            ref.add(*timed_run(cfgs["layer_first"].reference()))
            for layout, cfg in cfgs.items():
                l3_copy = root / f"l3-{layout}-{r}"
                shutil.copytree(root / f"warm-{layout}", l3_copy)
                fresh = cfg.with_overrides(**{"storage.path": l3_copy})
                cached[layout].add(*scattered_run(fresh, seed=r + 1))
                shutil.rmtree(l3_copy, ignore_errors=True)
        assert ref.result is not None
        out: dict[str, Any] = {}
        for layout, side in cached.items():
            assert side.result is not None
            if compare_outputs(side.result.reqs, ref.result.reqs):
                raise AssertionError(f"ttft {layout}: cached outputs differ from recompute")
            out |= ttft_report(f"scattered_{layout}_", side.best(), ref.best(), side.result)
        vs = (out["ttft_scattered_page_first_cached_mean_ms"]
              / out["ttft_scattered_layer_first_cached_mean_ms"])
        out["ttft_scattered_page_first_vs_layer_first"] = round(vs, 3)
        print(f"ttft scattered L2: page_first / layer_first cached mean TTFT {vs:.3f}")
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


SECTIONS: list[Callable[[argparse.Namespace], dict[str, Any]]] = [
    backend_bandwidth, ttft_section, ttft_mooncake_section, ttft_layouts_section]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256, help="pages per round")
    ap.add_argument("--batch", type=int, default=32, help="pages per backend call")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; best time kept")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--dir", default=None, help="directory for the file runs (default: a temp "
                                                "dir, removed after)")
    ap.add_argument("--redis-url", default=None,
                    help="an existing server (default: start a local redis-server)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--no-mooncake", action="store_true",
                    help="skip the Mooncake backend (bandwidth and TTFT)")
    ttft = ap.add_argument_group("TTFT (scale down with smaller values)")
    ttft.add_argument("--ttft-requests", type=int, default=12, help="multi-turn requests")
    ttft.add_argument("--ttft-hidden", type=int, default=768, help="model hidden size "
                      "(a multiple of 64; heads are 64 wide)")
    ttft.add_argument("--ttft-layers", type=int, default=4)
    ttft.add_argument("--ttft-prompt", type=int, default=1024,
                      help="tokens of each chat's opening context")
    ttft.add_argument("--ttft-turn", type=int, default=160, help="new tokens per user turn")
    ttft.add_argument("--ttft-device-tokens", type=int, default=4096,
                      help="L1 pool (L2 is twice this)")
    ttft.add_argument("--ttft-policy", default="wait_complete",
                      choices=["best_effort", "wait_complete", "timeout"])
    ttft.add_argument("--ttft-repeat", type=int, default=2, choices=range(1, 10),
                      metavar="R",
                      help="cached/recompute pass pairs; each request keeps its best TTFT")
    ttft.add_argument("--no-ttft-layouts", action="store_true",
                      help="skip the TTFT section per host memory layout")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--no-ttft", action="store_true", help="skip the TTFT section")
    only.add_argument("--ttft-only", action="store_true", help="run only the TTFT section")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result: dict[str, Any] = {"bench": "l3_throughput"}
    for section in SECTIONS:
        if args.ttft_only and section is backend_bandwidth:
            continue
        result |= section(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
