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
block table), so `tl.dot` always sees at least 16 keys.

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
        q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, lse_ptr,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kt, stride_kh, stride_kd,
        stride_vb, stride_vt, stride_vh, stride_vd,
        stride_btb, stride_btn,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh, stride_ls,
        qk_scale,  # softmax scale * log2(e)
        tiles_per_split,  # partition length in tiles of TILE_N tokens
        max_context,  # max_blocks * block_size: longer context_lens are clamped, as in the torch path
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        SPLIT: tl.constexpr, FP32_DOT: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_n = tl.arange(0, TILE_N)
        mask_g = offs_g < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g

        ctx_len = tl.minimum(tl.load(lens_ptr + seq), max_context)
        start_tile = split * tiles_per_split
        end_tile = tl.minimum(start_tile + tiles_per_split, tl.cdiv(ctx_len, TILE_N))

        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0)

        # Finite start for the running max: a partition with no valid key keeps
        # m = -1e30 and l = 0 without ever computing (-inf) - (-inf).
        m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

        k_base = k_ptr + kvh * stride_kh
        v_base = v_ptr + kvh * stride_vh
        bt_row = bt_ptr + seq * stride_btb
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
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])
        if SPLIT:
            # log2-sum-exp2 of the scaled scores; -inf for an empty partition.
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=mask_g)

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
        part = tl.load(part_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                       + offs_d[None, :] * stride_pd, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
        out = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=mask_d)

    return _paged_decode_kernel, _merge_splits_kernel


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter mode: pretend to be an H100/H200, so split-K paths get exercised


def _tile_n(block_size: int, head_dim_pad: int) -> int:
    """Keys per tile: >= 16 for tl.dot, smaller for wide heads to keep K/V tiles in registers."""
    return 64 if head_dim_pad <= 128 else 32


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
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or q_heads % kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} does not fit a KV cache of {kv_heads} heads x {kv_dim}")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
                         f"do not match batch {batch}")
    decode_kernel, merge_kernel = _kernels()

    group = q_heads // kv_heads
    group_pad = max(16, _next_pow2(group))  # tl.dot needs >= 16 rows
    head_dim_pad = max(16, _next_pow2(head_dim))
    tile_n = _tile_n(block_size, head_dim_pad)
    max_context = block_tables.shape[1] * block_size
    max_tiles = max(1, math.ceil(max_context / tile_n))
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max_context, tile_n, _sm_count(q.device))
    num_splits = max(1, min(int(num_splits), max_tiles))
    tiles_per_split = math.ceil(max_tiles / num_splits)
    num_splits = math.ceil(max_tiles / tiles_per_split)  # no partition starts past the table

    scale = head_dim ** -0.5 if scale is None else float(scale)
    qk_scale = scale * 1.4426950408889634  # log2(e): the kernel uses exp2
    fp32_dot = q.dtype == torch.float32
    out = torch.empty_like(q)
    if batch == 0:
        return out
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                  BLOCK_SIZE=block_size, TILE_N=tile_n, FP32_DOT=fp32_dot, num_warps=4)
    kv_strides = (*k_cache.stride(), *v_cache.stride())
    bt_strides = block_tables.stride()

    if num_splits == 1:
        decode_kernel[(batch, kv_heads, 1)](
            q, k_cache, v_cache, block_tables, context_lens, out, out,
            *q.stride(), *kv_strides, *bt_strides,
            out.stride(0), out.stride(1), 0, out.stride(2),
            0, 0, 0,
            qk_scale, tiles_per_split, max_context, SPLIT=False, **common)
        return out

    part = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part, lse,
        *q.stride(), *kv_strides, *bt_strides,
        *part.stride(), *lse.stride(),
        qk_scale, tiles_per_split, max_context, SPLIT=True, **common)
    merge_kernel[(batch, q_heads)](
        part, lse, out, *part.stride(), *lse.stride(), *out.stride(),
        NUM_SPLITS=num_splits, SPLITS_PAD=_next_pow2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, num_warps=4)
    return out
