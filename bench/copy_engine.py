"""L2<->L1 page copy bandwidth of the copy engine vs a plain torch copy of the same bytes.

The engine copies K and V of every layer for a set of pages between the device pool and the
host pool (here both in host memory: this machine has no GPU), completing an event per job.
The baseline is ``dst.copy_(src)`` of one contiguous tensor holding the same number of bytes,
which is the best a copy can do. Two page mappings are measured: pages allocated in runs (what
the allocator hands out most of the time) and a shuffled mapping (a fragmented pool).
Goal: ratio >= 0.70 (in one run).

Usage: python bench/copy_engine.py [--pages N] [--repeat R]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch

from hicache_runtime.kv.copy_engine import CpuCopyEngine, LayerDoneCounter
from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool, KVShape

PAGE = 16


def bandwidth(fn: Callable[[], object], nbytes: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = KVShape(num_layers=8, num_heads=8, head_dim=64, dtype=torch.float16)
    n_tok = args.pages * PAGE
    device = DeviceKVPool(shape, 2 * n_tok, PAGE, torch.device("cpu"))
    host = HostKVPool(shape, 2 * n_tok, PAGE, pin=False)
    device.k.normal_()
    device.v.normal_()
    engine = CpuCopyEngine(PAGE)
    counter = LayerDoneCounter(shape.num_layers)
    nbytes = n_tok * shape.bytes_per_token
    src_flat = torch.empty(nbytes // 2, dtype=torch.float16)
    dst_flat = torch.empty_like(src_flat)
    plain = bandwidth(lambda: dst_flat.copy_(src_flat), nbytes, args.repeat)
    print(f"plain torch copy: {plain:.2f} GB/s ({nbytes / 1e6:.1f} MB)")
    results = {}
    rng = random.Random(0)
    for layout in ("runs", "shuffled"):
        dev_pages = list(range(2 * args.pages))
        host_pages = list(range(2 * args.pages))
        if layout == "shuffled":
            rng.shuffle(dev_pages)
            rng.shuffle(host_pages)
        dev = device.allocator.pages_to_slots(dev_pages[: args.pages])
        hst = host.allocator.pages_to_slots(host_pages[: args.pages])

        def write_job(d: torch.Tensor = dev, h: torch.Tensor = hst) -> None:
            engine.write(device, host, d, h).synchronize()

        def load_job(d: torch.Tensor = dev, h: torch.Tensor = hst) -> None:
            engine.load(host, device, h, d, counter)[0].synchronize()

        write = bandwidth(write_job, nbytes, args.repeat)
        load = bandwidth(load_job, nbytes, args.repeat)
        assert torch.equal(device.k[:, dev], host.k[:, hst]), "copies must be exact"
        results[layout] = (write, load)
        print(f"{layout:9s} L1->L2 {write:.2f} GB/s ({write / plain:.2f}x)   "
              f"L2->L1 {load:.2f} GB/s ({load / plain:.2f}x)")
    engine.shutdown()
    ratio = min(results["runs"]) / plain
    print(f"ratio (allocator-shaped runs, worst direction) {ratio:.2f} (goal >= 0.70); "
          f"shuffled pages {min(results['shuffled']) / plain:.2f}")
    print(json.dumps({"bench": "copy_engine", "ratio": round(ratio, 3),
                      "ratio_shuffled": round(min(results["shuffled"]) / plain, 3),
                      "plain_gb_s": round(plain, 2),
                      "write_gb_s": round(results["runs"][0], 2),
                      "load_gb_s": round(results["runs"][1], 2)}))


if __name__ == "__main__":
    main()
