"""Paged decode attention in Triton: one query token per sequence, read from the KV pool in place.

The torch path of `paged_decode_attention` gathers every sequence's whole context
out of the pool on every decode step; flash-attn reads the pages in place but is
not always installed. This kernel is the middle ground for GPUs without
flash-attn. Same shapes and semantics as the torch path:

    q            (batch, q_heads, head_dim)
    k/v_cache    (num_blocks, block_size, kv_heads, head_dim), a per-layer view of
                 the pool: any strides (passed to the kernel), dim 0 usually has a
                 stride larger than block_size * kv_heads * head_dim
    block_tables (batch, max_blocks) int32
    context_lens (batch,) int32, tokens of context including the new one
    -> out       (batch, q_heads, head_dim), dtype of q

One program handles one (sequence, kv head) and all the query heads of its GQA
group at once, so each K/V tile is loaded once per group. Scores and the
softmax run in fp32 (online softmax, exp2); tiles of TILE_N tokens are
independent of the block size (each token's block id is gathered from the
block table), so `tl.dot` always sees at least 16 keys. The same kernel runs the
group-shared prefixes of rollplex/ops/cascade_decode_triton.py, where a program's
entry is a group of rows attending one context (`DecodeLaunch`), and the same
merge combines a row's prefix and tail partitions.

Split-K (flash-decoding): with few sequences and long contexts, (batch x
kv_heads) programs cannot fill the GPU, so the context is also cut into
`num_splits` partitions; each writes a normalised partial output and its
log-sum-exp, and a second kernel merges them. The number of splits depends only
on shapes (and the device's SM count), never on the values in `context_lens`,
so there is no host sync and the call can be captured in a CUDA graph (grid and
scratch sizes are fixed for fixed shapes). Partitions past a sequence's length
do no work.

Triton is optional: this module imports without it; the kernels are built on
the first call. With TRITON_INTERPRET=1 set before triton is imported, the
same kernels run on CPU tensors (that is how the tests and gpu_check's CPU dry
run check them; the interpreter of triton 3.6 under numpy >= 2.4 cannot take the
runtime loop bounds, and `_patch_interpreter_index` gives it the upstream fix).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available(device: torch.device | str | None = None) -> bool:
    """Triton is installed and can run on `device` (CUDA, or any device in interpreter mode)."""
    if not _HAS_TRITON:
        return False
    if device is None:
        return True
    import os

    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _patch_interpreter_index() -> None:
    """Give Triton's interpreter the loop-bound fix of triton-lang/triton#9171.

    The interpreter holds a runtime scalar as a 1-element 1-d numpy array and, before
    that fix (triton 3.6 has it not, 3.9 has it), converted it with int(array) for
    `range(start, end)`; numpy >= 2.4 refuses that ("only 0-dimensional arrays can be
    converted to Python scalars"). The fault is the interpreter's: a runtime loop bound
    is valid Triton and compiles on the GPU, so the kernel is left as it is. Applied
    under the interpreter only, with the upstream fix (a no-op where it is in).
    """
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "index_fixed", False):  # reorganised, or patched already
        return

    def patch_tensor_with_index_fix(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_with_index_fix.index_fixed = True
    interpreter._patch_lang_tensor = patch_tensor_with_index_fix


@functools.cache
def _kernels():
    """Define the Triton kernels (only when first needed, so importing this module never needs triton)."""
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_interpreter_index()

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, members_ptr, out_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_btb, stride_btn,
        stride_mb, stride_mm,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_ls,
        qk_scale,  # softmax scale * log2(e)
        tiles_per_split,  # partition length in tiles of TILE_N tokens
        max_context,  # max_blocks * block_size: longer context_lens are clamped, as in the torch path
        num_members,  # query rows per entry (1 without GATHER_ROWS)
        batch,  # rows of q: a member row at or past it is padding
        GROUP: tl.constexpr, ROWS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        SPLIT: tl.constexpr, FP32_DOT: tl.constexpr, GATHER_ROWS: tl.constexpr,
    ):
        # An entry is one sequence (its row of q), or with GATHER_ROWS a group of
        # q rows that attend the same context (members_ptr[entry]): the tile's
        # rows are (member, query head of this KV head) pairs.
        entry = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        offs_r = tl.arange(0, ROWS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, TILE_N)
        member = offs_r // GROUP
        in_entry = member < num_members
        if GATHER_ROWS:
            rows = tl.load(members_ptr + entry * stride_mb + member * stride_mm, mask=in_entry, other=0).to(tl.int64)
        else:
            rows = tl.zeros([ROWS_PAD], dtype=tl.int64) + entry
        mask_r = in_entry & (rows < batch)
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_r % GROUP

        ctx_len = tl.minimum(tl.load(lens_ptr + entry), max_context)
        start_tile = split * tiles_per_split
        end_tile = tl.minimum(start_tile + tiles_per_split, tl.cdiv(ctx_len, TILE_N))

        q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_r[:, None] & mask_d[None, :], other=0.0)

        # Finite start for the running max: a partition with no valid key keeps
        # m = -1e30 and l = 0 without ever computing (-inf) - (-inf).
        m_i = tl.full([ROWS_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
        acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], dtype=tl.float32)

        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        bt_row = bt_ptr + entry * stride_btb
        for tile in range(start_tile, end_tile):
            pos = tile * TILE_N + offs_n
            valid = pos < ctx_len
            blk = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            kv_mask = valid[:, None] & mask_d[None, :]
            k = tl.load(k_base + blk[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                        mask=kv_mask, other=0.0)
            v = tl.load(v_base + blk[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=kv_mask, other=0.0)
            if FP32_DOT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP32_DOT:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        has_keys = l_i > 0.0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        o_ptrs = (out_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_d[None, :])
        if SPLIT:
            # log2-sum-exp2 of the scaled scores; -inf for an empty partition.
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + rows * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=mask_r)

    @triton.jit
    def _merge_splits_kernel(
        part_ptr, lse_ptr, out_ptr,
        stride_pb, stride_ph, stride_ps, stride_pd,
        stride_lb, stride_lh, stride_ls,
        stride_ob, stride_oh, stride_od,
        NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask_s = offs_s < NUM_SPLITS
        mask_d = offs_d < HEAD_DIM
        lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + offs_s * stride_ls, mask=mask_s,
                      other=float("-inf"))
        m = tl.maximum(tl.max(lse, axis=0), -1.0e30)  # finite even when every partition is empty
        w = tl.exp2(lse - m)
        denom = tl.sum(w, axis=0)
        # A partition with lse -inf has weight 0 and may never have been written (the cascade's prefix
        # partitions of a row in no group): its output is not read, so garbage there cannot poison the sum.
        written = mask_s & (lse > float("-inf"))
        part = tl.load(part_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                       + offs_d[None, :] * stride_pd, mask=written[:, None] & mask_d[None, :], other=0.0)
        out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=mask_d)

    return _paged_decode_kernel, _merge_splits_kernel


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter mode: pretend to be an H100/H200, so split-K paths get exercised


def _tile_and_warps(rows_pad: int, head_dim_pad: int, fp32: bool) -> tuple[int, int]:
    """Keys per tile (>= 16 for tl.dot) and warps of a program. Its query tile and float32
    accumulator (rows x head_dim) stay in registers across the key loop, so the larger
    they are, the shorter the key tile and the more warps share them; float32 queries
    count double. Chosen by registers measured offline for sm_90 (tools/compile_kernels.py,
    triton 3.6): at most ~190 per thread and no spill at head_dim 128 and 256, bf16 and
    float32, for a plain row (16 tile rows) and a cascade group (64); the cascade's 64 x 128
    bf16 tile took 245 registers with 4 warps, 160 with 8."""
    cells = rows_pad * head_dim_pad * (2 if fp32 else 1)
    tile_n = 64 if head_dim_pad <= 128 and cells <= 8192 else 32 if cells <= 16384 else 16
    return tile_n, 4 if cells <= 4096 else 8 if cells <= 16384 else 16


def default_num_splits(batch: int, kv_heads: int, max_context: int, tile_n: int, sm_count: int) -> int:
    """Partitions per sequence, from shapes only (CUDA-graph safe).

    No split when (batch x kv_heads) programs already cover the SMs or the
    context is short; otherwise enough partitions to fill the GPU about twice,
    each at least 4 tiles long, at most 64.
    """
    programs = batch * kv_heads
    if programs >= sm_count:
        return 1
    max_tiles = math.ceil(max_context / tile_n)
    by_length = max(1, max_tiles // 4)
    by_occupancy = math.ceil(2 * sm_count / programs)
    return max(1, min(by_length, by_occupancy, 64))


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch of the decode kernel, planned from shapes only (so a CUDA graph can
    replay it): its tile, and the partitions each entry's context is cut into.

    An entry is a sequence, whose row of q attends its context, or with `members`
    a group of q rows that all attend one context (the cascade's shared prefix):
    the group's rows x the query heads of a KV head are the M dimension of one
    tl.dot, so each K/V tile is read once for all of them."""

    num_splits: int
    tiles_per_split: int
    tile_n: int
    rows_pad: int
    head_dim_pad: int
    num_warps: int

    @classmethod
    def plan(cls, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, num_members: int = 1,
             num_splits: int | None = None, busy_entries: int | None = None) -> DecodeLaunch:
        """`num_splits` defaults to `default_num_splits` for `busy_entries` entries
        with work (default: every row of block_tables)."""
        q_heads, head_dim = q.shape[1:]
        block_size, kv_heads = k_cache.shape[1:3]
        rows_pad = max(16, _next_pow2(num_members * (q_heads // kv_heads)))  # tl.dot needs >= 16 rows
        head_dim_pad = max(16, _next_pow2(head_dim))
        tile_n, num_warps = _tile_and_warps(rows_pad, head_dim_pad, q.dtype == torch.float32)
        max_context = block_tables.shape[1] * block_size
        max_tiles = max(1, math.ceil(max_context / tile_n))
        if num_splits is None:
            entries = block_tables.shape[0] if busy_entries is None else busy_entries
            num_splits = default_num_splits(max(1, entries), kv_heads, max_context, tile_n, _sm_count(q.device))
        num_splits = max(1, min(int(num_splits), max_tiles))
        tiles_per_split = math.ceil(max_tiles / num_splits)
        num_splits = math.ceil(max_tiles / tiles_per_split)  # no partition starts past the table
        return cls(num_splits, tiles_per_split, tile_n, rows_pad, head_dim_pad, num_warps)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, scale: float,
                 members: torch.Tensor | None = None) -> None:
        """Entry i's queries (q[i], or the rows members[i]; those >= len(q) are padding)
        over the first context_lens[i] tokens of block_tables[i]. With `lse`, partition s
        of a row's head writes its normalised output to out[row, head, s] and its
        log2-sum-exp to lse[row, head, s]; without, out[row, head, 0] is the result
        (one partition)."""
        decode_kernel, _ = _kernels()
        batch, q_heads, head_dim = q.shape
        block_size, kv_heads = k_cache.shape[1:3]
        gather = members is not None
        decode_kernel[(block_tables.shape[0], kv_heads, self.num_splits)](
            q, k_cache, v_cache, block_tables, context_lens, members if gather else context_lens, out,
            out if lse is None else lse,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            *(members.stride() if gather else (0, 0)), *out.stride(), *((0, 0, 0) if lse is None else lse.stride()),
            scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
            self.tiles_per_split, block_tables.shape[1] * block_size, members.shape[1] if gather else 1, batch,
            GROUP=q_heads // kv_heads, ROWS_PAD=self.rows_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=self.head_dim_pad,
            BLOCK_SIZE=block_size, TILE_N=self.tile_n, SPLIT=lse is not None, FP32_DOT=q.dtype == torch.float32,
            GATHER_ROWS=gather, num_warps=self.num_warps)


def merge_partitions(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """out[row, head] = the partitions part[row, head, s] weighted by their share of the
    softmax, 2 ** lse[row, head, s] (a partition with lse -inf is skipped, never read)."""
    _, merge_kernel = _kernels()
    num_splits, head_dim = part.shape[2:]
    splits_pad, head_dim_pad = _next_pow2(num_splits), max(16, _next_pow2(head_dim))
    # All partitions of a head are loaded at once: 4 warps up to 64 x 128 of them, more past it (the
    # cascade's 96 partitions at head_dim 256 spilled with 4).
    num_warps = min(16, max(4, splits_pad * head_dim_pad // 2048))
    merge_kernel[tuple(out.shape[:2])](
        part, lse, out, *part.stride(), *lse.stride(), *out.stride(),
        NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        num_warps=num_warps)


def check_decode_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    q_heads, head_dim = q.shape[1:]
    kv_heads, kv_dim = k_cache.shape[2:]
    if kv_dim != head_dim or q_heads % kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit a KV cache of {kv_heads} heads x {kv_dim}")


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its paged context, reading the pool in place.

    Shapes and semantics as `rollplex.ops.attention.paged_decode_attention`'s torch
    path (see the module docstring); `scale` defaults to head_dim ** -0.5.
    `num_splits` (partitions of the context, merged by log-sum-exp) defaults to
    a shape-only heuristic; 1 is the plain one-pass kernel. No host sync.
    """
    check_decode_shapes(q, k_cache, v_cache)
    batch, q_heads, head_dim = q.shape
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
                         f"do not match batch {batch}")
    launch = DecodeLaunch.plan(q, k_cache, block_tables, num_splits=num_splits)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if launch.num_splits == 1:
        launch(q, k_cache, v_cache, block_tables, context_lens, out[:, :, None], None, scale)
        return out
    part = torch.empty(batch, q_heads, launch.num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, launch.num_splits, dtype=torch.float32, device=q.device)
    launch(q, k_cache, v_cache, block_tables, context_lens, part, lse, scale)
    merge_partitions(part, lse, out)
    return out
