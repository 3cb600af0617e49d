"""Host pool memory layouts (``layer_first``, ``page_first``, ``page_first_direct``): buffer
shapes as upstream has them, exact L1<->L2 copies in every layout, page mapping and copy way,
loads that land layer by layer, L3 page payloads read and written straight from host pages, and
runs whose outputs match their cache-disabled reference in every layout."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cli import app
from faults.campaign.plan import load_campaign
from faults.spec import parse_fault
from hicache_runtime.contracts.bundle import RunOutcome
from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.contracts.events import Ev
from hicache_runtime.contracts.jsonl import read_jsonl
from hicache_runtime.kv import copy_engine
from hicache_runtime.kv.copy_engine import (
    CpuCopyEngine,
    CudaCopyEngine,
    LayerDoneCounter,
    PagePlan,
    copy_pages,
    landing_groups,
)
from hicache_runtime.kv.layouts import MEM_LAYOUTS, page_view
from hicache_runtime.kv.pools import DeviceKVPool, HostKVPool, KVShape
from hicache_runtime.l3.pages import HEADER_SIZE, PageCodec
from hicache_runtime.launch.run import run, run_single
from tests.helpers import small_config
from tests.runtime.test_l3 import l3_config

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SIDECARS = ("all_pages", "trailing_pages")


def _filled(pool: HostKVPool | DeviceKVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in (pool.k, pool.v, *pool.aux.values()):
        buf.copy_(torch.randn(buf.shape, generator=gen, dtype=torch.float64).to(buf.dtype))


def _pools(layout: str, dtype: torch.dtype = torch.float32, pages: int = 64, page_size: int = 4,
           layers: int = 3, sidecars: tuple[str, ...] = ()) -> tuple[DeviceKVPool, HostKVPool]:
    shape = KVShape(layers, 2, 4, dtype, sidecars)
    device = DeviceKVPool(shape, pages * page_size, page_size, torch.device("cpu"))
    host = HostKVPool(shape, pages * page_size, page_size, pin=False, layout=layout)
    _filled(device, 1)
    _filled(host, 2)
    return device, host


def _mapping(kind: str, n: int, pages: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Device and host pages of an ``n``-page job: allocator runs, host pages scattered over
    the pool, device pages scattered, or both."""
    rng = random.Random(seed)
    dev, host = list(range(pages)), list(range(pages))
    if kind in ("host", "both"):
        rng.shuffle(host)
    if kind in ("device", "both"):
        rng.shuffle(dev)
    return dev[:n], host[:n]


def _logical(pool: HostKVPool | DeviceKVPool, buf: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """``[layers, pages, page_size, ...]`` values of ``pages`` whatever the layout."""
    return pool.page_view(buf)[:, pages]


# --- pools ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "dims"), [
    ("layer_first", (3, 32, 2, 4)),  # [layers, slots, heads, dim]
    ("page_first", (32, 3, 2, 4)),  # [slots, layers, heads, dim]
    ("page_first_direct", (8, 3, 4, 2, 4)),  # [pages, layers, page, heads, dim]
])
def test_host_buffers_are_shaped_as_upstream(layout: str, dims: tuple[int, ...]) -> None:
    host = HostKVPool(KVShape(3, 2, 4, torch.float16, SIDECARS), 32, 4, pin=False, layout=layout)
    assert tuple(host.k.shape) == tuple(host.v.shape) == dims
    assert host.k.is_contiguous()
    assert tuple(host.page_view(host.k).shape) == (3, 8, 4, 2, 4)
    assert tuple(host.page_view(host.aux["all_pages"]).shape) == (3, 8, 4, 2)
    reference = HostKVPool(KVShape(3, 2, 4, torch.float16, SIDECARS), 32, 4, pin=False)
    assert [t.nbytes for t in (host.k, host.v, *host.aux.values())] == \
        [t.nbytes for t in (reference.k, reference.v, *reference.aux.values())]


