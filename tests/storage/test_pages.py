"""Page payloads (layout header) and the checksummed envelope."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache_runtime.contracts.errors import CorruptPage
from hicache_runtime.kv.pools import KVShape
from hicache_runtime.l3 import envelope
from hicache_runtime.l3.pages import HEADER_SIZE, PageCodec, PageLayout
from tests.storage.support import small_pool

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@st.composite
def layouts(draw: st.DrawFn) -> PageLayout:
    return PageLayout(
        num_layers=draw(st.integers(1, 3)), num_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 6)), dtype=draw(st.sampled_from(DTYPES)),
        page_size=draw(st.integers(1, 5)), layer_start=draw(st.integers(0, 4)),
        head_start=draw(st.integers(0, 4)),
    )


@given(layouts(), st.integers(0, 2**31))
def test_encode_decode_round_trip_is_bitwise(layout: PageLayout, seed: int) -> None:
    codec = PageCodec(layout)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layout.page_dims, generator=gen, dtype=torch.float64).to(layout.dtype)
    v = torch.randn(layout.page_dims, generator=gen, dtype=torch.float64).to(layout.dtype)
    payload = codec.encode(k, v)
    assert len(payload) == layout.payload_bytes
    k2, v2 = codec.decode(payload)
    assert k2.dtype == layout.dtype
    assert tuple(k2.shape) == layout.page_dims
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


@given(layouts(), layouts())
def test_layout_mismatch_is_detected(a: PageLayout, b: PageLayout) -> None:
    payload = PageCodec(a).encode(torch.zeros(a.page_dims, dtype=a.dtype),
                                  torch.zeros(a.page_dims, dtype=a.dtype))
    if a == b:
        PageCodec(b).check(payload)
    else:
        assert not PageCodec(b).fits(payload)
        with pytest.raises(CorruptPage, match="layout mismatch"):
            PageCodec(b).decode(payload)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pool_pages_round_trip(dtype: torch.dtype) -> None:
    src, dst = small_pool(dtype, seed=1), small_pool(dtype, seed=2)
    codec = PageCodec.for_pool(src)
    slots = src.alloc(12)
    assert slots is not None
    payloads = codec.read_pages(src, slots)
    assert len(payloads) == 3
    target = dst.alloc(12)
    assert target is not None
    codec.write_pages(dst, target, payloads)
    assert torch.equal(dst.k[:, target], src.k[:, slots])
    assert torch.equal(dst.v[:, target], src.v[:, slots])


def test_write_pages_checks_everything_before_writing() -> None:
    pool = small_pool(seed=3)
    codec = PageCodec.for_pool(pool)
    other = PageCodec.for_pool(pool, head_start=2)  # another TP shard's heads
    slots = pool.alloc(8)
    assert slots is not None
    good = codec.read_pages(pool, slots)
    foreign = other.read_pages(pool, slots)
    target = pool.alloc(8)
    assert target is not None
    before = pool.k.clone()
    with pytest.raises(CorruptPage, match="heads 2"):
        codec.write_pages(pool, target, [good[0], foreign[1]])
    assert torch.equal(pool.k, before)  # nothing written
    with pytest.raises(ValueError, match="payloads"):
        codec.write_pages(pool, target, good[:1])
    with pytest.raises(ValueError, match="whole number"):
        codec.read_pages(pool, slots[:3])


def test_layout_of_shape() -> None:
    layout = PageLayout.of(KVShape(2, 3, 4, torch.float16), 8, layer_start=2)
    assert layout.page_dims == (2, 8, 3, 4)
    assert layout.tensor_bytes == 2 * 8 * 3 * 4 * 2
    assert layout.payload_bytes == HEADER_SIZE + 2 * layout.tensor_bytes


# --- envelope ---------------------------------------------------------------------------------

keys_st = st.text("0123456789abcdef_", min_size=1, max_size=80)


@given(keys_st, st.binary(max_size=2048))
def test_seal_unseal_round_trip(key: str, payload: bytes) -> None:
    assert envelope.unseal(key, envelope.seal(key, payload)) == payload


@given(keys_st, st.binary(min_size=1, max_size=512), st.data())
def test_any_single_byte_change_is_caught(key: str, payload: bytes, data: st.DataObject) -> None:
    blob = bytearray(envelope.seal(key, payload))
    pos = data.draw(st.integers(0, len(blob) - 1))
    delta = data.draw(st.integers(1, 255))
    blob[pos] ^= delta
    with pytest.raises(CorruptPage):
        envelope.unseal(key, bytes(blob))


@given(keys_st, st.binary(max_size=512), st.data())
def test_truncation_and_trailing_garbage_are_caught(key: str, payload: bytes,
                                                    data: st.DataObject) -> None:
    blob = envelope.seal(key, payload)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptPage):
        envelope.unseal(key, blob[:cut])
    with pytest.raises(CorruptPage):
        envelope.unseal(key, blob + data.draw(st.binary(min_size=1, max_size=8)))


def test_object_served_under_another_key_is_caught() -> None:
    blob = envelope.seal("aa_m_0_1", b"kv bytes")
    with pytest.raises(CorruptPage, match="checksum"):
        envelope.unseal("aa_m_1_2", blob)


def _version1_blob(key: str, payload: bytes) -> bytes:
    """An object as releases before envelope version 2 wrote it: zlib's CRC-32 over the key,
    the version, flags and length fields, and the payload."""
    crc = zlib.crc32(key.encode())
    crc = zlib.crc32(struct.pack("<HHQ", 1, 0, len(payload)), crc)
    crc = zlib.crc32(payload, crc)
    return struct.pack("<4sHHQII", b"HCL3", 1, 0, len(payload), crc, 0) + payload


def test_pages_are_written_with_crc32c() -> None:
    # The check value of CRC-32C (Castagnoli) for "123456789", as every implementation states it.
    assert envelope._crc32c(b"123456789", 0) == 0xE3069283
    header, _ = envelope.seal_parts("k", b"payload")
    assert struct.unpack_from("<4sH", header) == (b"HCL3", 2)


@given(keys_st, st.binary(max_size=1024))
def test_version1_objects_are_still_read(key: str, payload: bytes) -> None:
    assert envelope.unseal(key, _version1_blob(key, payload)) == payload


def test_version1_damage_and_relabelling_are_caught() -> None:
    blob = bytearray(_version1_blob("aa_m_0_1", b"kv bytes" * 64))
    blob[-3] ^= 0x10
    with pytest.raises(CorruptPage, match="checksum"):
        envelope.unseal("aa_m_0_1", bytes(blob))
    # A version-1 object relabelled as version 2 is checked with CRC-32C: it fails.
    relabelled = bytearray(_version1_blob("aa_m_0_1", b"kv bytes"))
    relabelled[4:6] = (2).to_bytes(2, "little")
    with pytest.raises(CorruptPage, match="checksum"):
        envelope.unseal("aa_m_0_1", bytes(relabelled))
