"""On a GPU: the CUDA copy engine (streams, events, per-layer waits on the compute stream)
and a whole run with pools on the device. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.kv.copy_engine import CudaCopyEngine, LayerDoneCounter
from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_runtime.launch.run import run_single
from tests.helpers import small_config

pytestmark = pytest.mark.gpu


def test_cuda_copy_engine_round_trip() -> None:
    dev = torch.device("cuda")
    shape = KVShape(num_layers=4, num_heads=4, head_dim=16, dtype=torch.float16)
    device = DeviceKVPool(shape, 1024, 16, dev)
    host = HostKVPool(shape, 2048, 16, pin=True)
    device.k.normal_()
    device.v.normal_()
    engine = CudaCopyEngine(16, dev)
    d_slots = device.allocator.pages_to_slots([3, 4, 9])
    h_slots = host.allocator.pages_to_slots([20, 7, 8])
    engine.write(device, host, d_slots, h_slots).synchronize()
    assert torch.equal(host.k[:, h_slots], device.k[:, d_slots].cpu())
    back = device.allocator.pages_to_slots([30, 31, 32])
    counter = LayerDoneCounter(shape.num_layers)
    event, slot = engine.load(host, device, h_slots, back, counter)
    device.consumer = slot
    k, _ = device.get_kv(3, back.to(dev))
    device.consumer = None
    event.synchronize()
    assert torch.equal(k, device.k[3, d_slots.to(dev)])
    engine.shutdown()


def test_run_on_the_gpu_matches_its_reference(bundle_root: Path) -> None:
    s = run_single(small_config(**{"workload.requests": 24, "cache.device_tokens": 192}),
                   bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    assert s.cached_tokens.host > 0


def test_cuda_load_waits_for_the_compute_stream() -> None:
    """A load-back writes its device pages only after the work already queued on the compute
    stream. Here that work, held back by a spin kernel, still writes the destination pages (as
    the last forward of the request whose evicted pages the load reuses may); the loaded KV
    must land after it rather than be overwritten by it."""
    dev = torch.device("cuda")
    shape = KVShape(num_layers=2, num_heads=4, head_dim=16, dtype=torch.float16)
    device = DeviceKVPool(shape, 256, 16, dev)
    host = HostKVPool(shape, 256, 16, pin=True)
    host.k.fill_(1.0)
    host.v.fill_(-1.0)
    engine = CudaCopyEngine(16, dev)
    h_slots = host.allocator.pages_to_slots([2, 3])
    d_slots = device.allocator.pages_to_slots([5, 6])
    d_idx = d_slots.to(dev)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time on the compute stream
    device.k.index_fill_(1, d_idx, 7.0)  # queued behind the spin, still on the compute stream
    device.v.index_fill_(1, d_idx, 7.0)
    event, _ = engine.load(host, device, h_slots, d_slots, LayerDoneCounter(shape.num_layers))
    event.synchronize()
    torch.cuda.synchronize(dev)
    assert (device.k[:, d_idx] == 1.0).all(), "the load ran before the compute stream's writes"
    assert (device.v[:, d_idx] == -1.0).all()
    engine.shutdown()