@pytest.mark.parametrize("layout", MEM_LAYOUTS)
def test_page_view_and_slot_reads_name_the_same_values(layout: str) -> None:
    _, host = _pools(layout, sidecars=SIDECARS)
    slots = torch.tensor([5, 6, 7, 17, 30, 31])
    k, v = host.read_pages(slots)
    for i, slot in enumerate(slots.tolist()):
        page, off = divmod(slot, host.page_size)
        assert torch.equal(k[:, i], host.page_view(host.k)[:, page, off])
        assert torch.equal(v[:, i], host.page_view(host.v)[:, page, off])
    new_k, new_v = torch.randn_like(k), torch.randn_like(v)
    host.write_pages(slots, new_k, new_v)
    assert all(torch.equal(a, b) for a, b in zip(host.read_pages(slots), (new_k, new_v)))
    aux = torch.randn_like(host.read_aux("trailing_pages", slots))
    host.write_aux("trailing_pages", slots, aux)
    assert torch.equal(host.read_aux("trailing_pages", slots), aux)


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="page_first_direct"):
        HostKVPool(KVShape(1, 1, 2, torch.float32), 8, 4, pin=False, layout="page_last")


# --- copies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", MEM_LAYOUTS)
@pytest.mark.parametrize("kind", ["runs", "host", "device", "both"])
def test_the_copy_engine_writes_and_loads_back_exactly(layout: str, kind: str) -> None:
    device, host = _pools(layout, torch.bfloat16, pages=128, sidecars=SIDECARS)
    engine = CpuCopyEngine(device.page_size)
    try:
        dev_pages, host_pages = _mapping(kind, 48, 128)
        d = device.allocator.pages_to_slots(dev_pages)
        h = host.allocator.pages_to_slots(host_pages)
        engine.write(device, host, d, h).synchronize()
        for dbuf, hbuf in zip((device.k, device.v, *device.aux.values()),
                              (host.k, host.v, *host.aux.values())):
            assert torch.equal(_logical(host, hbuf, host_pages), _logical(device, dbuf, dev_pages))
        back = [p for p in range(128) if p not in dev_pages][:48]
        counter = LayerDoneCounter(3)
        event, slot = engine.load(host, device, h, device.allocator.pages_to_slots(back),
                                  counter)
        event.synchronize()
        assert counter.is_done(slot, 2)
        for dbuf in (device.k, device.v, *device.aux.values()):
            assert torch.equal(_logical(device, dbuf, back), _logical(device, dbuf, dev_pages))
    finally:
        engine.shutdown()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MEM_LAYOUTS), st.sampled_from(DTYPES), st.integers(1, 5),
       st.integers(1, 4), st.integers(0, 40), st.sampled_from(["runs", "host", "device", "both"]),
       st.integers(0, 2**16), st.data())
def test_any_page_mapping_copies_exactly_both_ways(layout: str, dtype: torch.dtype, page_size: int,
                                                   layers: int, n: int, kind: str, seed: int,
                                                   data: st.DataObject) -> None:
    device, host = _pools(layout, dtype, pages=48, page_size=page_size, layers=layers)
    dev_pages, host_pages = _mapping(kind, n, 48, seed)
    lo = data.draw(st.integers(0, layers - 1))
    part = slice(lo, data.draw(st.integers(lo + 1, layers)))
    write = PagePlan.of_pages(torch.tensor(dev_pages, dtype=torch.int64),
                              torch.tensor(host_pages, dtype=torch.int64))
    copy_pages(device.page_view(device.k)[part], host.page_view(host.k)[part], write)
    assert torch.equal(_logical(host, host.k, host_pages)[part],
                       _logical(device, device.k, dev_pages)[part])
    target = torch.zeros_like(device.v)
    load = PagePlan.of_pages(write.dst, write.src)
    copy_pages(host.page_view(host.v)[part], page_view(target, "layer_first", page_size)[part],
               load)
    got = page_view(target, "layer_first", page_size)[part][:, dev_pages]
    assert torch.equal(got, _logical(host, host.v, host_pages)[part])


