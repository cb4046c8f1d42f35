"""Kernel cases for the fused decode-layer kernels (rollplex.ops.fused_decode_triton)
against the torch reference ops, the engine on the fused path against the torch path,
and the launch count of one fused decode layer.

Not collected by pytest directly: tests/test_fused_decode.py runs this file in a fresh
process, with TRITON_INTERPRET=1 on CPU (the variable only works when set before
triton is first imported), or compiled on a CUDA machine.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams, kv_cache
from rollplex.models import Prompt, build_model
from rollplex.models.qwen2_5_vl import tiny_args
from rollplex.models.qwen3_vl.args import tiny_args as qwen3_tiny_args
from rollplex.models.qwen_vl.layers import TORCH_OPS, RMSNorm
from rollplex.models.rope import MRotaryEmbedding, apply_rotary
from rollplex.config import LoRAConfig
from rollplex.ops import fused_decode_triton as fdt
from rollplex.train.lora import LoRALinear, apply_lora
from test_model import IMG, VEND, VSTART

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_decode_layer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 on CPU (see tests/test_fused_decode.py)")
DTYPES = [torch.float32, torch.bfloat16]
# Within rounding: fp32 to reduction order, bf16 to about one rounding of the output.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 200])
def test_add_rms_norm_and_rms_norm(dtype, width):
    norm = RMSNorm(width, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(width, seed=3) + 1)
    x, residual = randn(5, width, dtype=dtype, seed=1), randn(5, width, dtype=dtype, seed=2) * 4
    want, want_sum = TORCH_OPS.add_rms_norm(x, residual, norm)
    got, got_sum = fdt.FUSED_OPS.add_rms_norm(x, residual, norm)
    assert got.dtype == want.dtype and got_sum.dtype == want_sum.dtype
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got_sum, want_sum)  # one add in the input dtype, as torch's
    else:  # the interpreter casts float32 to bf16 by truncation, not to nearest as the GPU does
        torch.testing.assert_close(got_sum, want_sum, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(fdt.FUSED_OPS.rms_norm(x, norm), TORCH_OPS.rms_norm(x, norm), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate = randn(3, 1500, dtype=dtype, seed=4) * 3  # 1500: a partial last block
    up = randn(3, 3000, dtype=dtype, seed=5)[:, 1000:2500]  # rows with a stride of their own
    got = fdt.FUSED_OPS.silu_mul(gate, up)
    torch.testing.assert_close(got, TORCH_OPS.silu_mul(gate, up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,qk_norm", [(4, 2, 16, False), (4, 2, 24, True),
                                                              (16, 2, 128, False), (16, 8, 128, True)])
def test_rotary_store(dtype, heads, kv_heads, head_dim, qk_norm):
    """q and k rotated as apply_rotary rotates them (in place; with `qk_norm`, after Qwen3's
    per-head RMSNorm modules), k and v written at their slots of one layer of a pool,
    every other slot and layer untouched."""
    tokens, block_size, blocks, layers = 5, 4, 6, 2
    pool = randn(layers, 2, blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=6)
    before = pool.clone()
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    slots = torch.tensor([3, 9, 10, 17, 22], device=DEVICE)
    # cos/sin as a decode step reads them: rows of the text table, cos | sin halves of each row.
    section = [head_dim // 8, head_dim // 8, head_dim // 2 - head_dim // 4]
    table = MRotaryEmbedding(head_dim, 10000.0, section).text_table(64, torch.device(DEVICE), dtype)
    cos, sin = table[torch.tensor([0, 7, 8, 30, 63], device=DEVICE)].chunk(2, dim=-1)
    q = randn(tokens, heads, head_dim, dtype=dtype, seed=7)
    k, v = randn(tokens, kv_heads, head_dim, dtype=dtype, seed=8), randn(tokens, kv_heads, head_dim, dtype=dtype,
                                                                           seed=9)
    norms = None
    if qk_norm:
        norms = tuple(RMSNorm(head_dim).to(DEVICE, dtype) for _ in range(2))
        with torch.no_grad():
            for i, n in enumerate(norms):
                n.weight.copy_(randn(head_dim, seed=12 + i) + 1)
    with torch.no_grad():
        nq, nk = (q, k) if norms is None else (norms[0](q), norms[1](k))
    # apply_rotary in float32, rounded once as the kernel rounds (in bf16 torch rounds each product, and where
    # the two terms cancel that is several ulps of the result).
    want_q, want_k = (apply_rotary(x.float(), cos.float(), sin.float()).to(dtype) for x in (nq, nk))
    fdt.rotary_store(q, k, v, cos, sin, slots, k_cache, v_cache, norms)
    # In bf16 the normed inputs round (the interpreter truncates) to one ulp of values up to ~8: 2 ** -4.
    tol = dict(atol=0.07, rtol=2e-2) if dtype == torch.bfloat16 and qk_norm else TOL[dtype]
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    flat_k, flat_v = k_cache.reshape(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    written = torch.zeros_like(pool, dtype=torch.bool)
    written[1].view(2, -1, kv_heads, head_dim)[:, slots] = True
    assert torch.equal(pool[~written], before[~written])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_linear(dtype):
    """residual + linear(x): one GEMM accumulating into the residual for a plain Linear;
    a Linear with hooks (a tensor-parallel plan's) keeps its call."""
    linear = torch.nn.Linear(48, 32, bias=False).to(DEVICE, dtype)
    x, residual = randn(6, 48, dtype=dtype, seed=10), randn(6, 32, dtype=dtype, seed=11)
    want = TORCH_OPS.add_linear(residual, x, linear)
    with torch.no_grad():
        torch.testing.assert_close(fdt.FUSED_OPS.add_linear(residual.clone(), x, linear), want, **TOL[dtype])
        calls = []
        handle = linear.register_forward_hook(lambda *_: calls.append(1))
        torch.testing.assert_close(fdt.FUSED_OPS.add_linear(residual.clone(), x, linear), want, **TOL[dtype])
        handle.remove()
        # A LoRA layer is not a plain Linear: its adapter's product is added too.
        torch.nn.init.normal_(apply_lora_to(linear).lora_B)
        torch.testing.assert_close(fdt.FUSED_OPS.add_linear(residual.clone(), x, linear),
                                   TORCH_OPS.add_linear(residual, x, linear), **TOL[dtype])
        assert not torch.allclose(TORCH_OPS.add_linear(residual, x, linear), want)
    assert calls == [1]


def apply_lora_to(linear: torch.nn.Linear) -> LoRALinear:
    """`linear` with a rank-4 adapter in its dtype (the engine reads adapters in the compute dtype)."""
    holder = torch.nn.Module()
    holder.layer = linear
    apply_lora(holder, LoRAConfig(rank=4, target_modules=["layer"]))
    holder.layer.lora_A.data = holder.layer.lora_A.data.to(linear.weight.dtype)
    holder.layer.lora_B.data = holder.layer.lora_B.data.to(linear.weight.dtype)
    return holder.layer


def _generate(model, fused: bool, requests, graphs: bool, monkeypatch):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=8))
    engine.runner.layer_ops = fdt.FUSED_OPS if fused else None
    engine.runner.use_cuda_graphs = graphs  # on CPU: the runner's eager stand-in, replaying what it captured
    calls = []
    monkeypatch.setattr(kv_cache, "rotary_store", lambda *a: calls.append(1) or fdt.rotary_store(*a))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = engine.generate(requests, params)
    # Every layer of every step (1 prefill, 3 decode steps, a graph capture's warm-up and capture) went fused.
    assert len(calls) == (model.args.text.num_hidden_layers * 6 if fused else 0)
    return out


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_engine_fused_equals_torch(family, monkeypatch):
    """Greedy tokens and logprobs of the fused path equal the torch path's (prefill with an
    image's M-RoPE positions and decode steps through the graph stand-in); Qwen3 with qk_norm."""
    args = tiny_args() if family == "qwen2.5-vl" else qwen3_tiny_args(layers=2)
    model = build_model(args, seed=3, init_std=None).to(DEVICE).eval()
    v = args.vision
    grid, pads = torch.tensor([[1, 4, 6]]), 6  # 24 patches, 6 tokens after the 2 x 2 merge
    pixels = torch.randn(24, v.in_channels * v.temporal_patch_size * v.patch_size ** 2,
                         generator=torch.Generator().manual_seed(20))
    requests = [Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=2),
                Request(Prompt(torch.tensor([3, VSTART] + [IMG] * pads + [VEND, 11]), pixel_values=pixels,
                               image_grid_thw=grid))]
    want = _generate(model, False, requests, True, monkeypatch)
    got = _generate(model, True, requests, True, monkeypatch)
    for w, o in zip(want, got):
        for ws, os_ in zip(w.samples, o.samples):
            assert os_.token_ids == ws.token_ids
            torch.testing.assert_close(torch.tensor(os_.logprobs), torch.tensor(ws.logprobs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decode_layer_launches(qk_norm):
    """One decode layer of the 3B's structure (q/k/v biases, no qk_norm; and with Qwen3's
    qk_norm), fused: at most 12 launches (aten ops that launch a kernel + Triton kernels;
    on CUDA the profiler's kernels)."""
    dev = torch.device(DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter's bf16 tl.dot is wrong
    setup = bench_decode_layer.DecodeSetup(bench_decode_layer.layer_args(dev), 1, 3, 9, dev, dtype, qk_norm=qk_norm)
    fused = bench_decode_layer.count_launches(setup, fused=True)
    assert fused["launches"] <= 12, fused
    assert bench_decode_layer.count_launches(setup, fused=False)["launches"] > 30
