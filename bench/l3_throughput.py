"""L3 throughput: the storage backends against raw I/O of the same bytes, in one run.

Section "backend bandwidth": pages from a real host pool (encoded once, encoding not timed) are
written and read through

* the ``file`` backend (checksummed envelope, temp file + atomic rename, skip-if-exists check)
  vs raw ``open().write()`` / ``open().read()`` of the same payloads, one file per page;
* the ``redis`` backend (envelope, pipelined SET NX / GET per batch) vs raw pipelined
  SET / GET of the same payloads on the same server,

in batches of ``--batch`` pages. Each side keeps its best of ``--repeat`` rounds (fresh keys
per round, so writes are never skipped); the two sides alternate within a round so drift hits
both. Ratios are backend bandwidth / raw bandwidth (1.0 = no overhead). Redis runs on
``--redis-url`` or, by default, a throwaway local ``redis-server``; without one the Redis
ratios are ``null``.

More sections (TTFT with L2/L3 hits vs full recompute) append themselves to ``SECTIONS``; each
returns a dict merged into the final JSON line, which is always the last line printed.

Usage: python bench/l3_throughput.py [--pages N] [--batch B] [--repeat R] [--dir DIR]
                                     [--redis-url URL | --no-redis]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache_runtime.pools import HostKVPool, KVShape
from hicache_runtime.storage.base import StorageBackend
from hicache_runtime.storage.file import FileBackend
from hicache_runtime.storage.keys import KeyScheme, chain_hashes
from hicache_runtime.storage.pages import PageCodec
from hicache_runtime.storage.redis_server import LocalRedisServer, redis_server_binary

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
    return out


def redis_bandwidth(pages: list[bytes], args: argparse.Namespace) -> dict[str, Any]:
    from hicache_runtime.storage.redis_backend import RedisBackend

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


SECTIONS: list[Callable[[argparse.Namespace], dict[str, Any]]] = [backend_bandwidth]


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
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result: dict[str, Any] = {"bench": "l3_throughput"}
    for section in SECTIONS:
        result |= section(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