def _views(row_words: int, transposed: bool, tokens: int = 2
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer-major source page view and a destination page view over 256 pages of 2 layers x
    ``tokens`` tokens x ``row_words`` int64 words; the destination orders a page token-major
    when ``transposed`` (as a page_first pool does)."""
    src = torch.arange(2 * 256 * tokens * row_words, dtype=torch.int64).view(
        2, 256, tokens, row_words)
    if transposed:
        return src, torch.zeros(256, tokens, 2, row_words,
                                dtype=torch.int64).permute(2, 0, 1, 3)
    return src, torch.zeros_like(src)


def _pairs(kind: str, n: int = 96) -> tuple[list[int], list[int]]:
    """Source and destination pages: ``dst-run`` (source scattered), ``src-run`` (destination
    scattered), ``both`` (both scattered, the destination in runs of two pages)."""
    rng = random.Random(7)
    scattered = rng.sample(range(256), n)
    if kind == "dst-run":
        return scattered, list(range(n))
    if kind == "src-run":
        return list(range(n)), scattered
    pairs = rng.sample(range(64), n // 2)  # 4p, 4p + 1: runs of exactly two pages
    return scattered, [4 * p + i for p in pairs for i in (0, 1)]


@pytest.mark.parametrize(("kind", "row_words", "tokens", "transposed", "way"), [
    ("runs", 512, 2, True, "_copy_runs"),  # allocator runs: a slice copy each, blocked
    ("dst-run", 64, 2, False, "_gather_runs"),  # a load into a device run: one gather
    ("src-run", 64, 2, False, "_scatter_runs"),  # a write to scattered pages: one scatter
    ("src-run", 64, 2, True, "_copy_staged"),  # the same into page_first: transposed in cache
    ("both", 64, 2, False, "_copy_staged"),  # scattered on both sides, small pages
    ("both", 8192, 2, True, "_gather_runs"),  # large pages: one index copy per destination run
    # large page_first pages (128 KiB of 1 KiB rows) written scattered: transposed straight
    # into place, page by page
    ("src-run", 128, 64, True, "_copy_runs"),
])
def test_each_mapping_takes_its_copy_way(kind: str, row_words: int, tokens: int,
                                         transposed: bool, way: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[str] = []
    for name in ("_copy_runs", "_gather_runs", "_scatter_runs", "_copy_staged"):
        original = getattr(copy_engine, name)

        def spy(*args: object, _name: str = name, _fn: object = original) -> None:
            taken.append(_name)
            _fn(*args)  # type: ignore[operator]

        monkeypatch.setattr(copy_engine, name, spy)
    src, dst = _views(row_words, transposed, tokens)
    src_pages, dst_pages = (list(range(96)), list(range(96))) if kind == "runs" \
        else _pairs(kind)
    copy_pages(src, dst, PagePlan.of_pages(torch.tensor(src_pages), torch.tensor(dst_pages)))
    assert taken == [way]
    assert torch.equal(dst[:, dst_pages], src[:, src_pages])


@pytest.mark.parametrize("layout", MEM_LAYOUTS)
def test_loads_land_layer_by_layer(layout: str) -> None:
    """A slow load (the dma-lag fault's hook) reports its first layer long before its last:
    attention can start on layer 0 while the rest is still copying."""
    device, host = _pools(layout, layers=4)
    engine = CpuCopyEngine(device.page_size, lag=lambda: 0.8)
    try:
        counter = LayerDoneCounter(4)
        slots = host.allocator.pages_to_slots([3, 9, 10])
        event, slot = engine.load(host, device, slots,
                                  device.allocator.pages_to_slots([0, 1, 2]), counter)
        deadline = time.monotonic() + 30
        while not counter.is_done(slot, 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert counter.is_done(slot, 0)
        assert not counter.is_done(slot, 3), "the last layer lands later"
        event.synchronize()
        assert counter.is_done(slot, 3)
    finally:
        engine.shutdown()
    groups = landing_groups(layout, 4)
    assert groups[0] == range(0, 1)
    assert [layer for g in groups for layer in g] == [0, 1, 2, 3]


# --- L3 page payloads ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", MEM_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pages_round_trip_through_payloads(layout: str, dtype: torch.dtype) -> None:
    _, src = _pools(layout, dtype)
    _, dst = _pools(layout, dtype)
    codec = PageCodec.for_pool(src, layer_start=3, head_start=2)
    slots = src.allocator.pages_to_slots([7, 2, 3])
    payloads = codec.read_pages(src, slots)
    assert [len(p) for p in payloads] == [codec.payload_bytes] * 3
    target = dst.allocator.pages_to_slots([40, 41, 12])
    codec.write_pages(dst, target, payloads)
    for buf_s, buf_d in ((src.k, dst.k), (src.v, dst.v)):
        assert torch.equal(_logical(dst, buf_d, [40, 41, 12]), _logical(src, buf_s, [7, 2, 3]))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_page_major_payload_is_the_host_page_as_it_lies(layout: str) -> None:
    _, host = _pools(layout, torch.float16)
    codec = PageCodec.for_pool(host)
    (payload,) = codec.read_pages(host, host.allocator.pages_to_slots([5]))
    n = codec.layout.tensor_bytes
    ps = host.page_size
    k_block = host.k[5 * ps : 6 * ps] if layout == "page_first" else host.k[5]
    v_block = host.v[5 * ps : 6 * ps] if layout == "page_first" else host.v[5]
    assert payload[HEADER_SIZE : HEADER_SIZE + n] == k_block.contiguous().numpy().tobytes()
    assert payload[HEADER_SIZE + n :] == v_block.contiguous().numpy().tobytes()
    k, _ = codec.decode(payload)  # layer-major whatever the payload's order
    assert torch.equal(k, host.page_view(host.k)[:, 5])


@pytest.mark.parametrize(("written", "read"), [
    ("page_first", "layer_first"), ("layer_first", "page_first"),
    ("page_first", "page_first_direct"), ("page_first_direct", "page_first"),
])
def test_a_store_written_in_one_layout_serves_another(written: str, read: str) -> None:
    _, src = _pools(written, torch.bfloat16)
    _, dst = _pools(read, torch.bfloat16)
    payloads = PageCodec.for_pool(src).read_pages(src, src.allocator.pages_to_slots([1, 30]))
    reader = PageCodec.for_pool(dst)
    assert all(reader.fits(p) for p in payloads)
    reader.write_pages(dst, dst.allocator.pages_to_slots([8, 9]), payloads)
    assert torch.equal(_logical(dst, dst.k, [8, 9]), _logical(src, src.k, [1, 30]))
    assert torch.equal(_logical(dst, dst.v, [8, 9]), _logical(src, src.v, [1, 30]))


def test_another_slice_is_refused_in_either_order() -> None:
    _, host = _pools("page_first")
    payload = PageCodec.for_pool(host).read_pages(host, host.allocator.pages_to_slots([4]))[0]
    other = PageCodec.for_pool(_pools("layer_first")[1], head_start=2)
    assert not other.fits(payload)
    with pytest.raises(CorruptPage, match="token-major"):
        other.decode(payload)


# --- runs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", MEM_LAYOUTS)
def test_outputs_match_the_reference_in_every_layout(layout: str, tmp_path: Path,
                                                     bundle_root: Path) -> None:
    cfg = l3_config(tmp_path / "l3", **{"cache.mem_layout": layout,
                                         "observability.watchdog_timeout_s": 60.0})
    warm = run_single(cfg, compare=False, bundle_root=bundle_root)  # fills L3
    assert warm.outcome is RunOutcome.HEALTHY, warm.error
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True, s.mismatches[:2]
    assert s.cached_tokens.host > 0, "L2 served load-backs"
    assert s.cached_tokens.storage > 0, "L3 served prefetches into L2"


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_layer_zero_computes_before_the_load_finishes(layout: str, tmp_path: Path,
                                                      bundle_root: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    cfg = small_config(**{
        # a copy slow enough (150 ms a job) that layer 0 finishes well inside it even when
        # the machine is loaded and the scheduler thread waits for a core
        "model.num_layers": 4, "workload.kind": "multi_turn", "workload.requests": 16,
        "cache.device_tokens": 160, "cache.host_tokens": 2048, "cache.mem_layout": layout,
        "observability.trace_path": trace, "faults": (parse_fault("dma-lag:ms=150"),),
    })
    s = run_single(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True
    events = list(read_jsonl(trace))
    loads = [e["attrs"] for e in events if e["kind"] == Ev.COPY and e["attrs"]["dir"] == "h2d"]
    waits = [e["attrs"] for e in events if e["kind"] == Ev.LAYER_WAIT]
    assert loads, "the workload must load back from L2"
    overlapped = 0
    for job in loads:
        end = job["t0_ns"] + job["dur_ns"]
        first = [w for w in waits if w["layer"] == 0 and job["t0_ns"] <= w["t0_ns"] <= end]
        overlapped += any(w["t0_ns"] + w["dur_ns"] < end - 5_000_000 for w in first)
    assert overlapped >= 1, "attention must start on layer 0 while later layers still copy"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_tp2_pp2_outputs_match_in_page_major_layouts(layout: str, tmp_path: Path,
                                                      bundle_root: Path) -> None:
    cfg = l3_config(tmp_path / "l3", **{"cache.mem_layout": layout, "topology.tp": 2,
                                         "topology.pp": 2, "workload.requests": 24,
                                         "observability.watchdog_timeout_s": 60.0})
    assert run(cfg, compare=False, bundle_root=bundle_root).outcome is RunOutcome.HEALTHY
    s = run(cfg, bundle_root=bundle_root)
    assert s.outcome is RunOutcome.HEALTHY, s.error
    assert s.output_match is True, s.mismatches[:2]
    assert s.cached_tokens.host > 0
    assert s.cached_tokens.storage > 0


def test_mem_layout_reaches_the_config_from_the_command_line(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["run", "--mem-layout", "page_first_direct", "--torchrun-dir",
                                 str(tmp_path)])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["cache"]["mem_layout"] == "page_first_direct"
    bad = runner.invoke(app, ["run", "--mem-layout", "page_last", "--torchrun-dir",
                              str(tmp_path)])
    assert bad.exit_code == 2
    assert "--mem-layout" in bad.output


def test_the_property_campaign_runs_every_page_major_layout() -> None:
    spec = load_campaign(ROOT / "faults" / "campaigns" / "properties.yaml")
    cells = spec.expand()
    for layout in ("page_first", "page_first_direct"):
        ours = [c for c in cells if c.config.get("cache.mem_layout") == layout]
        assert {(c.tp, c.pp) for c in ours} == {(1, 1), (2, 2)}, layout
        kinds = {parse_fault(f).kind for c in ours for f in c.faults}
        assert {"dma-lag", "storage-corrupt"} <= kinds, layout
        assert {c.seed for c in ours} == {0, 1, 2, 3, 4}


# --- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", MEM_LAYOUTS)
@pytest.mark.parametrize("kind", ["runs", "both"])
def test_the_cuda_copy_engine_moves_every_layout_exactly(layout: str, kind: str) -> None:
    dev = torch.device("cuda")
    shape = KVShape(num_layers=4, num_heads=4, head_dim=16, dtype=torch.float16)
    device = DeviceKVPool(shape, 256 * 16, 16, dev)
    host = HostKVPool(shape, 256 * 16, 16, pin=True, layout=layout)
    device.k.normal_()
    device.v.normal_()
    engine = CudaCopyEngine(16, dev)
    dev_pages, host_pages = _mapping(kind, 100, 256)  # "both": over 64 runs, pinned staging
    d = device.allocator.pages_to_slots(dev_pages)
    h = host.allocator.pages_to_slots(host_pages)
    engine.write(device, host, d, h).synchronize()
    assert torch.equal(_logical(host, host.k, host_pages), _logical(device, device.k,
                                                                    dev_pages).cpu())
    back = [p for p in range(256) if p not in dev_pages][:100]
    counter = LayerDoneCounter(shape.num_layers)
    event, slot = engine.load(host, device, h, device.allocator.pages_to_slots(back), counter)
    device.consumer = slot
    k, _ = device.get_kv(3, device.allocator.pages_to_slots(back).to(dev))
    device.consumer = None
    event.synchronize()
    assert torch.equal(k, device.k[3, d.to(dev)])
    assert torch.equal(_logical(device, device.v, back), _logical(device, device.v, dev_pages))
    engine.shutdown()
