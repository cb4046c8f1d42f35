"""Packed training attention in one FlexAttention call per layer, whatever the number of segments.

The torch path (rollplex.ops.attention) runs one SDPA call per distinct (query length,
key length) of the segments: with RL-length responses nearly every response is its own
call, and its backward sums many gathered key copies back with index_put. FlexAttention
takes the whole packed batch as one sequence and a block-sparse mask of which query
attends which key row, so a layer is one kernel call and the keys are read where they
lie (no gather, so no accumulating scatter in the backward).

The masks are built once per micro-batch, from host lists, when `FlexPacked` /
`FlexPrefixed` are made, without a host wait, and no layer reads anything back. The
block mask is computed from the key intervals each query reads (`_block_mask`), not by
create_block_mask, whose (queries, keys) grid is quadratic in memory; it uses torch's
private `_create_sparse_block_from_block_mask` (same in torch 2.11 and 2.13), and the
tests check it equals create_block_mask's. On CUDA the call goes through
`torch.compile(flex_attention)` (eager FlexAttention materialises the scores); on CPU
eager FlexAttention runs the forward only: torch has no FlexAttention backward there.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn.attention.flex_attention import (BlockMask, _create_sparse_block_from_block_mask,
                                               flex_attention)

from rollplex.device import to_device

if TYPE_CHECKING:
    from rollplex.ops.attention import QuerySegment

_compiled: Callable[..., torch.Tensor] | None = None
_BLOCK = 128  # FlexAttention's default sparse block size


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The compiled FlexAttention on CUDA (compiled once, on first use), eager elsewhere."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q: (tokens, q_heads, dim); k/v: (key rows, kv_heads, dim) -> (tokens, q_heads, dim)."""
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise RuntimeError("attn_backend 'flex' has no backward on CPU (torch's FlexAttention runs only the "
                               "forward there): use attn_backend 'torch' to train on CPU")
        q, k, v = q.detach(), k.detach(), v.detach()  # torch refuses inputs that require grad even under no_grad
    out = _kernel(q.device)(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


def _block_mask(intervals: list[tuple[torch.Tensor, torch.Tensor]], mask_mod: Callable[..., torch.Tensor],
                kv_len: int) -> BlockMask:
    """The block mask of `mask_mod`, computed from what it allows: per query token, the key
    rows of disjoint half-open `intervals` (lo, hi), each a (queries,) tensor. create_block_mask
    would evaluate `mask_mod` over the whole (queries, keys) grid (quadratic memory: ~5 GB at
    22k tokens); here each query's count of allowed keys per key block is summed per query
    block instead, and a block is full, partial or skipped as create_block_mask decides it."""
    q_len, device = intervals[0][0].shape[0], intervals[0][0].device
    block = _BLOCK
    starts = torch.arange(0, kv_len, block, device=device, dtype=torch.int32)
    counts = sum((torch.minimum(hi[:, None], starts + block) - torch.maximum(lo[:, None], starts)).clamp_(min=0)
                 for lo, hi in intervals)
    q_blocks = -(-q_len // block)
    counts = torch.nn.functional.pad(counts, (0, 0, 0, q_blocks * block - q_len))
    per_block = counts.view(q_blocks, block, -1).sum(1)[None, None]
    full = per_block == block * block
    partial = (per_block > 0) & ~full
    return _create_sparse_block_from_block_mask((partial.to(torch.int8), full.to(torch.int8)), mask_mod,
                                                (q_len, kv_len), block, block)


class FlexPacked:
    """Each segment of packed sequences attends only to itself (causal for text, full for
    vision windows): a document mask over the segment id of every token."""

    def __init__(self, cu_seqlens: list[int], causal: bool, device: torch.device):
        tokens = cu_seqlens[-1]
        lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        doc = to_device([i for i, n in enumerate(lengths) for _ in range(n)], device, torch.int32)
        lo = to_device([a for a, n in zip(cu_seqlens, lengths) for _ in range(n)], device, torch.int32)
        hi = (torch.arange(1, tokens + 1, device=device, dtype=torch.int32) if causal else
              to_device([a + n for a, n in zip(cu_seqlens, lengths) for _ in range(n)], device, torch.int32))

        def same_segment(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        def causal_same_segment(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        mask = causal_same_segment if causal else same_segment
        self.block_mask = _block_mask([(lo, hi)], mask, tokens)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v, self.block_mask)


class FlexPrefixed:
    """Query segments over their prefix key rows then, causally, their own key rows
    (rollplex.ops.attention.QuerySegment), from four per-query-token tensors: the prefix
    rows [lo, hi) and the own rows [own_lo, own_row], own_row being the query's own key row.
    K/V are the rows the segments index as they are (SharedPrefixAttention: the batch;
    KeptPrefixAttention: [kept prompt rows | batch rows])."""

    def __init__(self, segments: list[QuerySegment], device: torch.device):
        per_token: list[list[int]] = [[], [], [], []]
        for s in segments:
            own = s.own_keys_offset + s.start
            for column, value in zip(per_token, (s.prefix_start, s.prefix_start + s.prefix_len, own)):
                column.extend(itertools.repeat(value, s.length))
            per_token[3].extend(range(own, own + s.length))
        lo, hi, own_lo, own_row = (to_device(c, device, torch.int32) for c in per_token)
        key_rows = max(max(s.prefix_start + s.prefix_len, s.own_keys_offset + s.start + s.length) for s in segments)

        def prefix_or_own(b, h, q_idx, kv_idx):
            return ((kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])) | (
                (kv_idx >= own_lo[q_idx]) & (kv_idx <= own_row[q_idx]))

        self.block_mask = _block_mask([(lo, hi), (own_lo, own_row + 1)], prefix_or_own, key_rows)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v, self.block_mask)
