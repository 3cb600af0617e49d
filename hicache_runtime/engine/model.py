"""A small decoder-only transformer that does real work against the paged KV pool.

Weights are a pure function of ``ModelConfig.weight_seed`` (every rank generates the full
tensors and keeps its shard), decoding is greedy, and attention reads K/V back from the device
pool by slot (a paged gather), so a wrong or missing KV page changes the output.

Parallelism follows SGLang: heads are sharded over TP ranks with row-parallel all_reduce after
the attention output and MLP down projections; layers are split over PP stages, and a stage
other than the first receives hidden states from the previous one. Rotary embedding views the
queries with the stage's *own* token count, as SGLang's ``RotaryEmbedding`` does, so a stage
whose batch disagrees with the sender fails with the production error
``shape '[N, -1, D]' is invalid for input of size M``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hicache_runtime.config import ModelConfig
from hicache_runtime.contracts.topology import RankInfo
from hicache_runtime.kv.pools import ALL_PAGES, TRAILING_PAGES, DeviceKVPool, KVShape, torch_dtype

_RMS_EPS = 1e-6
#: Scales Q/K weights so attention is peaked: then one wrong or missing KV page changes the
#: greedy output of most requests (about 9 in 10 for one zeroed page in a 100-300 token prompt),
#: which is what lets a run catch silent KV corruption by comparing outputs.
_QK_SHARPNESS = 3.0
#: Weight of the ``all_pages`` indexer value in attention scores.
_INDEXER_GAIN = 1.0
#: Weight and decay of the ``trailing_pages`` per-page state.
_STATE_GAIN, _STATE_DECAY = 0.5, 0.9


class TensorParallelComm(Protocol):
    """The compute-side TP collective (sum over the TP group)."""

    def all_reduce(self, tensor: torch.Tensor, site: str) -> torch.Tensor: ...


class LocalTP:
    """One TP rank: the all_reduce is the identity."""

    def all_reduce(self, tensor: torch.Tensor, site: str) -> torch.Tensor:
        return tensor


@dataclass
class ForwardBatch:
    """One batch as the model sees it. Rows of ``input_ids``/``positions``/``out_slots`` are
    the tokens computed now, request after request."""

    is_decode: bool
    rids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    seq_slots: list[torch.Tensor]
    """Per request, device slots of every position it attends to (prefix + new)."""
    extend_lens: list[int]
    prefix_lens: list[int]
    sample: list[bool]
    """Per request, whether its last row produces a next token (False for a mid chunk)."""
    consumer: int | None = None
    """Layer-counter slot of the load-back this batch must wait for, if any."""
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    indexer: torch.Tensor


class TinyTransformer:
    """This rank's shard of the model: its stage's layers and its TP slice of the heads."""

    def __init__(self, cfg: ModelConfig, rank: RankInfo, device: torch.device,
                 tp: TensorParallelComm | None = None, page_size: int = 1) -> None:
        self.cfg = cfg
        self.page_size = page_size
        """The KV page size: the ``trailing_pages`` state is kept per page."""
        self.rank = rank
        self.device = device
        self.dtype = torch_dtype(cfg.dtype)
        self.tp: TensorParallelComm = tp or LocalTP()
        self.layers_range = rank.layer_range(cfg.num_layers)
        self.heads = rank.head_range(cfg.num_heads)
        # MLA-style models keep the KV cache replicated on every TP rank (the compressed
        # latent is not head-sharded): each rank computes and stores K/V of every head and its
        # query heads read their slice. Otherwise K/V are sharded like the query heads.
        self.kv_heads = range(cfg.num_heads) if cfg.kv_replicated else self.heads
        self._local = slice(self.heads.start - self.kv_heads.start,
                            self.heads.stop - self.kv_heads.start)
        self.ffn = rank.shard_range(cfg.ffn_size)
        self.scale = cfg.head_dim ** -0.5
        h, d = cfg.hidden_size, cfg.head_dim
        q_cols = slice(self.heads.start * d, self.heads.stop * d)
        kv_cols = slice(self.kv_heads.start * d, self.kv_heads.stop * d)
        f_cols = slice(self.ffn.start, self.ffn.stop)
        self.layers: list[_Layer] = []
        for li in self.layers_range:
            qk_std, v_std = _QK_SHARPNESS * h ** -0.5, h ** -0.5
            self.layers.append(_Layer(
                attn_norm=self._ones(h),
                wq=self._param("wq", li, (h, cfg.num_heads * d), qk_std)[:, q_cols],
                wk=self._param("wk", li, (h, cfg.num_heads * d), qk_std)[:, kv_cols],
                wv=self._param("wv", li, (h, cfg.num_heads * d), v_std)[:, kv_cols],
                wo=self._param("wo", li, (cfg.num_heads * d, h),
                               (cfg.num_heads * d) ** -0.5)[q_cols, :],
                mlp_norm=self._ones(h),
                w_gate=self._param("w_gate", li, (h, cfg.ffn_size), h ** -0.5)[:, f_cols],
                w_up=self._param("w_up", li, (h, cfg.ffn_size), h ** -0.5)[:, f_cols],
                w_down=self._param("w_down", li, (cfg.ffn_size, h),
                                   cfg.ffn_size ** -0.5)[f_cols, :],
                indexer=self._param("indexer", li, (cfg.num_heads, d),
                                    d ** -0.5)[self.kv_heads.start : self.kv_heads.stop],
            ))
        self.embed = self._param("embed", 0, (cfg.vocab_size, h), 1.0) \
            if rank.is_first_stage else None
        if rank.is_last_stage:
            self.final_norm = self._ones(h)
            self.lm_head = self._param("lm_head", 0, (h, cfg.vocab_size), 2.0 * h ** -0.5)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        self._inv_freq = inv.to(device)

    def kv_shape(self) -> KVShape:
        return KVShape(len(self.layers_range), len(self.kv_heads), self.cfg.head_dim, self.dtype,
                       tuple(self.cfg.sidecars))

    # --- forward ------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: DeviceKVPool,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage. Returns next-token ids (last stage) or hidden states (others)."""
        pool.consumer = batch.consumer
        try:
            if self.embed is not None:
                h = self.embed.index_select(0, batch.input_ids.to(self.device))
            else:
                assert hidden_in is not None, "a downstream stage needs hidden states"
                h = hidden_in.to(self.device, self.dtype)
            cos, sin = self._rope(batch.positions.to(self.device))
            for local, layer in enumerate(self.layers):
                h = h + self._attention(layer, local, _rms(h, layer.attn_norm), cos, sin,
                                        batch, pool)
                h = h + self._mlp(layer, _rms(h, layer.mlp_norm))
        finally:
            pool.consumer = None
        if not self.rank.is_last_stage:
            return h
        return self._sample(h, batch)

    def _attention(self, layer: _Layer, local: int, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: ForwardBatch, pool: DeviceKVPool) -> torch.Tensor:
        n, d = batch.num_tokens, self.cfg.head_dim
        # The stage's own token count shapes the view: a disagreeing sender fails here.
        q = _rotate((x @ layer.wq).view(n, -1, d), cos, sin)
        k = _rotate((x @ layer.wk).view(n, -1, d), cos, sin)
        v = (x @ layer.wv).view(n, -1, d)
        out_slots = batch.out_slots.to(self.device)
        pool.set_kv(local, out_slots, k, v)
        sidecars = self.cfg.sidecars
        if ALL_PAGES in sidecars:  # KV-derived: recomputing it gives the same values
            pool.set_aux(ALL_PAGES, local, out_slots, (k * layer.indexer).sum(-1))
        outs, row = [], 0
        for seq_slots, e, p in zip(batch.seq_slots, batch.extend_lens, batch.prefix_lens):
            slots = seq_slots.to(self.device)
            all_keys, all_values = pool.get_kv(local, slots)
            keys, values = all_keys[:, self._local], all_values[:, self._local]
            qr = q[row : row + e]
            scores = torch.einsum("ehd,lhd->hel", qr, keys) * self.scale
            if ALL_PAGES in sidecars:
                bias = pool.get_aux(ALL_PAGES, local, slots)[:, self._local]
                scores = scores + _INDEXER_GAIN * bias.T[:, None]
            if e > 1:  # causal: query i (position p+i) sees keys 0..p+i
                total = keys.shape[0]
                mask = torch.arange(total, device=self.device)[None, :] > (
                    p + torch.arange(e, device=self.device)[:, None])
                scores = scores.masked_fill(mask[None], float("-inf"))
            out = torch.einsum("hel,lhd->ehd", scores.softmax(-1), values)
            if TRAILING_PAGES in sidecars:
                states = self._page_states(local, pool, slots, all_values, p, e)
                out = out + _STATE_GAIN * states[:, self._local]
            outs.append(out)
            row += e
        o = torch.cat(outs).reshape(n, -1)
        return self.tp.all_reduce(o @ layer.wo, "attn_out")

    def _page_states(self, local: int, pool: DeviceKVPool, slots: torch.Tensor,
                     values: torch.Tensor, p: int, e: int) -> torch.Tensor:
        """The ``trailing_pages`` term of positions ``p .. p+e-1``: each position gets the state
        of the page boundary before its page; each page completed here gets its state
        (``decay * previous + mean of the page's V``), stored at its last token's slot."""
        ps = self.page_size
        out = torch.zeros(e, *values.shape[1:], dtype=values.dtype, device=values.device)
        first = p // ps
        prev = torch.zeros(values.shape[1:], dtype=values.dtype, device=values.device) \
            if first == 0 else pool.get_aux(TRAILING_PAGES, local, slots[first * ps - 1:
                                                                         first * ps])[0]
        for page in range(first, (p + e - 1) // ps + 1):
            lo, hi = max(p, page * ps), min(p + e, (page + 1) * ps)
            out[lo - p : hi - p] = prev
            end = (page + 1) * ps - 1
            if end < p + e:  # the page completes in this batch
                prev = _STATE_DECAY * prev + values[page * ps : end + 1].mean(0)
                pool.set_aux(TRAILING_PAGES, local, slots[end : end + 1], prev[None])
        return out

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.silu(x @ layer.w_gate) * (x @ layer.w_up)
        return self.tp.all_reduce(hidden @ layer.w_down, "mlp_out")

    def _sample(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows, row = [], 0
        for e, want in zip(batch.extend_lens, batch.sample):
            row += e
            if want:
                rows.append(row - 1)
        if not rows:
            return torch.empty(0, dtype=torch.int64)
        last = _rms(h[rows], self.final_norm)
        return (last @ self.lm_head).argmax(-1).cpu()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        return freqs.cos().to(self.dtype)[:, None, :], freqs.sin().to(self.dtype)[:, None, :]

    # --- weights ------------------------------------------------------------------------------

    def _param(self, name: str, layer: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
        digest = hashlib.sha256(f"{self.cfg.weight_seed}/{name}/{layer}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        full = torch.randn(shape, generator=gen, dtype=torch.float64) * std
        return full.to(self.device, self.dtype)

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype, device=self.device)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _RMS_EPS) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
