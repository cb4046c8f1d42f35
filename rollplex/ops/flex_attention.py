"""Packed training attention in one FlexAttention call per layer, whatever the number of segments.

The torch path (rollplex.ops.attention) runs one SDPA call per distinct (query length,
key length) of the segments: with RL-length responses nearly every response is its own
call, and its backward sums many gathered key copies back with index_put. FlexAttention
takes the whole packed batch as one sequence and a block-sparse mask of which query
attends which key row, so a layer is one kernel call and the keys are read where they
lie (no gather, so no accumulating scatter in the backward).

Every layout is one mask kind: each query token reads the key rows of two half-open
intervals of its own, [lo, hi) and [second_lo, second_hi) (`_in_either_interval`). A
packed segment reads [segment start, own row + 1) when causal, the whole segment when
not, and nothing from the second; a prefixed segment its prefix rows, then its own rows
up to the query's. The four per-query-token tensors are the mask's data, bound to the one
module-level mask function by `functools.partial`, so the compiled call sees them as
graph inputs: a new micro-batch is new input data and new sizes, not new code.

The masks are built once per micro-batch, from host lists, when `FlexPacked` /
`FlexPrefixed` are made, without a host wait, and no layer reads anything back. The
block mask is computed from the intervals (`_block_mask`), not by create_block_mask,
whose (queries, keys) grid is quadratic in memory; it uses torch's private
`_create_sparse_block_from_block_mask` (same in torch 2.11 and 2.13), and the tests
check it equals create_block_mask's. On CUDA the call goes through
`compile_flex_attention()` (eager FlexAttention materialises the scores); on CPU eager
FlexAttention runs the forward only: torch has no FlexAttention backward there.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx.experimental._config as fx_config
from torch.nn.attention.flex_attention import (BlockMask, _create_sparse_block_from_block_mask,
                                               flex_attention)

from rollplex.device import to_device

if TYPE_CHECKING:
    from rollplex.ops.attention import QuerySegment

_compiled: Callable[..., torch.Tensor] | None = None
_BLOCK = 128  # FlexAttention's default sparse block size


def compile_flex_attention(backend: str | Callable[..., object] = "inductor") -> Callable[..., torch.Tensor]:
    """FlexAttention compiled as every CUDA call runs it (`backend`: a test passes a compile counter).

    Dynamo keeps at most 8 compiled entries for `flex_attention`'s code, shared by every
    call of the process (each mask, grad mode and model), and past that runs eager
    FlexAttention, which materialises the whole score matrix. Each micro-batch has its own
    token and key-row counts, hence its own q/k/v, block-mask and per-token tensor sizes, so:
    - dynamic=True: sizes are symbolic from the first compile. Left static (the default),
      dynamo compiles once for the first sizes and again, dynamic, at the next.
    - no duck sizing: dynamo would tie two sizes that happen to be equal at the first compile
      (queries and key rows, always equal in a packed batch, never with kept prompt rows;
      query and key blocks) into one symbol, and compile again when they differ.
    Sizes 0 and 1 stay specialised whatever the settings: a micro-batch whose queries fit one
    128-token block compiles once more (once with its key rows in one block too, once with
    them in more: key rows are never fewer than queries), and one of a single query token
    again. Grad mode is guarded on: training and no-grad passes have entries of their own."""
    compiled = torch.compile(flex_attention, backend=backend, dynamic=True)

    def without_duck_sizing(*args, **kwargs) -> torch.Tensor:
        # Read when dynamo traces a call (a new entry), not when it runs a compiled one.
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)
    return without_duck_sizing


def _kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The compiled FlexAttention on CUDA (compiled once, on first use), eager elsewhere."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = compile_flex_attention()
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


def _in_either_interval(lo: torch.Tensor, hi: torch.Tensor, second_lo: torch.Tensor, second_hi: torch.Tensor,
                        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """The mask of every layout: query `q_idx` reads key row `kv_idx` when the row is in
    [lo, hi) or [second_lo, second_hi) of that query (its tensors are read at the query's
    index only: no per-key load, as a segment-id mask needs)."""
    return (((kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx]))
            | ((kv_idx >= second_lo[q_idx]) & (kv_idx < second_hi[q_idx])))


def _block_mask(intervals: list[tuple[torch.Tensor, torch.Tensor]], kv_len: int) -> BlockMask:
    """The block mask of queries reading the key rows of two disjoint half-open `intervals`
    (lo, hi), each a (queries,) tensor (an interval may be empty: lo == hi). create_block_mask
    would evaluate the mask over the whole (queries, keys) grid (quadratic memory: ~5 GB at
    22k tokens); here each query's count of allowed keys per key block is summed per query
    block instead, and a block is full, partial or skipped as create_block_mask decides it."""
    (lo, hi), (second_lo, second_hi) = intervals
    q_len, device = lo.shape[0], lo.device
    block = _BLOCK
    starts = torch.arange(0, kv_len, block, device=device, dtype=torch.int32)
    counts = sum((torch.minimum(end[:, None], starts + block) - torch.maximum(begin[:, None], starts)).clamp_(min=0)
                 for begin, end in intervals)
    q_blocks = -(-q_len // block)
    counts = torch.nn.functional.pad(counts, (0, 0, 0, q_blocks * block - q_len))
    per_block = counts.view(q_blocks, block, -1).sum(1)[None, None]
    full = per_block == block * block
    partial = (per_block > 0) & ~full
    mask_mod = functools.partial(_in_either_interval, lo, hi, second_lo, second_hi)
    return _create_sparse_block_from_block_mask((partial.to(torch.int8), full.to(torch.int8)), mask_mod,
                                                (q_len, kv_len), block, block)


class FlexPacked:
    """Each segment of packed sequences attends only to itself: causal for text (its rows
    from the segment's start to the query's own), whole for vision windows."""

    def __init__(self, cu_seqlens: list[int], causal: bool, device: torch.device):
        tokens = cu_seqlens[-1]
        lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
        lo = to_device([a for a, n in zip(cu_seqlens, lengths) for _ in range(n)], device, torch.int32)
        hi = (torch.arange(1, tokens + 1, device=device, dtype=torch.int32) if causal else
              to_device([a + n for a, n in zip(cu_seqlens, lengths) for _ in range(n)], device, torch.int32))
        # Two tensors, not one twice: the compiled call would guard on the aliasing, which a prefixed mask lacks.
        nothing = (torch.zeros(tokens, device=device, dtype=torch.int32),
                   torch.zeros(tokens, device=device, dtype=torch.int32))
        self.block_mask = _block_mask([(lo, hi), nothing], tokens)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v, self.block_mask)


class FlexPrefixed:
    """Query segments over their prefix key rows then, causally, their own key rows
    (rollplex.ops.attention.QuerySegment), from four per-query-token tensors: the prefix
    rows [lo, hi) and the own rows [own_lo, own_row + 1), own_row being the query's own key row.
    K/V are the rows the segments index as they are (SharedPrefixAttention: the batch;
    KeptPrefixAttention: [kept prompt rows | batch rows])."""

    def __init__(self, segments: list[QuerySegment], device: torch.device):
        per_token: list[list[int]] = [[], [], [], []]
        for s in segments:
            own = s.own_keys_offset + s.start
            for column, value in zip(per_token, (s.prefix_start, s.prefix_start + s.prefix_len, own)):
                column.extend(itertools.repeat(value, s.length))
            per_token[3].extend(range(own + 1, own + s.length + 1))
        lo, hi, own_lo, own_end = (to_device(c, device, torch.int32) for c in per_token)
        key_rows = max(max(s.prefix_start + s.prefix_len, s.own_keys_offset + s.start + s.length) for s in segments)
        self.block_mask = _block_mask([(lo, hi), (own_lo, own_end)], key_rows)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(q, k, v, self.block_mask)
