"""Page hash chains and key suffixes."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache_runtime.config import ModelConfig
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.l3.keys import (
    KeyScheme,
    chain_hashes,
    extend_chain,
    is_page_hash,
    key_suffix,
    model_id,
    page_hash,
)

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=80)
page_sizes = st.integers(1, 9)


def reference_chain(tokens: list[int], page_size: int, prior: str | None = None) -> list[str]:
    """SGLang's formula written out independently: SHA256(prior digest || uint32 LE ids)."""
    out = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
        h = hashlib.sha256((bytes.fromhex(prior) if prior else b"") + data).hexdigest()
        out.append(h)
        prior = h
    return out


def test_known_answer_vector() -> None:
    # Pins the byte format: 4-byte little-endian token ids, no prior for the first page.
    first = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
    assert page_hash([1, 2, 3, 4]) == first
    second = page_hash([5, 6, 7, 8], first)
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] == second


@given(tokens_st, page_sizes)
def test_chain_matches_reference(tokens: list[int], page_size: int) -> None:
    assert chain_hashes(tokens, page_size) == reference_chain(tokens, page_size)


@given(tokens_st, tokens_st, page_sizes)
def test_extend_from_parent_equals_whole_chain(a: list[int], b: list[int], page_size: int) -> None:
    a = a[: len(a) // page_size * page_size]  # a tree node holds whole pages
    parent = chain_hashes(a, page_size)
    child = extend_chain(parent[-1] if parent else None, b, page_size)
    assert parent + child == chain_hashes(a + b, page_size)


@given(tokens_st, page_sizes)
def test_chain_is_prefix_closed_and_partial_pages_ignored(tokens: list[int], ps: int) -> None:
    full = chain_hashes(tokens, ps)
    assert len(full) == len(tokens) // ps
    for k in range(len(tokens) + 1):
        assert chain_hashes(tokens[:k], ps) == full[: k // ps]
    assert all(is_page_hash(h) for h in full)


@given(st.lists(st.integers(0, 1000), min_size=8, max_size=8),
       st.lists(st.integers(0, 1000), min_size=4, max_size=4))
def test_same_page_in_another_context_hashes_differently(first: list[int], page: list[int]) -> None:
    # The key of a page names its whole prefix: a different first page changes the second key.
    other = [t + 1 for t in first[:4]]
    if other != first[:4]:
        assert chain_hashes(first[:4] + page, 4)[1] != chain_hashes(other + page, 4)[1]


def test_tensor_tokens_and_bad_inputs() -> None:
    import torch

    assert chain_hashes(torch.arange(8), 4) == chain_hashes(list(range(8)), 4)
    with pytest.raises(ValueError, match="uint32"):
        page_hash([2**32])
    with pytest.raises(ValueError, match="uint32"):
        page_hash([-1])
    with pytest.raises(ValueError, match="page_size"):
        extend_chain(None, [1, 2], 0)


def test_suffixes_as_sglang_forms_them() -> None:
    tp1 = RankInfo.of(1, tp_size=2, pp_size=1)
    assert key_suffix("org/model", tp1) == "_org-model_1_2"
    assert key_suffix("m", tp1, shared_across_tp=True) == "_m"
    pp = RankInfo.of(3, tp_size=2, pp_size=2)  # tp 1, pp 1
    assert key_suffix("m", pp) == "_m_1_2_2_1"
    assert key_suffix("m", pp, shared_across_tp=True) == "_m_2_1"
    # TP ranks of one stage share objects only with shared keys; stages never do.
    r0, r1 = RankInfo.of(0, 2, 2), RankInfo.of(1, 2, 2)
    assert key_suffix("m", r0) != key_suffix("m", r1)
    assert key_suffix("m", r0, shared_across_tp=True) == key_suffix("m", r1, shared_across_tp=True)
    assert key_suffix("m", r0, shared_across_tp=True) != key_suffix("m", RankInfo.of(2, 2, 2),
                                                                     shared_across_tp=True)


def test_key_scheme_owns_exactly_its_suffix() -> None:
    h = page_hash([1, 2, 3, 4])
    a, b = KeyScheme("_m_0_2"), KeyScheme("_m_0_2_2_1")
    assert a.object_key(h) == h + "_m_0_2"
    assert a.owns(a.object_key(h))
    assert not a.owns(b.object_key(h))
    assert b.owns(b.object_key(h))
    assert not b.owns(a.object_key(h))
    with pytest.raises(ValueError, match="not a page hash"):
        a.object_key("abc_def")
    with pytest.raises(ValueError, match="not a page hash"):
        a.object_key("")


def test_model_id_tracks_every_config_field() -> None:
    base = ModelConfig()
    assert model_id(base) == model_id(ModelConfig())
    assert model_id(base) != model_id(ModelConfig(weight_seed=base.weight_seed + 1))
    assert model_id(base) != model_id(ModelConfig(dtype="float32"))
    assert "_" not in model_id(base)
    assert "/" not in model_id(base)
