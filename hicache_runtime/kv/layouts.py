"""Host pool memory layouts (SGLang's ``--hicache-mem-layout``) and the page views copies use.

Each KV buffer of a pool (K, V and every sidecar) holds one value of shape ``slot`` (e.g.
``[heads, head_dim]``) per layer and token slot. The layout fixes the order in memory:

===================== ================================= ====================================
layout                buffer shape                      one page of one buffer is
===================== ================================= ====================================
``layer_first``       ``[layers, slots, *slot]``        ``layers`` blocks of ``[page, *slot]``
``page_first``        ``[slots, layers, *slot]``        one block ``[page, layers, *slot]``
``page_first_direct`` ``[pages, layers, page, *slot]``  one block ``[layers, page, *slot]``
===================== ================================= ====================================

``layer_first`` is what attention reads (the device pool always has it) and what a per-layer
copy likes: one layer of a page is one contiguous block. ``page_first`` keeps every layer of a
token together, so a page is one block for storage and for a whole-page transfer, but a single
layer of a page is ``page`` small pieces. ``page_first_direct`` keeps the page as one block and
each layer inside it contiguous, so both a whole-page and a per-layer transfer move blocks
(upstream copies it page by page with plain memcpys: the ``direct`` IO backend).

:func:`page_view` presents any of them as ``[layers, pages, page, *slot]`` (a strided view, no
copy), which is what the copy engine and the page codec index.
"""

from __future__ import annotations

from typing import Literal

import torch

LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
MEM_LAYOUTS: tuple[str, ...] = (LAYER_FIRST, PAGE_FIRST, PAGE_FIRST_DIRECT)
MemLayout = Literal["layer_first", "page_first", "page_first_direct"]


def check_layout(layout: str) -> None:
    if layout not in MEM_LAYOUTS:
        raise ValueError(f"unknown memory layout {layout!r}; known: {', '.join(MEM_LAYOUTS)}")


def buffer_shape(layout: str, num_layers: int, capacity_tokens: int, page_size: int,
                 slot: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one buffer of a pool in ``layout`` (see the module's table)."""
    check_layout(layout)
    if layout == LAYER_FIRST:
        return (num_layers, capacity_tokens, *slot)
    if layout == PAGE_FIRST:
        return (capacity_tokens, num_layers, *slot)
    if capacity_tokens % page_size:
        raise ValueError(f"{capacity_tokens} slots is not a whole number of {page_size}-slot "
                         f"pages")
    return (capacity_tokens // page_size, num_layers, page_size, *slot)


def page_view(buf: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """``buf`` as ``[layers, pages, page_size, *slot]``, sharing its memory."""
    if layout == LAYER_FIRST:
        layers, tokens, *slot = buf.shape
        return buf.view(layers, tokens // page_size, page_size, *slot)
    if layout == PAGE_FIRST:
        tokens, layers, *slot = buf.shape
        rest = tuple(range(3, 3 + len(slot)))
        return buf.view(tokens // page_size, page_size, layers, *slot).permute(2, 0, 1, *rest)
    if layout == PAGE_FIRST_DIRECT:
        rest = tuple(range(3, buf.dim()))
        return buf.permute(1, 0, 2, *rest)
    check_layout(layout)
    raise AssertionError  # unreachable: check_layout raised


def page_block(buf: torch.Tensor, layout: str, page: int, page_size: int) -> torch.Tensor | None:
    """Every layer of one page as the contiguous block it is in memory (``[page, layers, *slot]``
    for ``page_first``, ``[layers, page, *slot]`` for ``page_first_direct``); None for
    ``layer_first``, where a page is one block per layer."""
    if layout == PAGE_FIRST:
        return buf[page * page_size : (page + 1) * page_size]
    if layout == PAGE_FIRST_DIRECT:
        return buf[page]
    return None


def token_major(layout: str) -> bool:
    """Whether a page's block holds tokens outermost (``[page, layers, ...]``)."""
    return layout == PAGE_FIRST
