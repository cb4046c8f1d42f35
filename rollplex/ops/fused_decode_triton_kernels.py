"""The Triton kernels of rollplex.ops.fused_decode_triton (see its docstring), in a
module of their own: it imports triton, and `_norm_rotate`, a helper the rotary kernel
calls, must be a module global for Triton to find it. Imported on first use only."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, eps,
                    stride_x, stride_r, stride_o, stride_s,
                    ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if ADD:
        # Added in float32 and rounded to the input dtype: torch's add, bit for bit.
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        total = (xf + r.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + offs, total, mask=mask)
        xf = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)  # normalised in float32, cast to the input dtype
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # silu rounded as torch rounds it
    tl.store(out_ptr + row * stride_o + offs, (s * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rotate(row_ptr, mask, d, partner, sign, cos, sin, w_ptr, eps,
                 HEAD_DIM: tl.constexpr, NORM: tl.constexpr):
    """Rows row_ptr[head, :] (optionally RMS-normalised per head, then scaled by w, each
    rounded to the input dtype as the RMSNorm module rounds it) rotated, in the input dtype."""
    x = tl.load(row_ptr + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    xp = tl.load(row_ptr + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        dmask = d < HEAD_DIM
        w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)[None, :]
        xf = (w * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        xp = (wp * (xp * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    return (xf * cos[None, :] + sign[None, :] * xp * sin[None, :]).to(x.dtype)


@triton.jit
def rotary_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, eps,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ct, stride_st,
                        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                        Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                        KV_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    dmask = d < HEAD_DIM
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)  # rotate_half: (-x2, x1)
    sign = tl.where(d < half, -1.0, 1.0)
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + d, mask=dmask, other=0.0).to(tl.float32)

    hq = tl.arange(0, Q_PAD)[:, None]
    mq = (hq < Q_HEADS) & dmask[None, :]
    q_row = q_ptr + t * stride_qt + hq * stride_qh
    q = _norm_rotate(q_row, mq, d, partner, sign, cos, sin, qw_ptr, eps, HEAD_DIM, NORM)
    tl.store(q_row + d[None, :], q, mask=mq)

    hk = tl.arange(0, KV_PAD)[:, None]
    mk = (hk < KV_HEADS) & dmask[None, :]
    k_row = k_ptr + t * stride_kt + hk * stride_kh
    k = _norm_rotate(k_row, mk, d, partner, sign, cos, sin, kw_ptr, eps, HEAD_DIM, NORM)
    tl.store(k_row + d[None, :], k, mask=mk)
    v = tl.load(v_ptr + t * stride_vt + hk * stride_vh + d[None, :], mask=mk, other=0.0)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    tl.store(kc_ptr + block * stride_kcb + offset * stride_kcs + hk * stride_kch + d[None, :],
             k.to(kc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc_ptr + block * stride_vcb + offset * stride_vcs + hk * stride_vch + d[None, :],
             v.to(vc_ptr.dtype.element_ty), mask=mk)
