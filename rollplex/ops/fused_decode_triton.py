"""Fused Triton kernels of a decoder layer's no-grad forward in the engine.

A decode step's layer, op by op in torch, is ~47 aten ops; at a decode batch each is
a small memory-bound kernel, so launches, not arithmetic, set its time (and the
length of the CUDA graph replayed). `FusedLayerOps` runs the layer's elementwise
work in four kernels, with the signatures of the reference ops
(rollplex.models.qwen_vl.layers.TorchLayerOps):

- `rms_norm` / `add_rms_norm`: one program per token reads its row once, adds the
  residual (in the input dtype, rounded as torch's add) and writes the sum, then
  normalises in float32 and scales in the input dtype, as the RMSNorm module does;
- `silu_mul`: silu(gate) * up, each rounded to the input dtype as torch rounds it;
- `add_linear`: residual + linear(x) as one GEMM accumulating into the residual
  (`addmm_`, beta = 1: cuBLAS's epilogue adds it), when the Linear is a plain one
  without a bias or hooks (tensor-parallel modules have hooks: they keep their call
  and an add);
- `rotary_store`: Qwen3's per-head q/k RMSNorm where the model has it, the rotary
  of q and k (in place: prefill's attention reads them) and the write of k and v at
  their pool slots, one program per token.

What differs from the torch ops is rounding only: the rotary and the GEMM's add are
computed in float32 and rounded once, not after each op. No autograd: the engine
uses them under no_grad (`PagedAttention.layer_ops`), never the trainer. Shapes are
static and nothing reads the device, so a CUDA graph captures them.

`fused_decode_enabled` is the switch: ROLLPLEX_FUSED_DECODE=0 turns it off (the torch
ops everywhere), =1 asks for it (on CPU only in Triton's interpreter,
TRITON_INTERPRET=1, as the tests run it); unset, it is on where Triton runs on CUDA.

Triton is optional: this module imports without it, and the kernels are built on
the first call (tests/fused_decode_triton_cases.py runs them in the interpreter).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from rollplex.dist import local_tensor
from rollplex.ops.paged_decode_triton import _next_pow2, _patch_interpreter_index, triton_available


def fused_decode_enabled(device: torch.device | str) -> bool:
    """Whether the engine's model calls on `device` use `FusedLayerOps` (see the module docstring)."""
    flag = os.environ.get("ROLLPLEX_FUSED_DECODE")
    if flag == "0" or not triton_available(device):
        return False
    return flag == "1" or torch.device(device).type == "cuda"


@functools.cache
def _kernels():
    """The kernels, imported on first use (so importing this module never needs triton)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_interpreter_index()
    from rollplex.ops import fused_decode_triton_kernels as k

    return k.rms_norm_kernel, k.silu_mul_kernel, k.rotary_store_kernel


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x as a plain tensor a kernel can read: a tensor-parallel layer's output arrives
    wrapped (an AsyncCollectiveTensor of its all-reduce: waited for here), a weight
    as a replicated DTensor (its local tensor)."""
    if isinstance(x, AsyncCollectiveTensor):
        x = x.wait()
    return local_tensor(x)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (rows, features) with unit stride along features (a view where it can be)."""
    x = _plain(x)
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm(x + residual) with its weight, and x + residual (None without a residual)."""
    norm_kernel, _, _ = _kernels()
    x2 = _rows(x)
    n = x2.shape[1]
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x2), device=x2.device)
    r2 = x2 if residual is None else _rows(residual)
    total = None if residual is None else torch.empty_like(x2)
    s2 = out if total is None else total
    block = max(16, _next_pow2(n))
    if x2.shape[0]:
        norm_kernel[(x2.shape[0],)](x2, r2, weight, out, s2, n, float(eps), x2.stride(0), r2.stride(0),
                                    out.stride(0), s2.stride(0), ADD=residual is not None, BLOCK=block,
                                    num_warps=4 if block <= 1024 else 8)
    return out.view(x.shape), None if total is None else total.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    _, silu_kernel, _ = _kernels()
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape, dtype=torch.result_type(gate, up), device=g2.device)
    block = 1024
    if g2.shape[0]:
        silu_kernel[(g2.shape[0], -(-g2.shape[1] // block))](g2, u2, out, g2.shape[1], g2.stride(0), u2.stride(0),
                                                             out.stride(0), BLOCK=block, num_warps=4)
    return out.view(gate.shape)


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 qk_norm: tuple[nn.Module, nn.Module] | None = None) -> None:
    """Rotate q and k (tokens, heads, head_dim) in place by cos/sin (tokens, head_dim), as
    rollplex.models.rope.apply_rotary does, and write k and v at their flat slots of
    k_cache / v_cache (blocks, block_size, kv_heads, head_dim), as kv_cache.store_kv does.
    With `qk_norm` (Qwen3's q_norm and k_norm RMSNorms over head_dim), each head is
    normalised first, as those modules do (their TP plan's hooks are not needed here:
    the weight is whole on every rank)."""
    *_, rotary_kernel = _kernels()
    if qk_norm is None:
        q_weight = k_weight = q
        eps = 0.0
    else:
        q_weight, k_weight = (local_tensor(n.weight) for n in qk_norm)
        eps = float(qk_norm[0].eps)
        if qk_norm[1].eps != qk_norm[0].eps:
            raise ValueError(f"q_norm and k_norm eps differ ({qk_norm[0].eps}, {qk_norm[1].eps})")
    tokens, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary_store needs {name} with unit stride along head_dim, got {t.stride()}")
    if tokens == 0:
        return
    rotary_kernel[(tokens,)](
        q, k, v, cos, sin, slot_mapping, k_cache, v_cache, q_weight, k_weight, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, Q_PAD=_next_pow2(q_heads), KV_PAD=_next_pow2(kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, _next_pow2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        # One program holds a token's q heads x head_dim: 8 warps past 32 x 128 (72B's 64 q heads in
        # float32 took 226 registers with 4).
        NORM=qk_norm is not None, num_warps=4 if _next_pow2(q_heads) * head_dim <= 4096 else 8)


def _plain_linear(linear: nn.Module) -> bool:
    """A bias-free nn.Linear whose call is its weight alone: no hooks (a tensor-parallel
    plan's, a profiler's) that addmm_ would skip, and a plain tensor weight."""
    return (type(linear) is nn.Linear and linear.bias is None and not linear._forward_hooks
            and not linear._forward_pre_hooks and type(linear.weight.data) is torch.Tensor)


class FusedLayerOps:
    """The decoder layer's ops as fused kernels, with the signatures of
    rollplex.models.qwen_vl.layers.TorchLayerOps (norms passed as their modules: their
    weight, whole on every rank, and eps are read)."""

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return rms_norm(x, local_tensor(norm.weight), norm.eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, local_tensor(norm.weight), norm.eps, residual)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate, up)

    def add_linear(self, residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        """residual + linear(x); `residual` (a temporary of the layer) is overwritten."""
        if _plain_linear(linear):
            return residual.view(-1, residual.shape[-1]).addmm_(x.view(-1, x.shape[-1]),
                                                                 linear.weight.t()).view(residual.shape)
        return residual.add_(linear(x))


FUSED_OPS = FusedLayerOps()
