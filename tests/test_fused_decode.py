"""The fused decode-layer ops (rollplex.ops.fused_decode_triton): the switch, the torch
path's arithmetic unchanged, and the kernel and engine cases, which run in a fresh
process (tests/fused_decode_triton_cases.py: Triton's CPU interpreter without a GPU,
compiled on a CUDA machine)."""

import os
import subprocess
import sys

import pytest
import torch

from kernel_cases import ROOT, assert_cases_pass, assert_imports_without_triton, fresh_env
from rollplex.models import build_model
from rollplex.models.qwen2_5_vl import tiny_args
from rollplex.models.qwen_vl.layers import TORCH_OPS, layer_ops
from rollplex.models.rope import apply_rotary
from rollplex.ops import fused_decode_triton as fdt
from rollplex.ops.attention import VarlenAttention


def test_module_imports_without_triton():
    assert_imports_without_triton(["rollplex.ops.fused_decode_triton as m", "rollplex.engine"],
                                  "assert not m.fused_decode_enabled('cpu')")


def test_switch(monkeypatch):
    """Fused on CUDA by default; ROLLPLEX_FUSED_DECODE=0 turns it off; on CPU only when asked for."""
    monkeypatch.delenv("ROLLPLEX_FUSED_DECODE", raising=False)
    assert not fdt.fused_decode_enabled("cpu")
    monkeypatch.setattr(fdt, "triton_available", lambda device=None: True)
    assert fdt.fused_decode_enabled("cuda")
    monkeypatch.setenv("ROLLPLEX_FUSED_DECODE", "0")
    assert not fdt.fused_decode_enabled("cuda")
    monkeypatch.setenv("ROLLPLEX_FUSED_DECODE", "1")
    assert fdt.fused_decode_enabled("cpu")


def test_torch_path_is_the_training_arithmetic():
    """A decoder layer on a training backend runs the torch ops, and gives, bit for bit,
    the pre-norm layer written out op by op (x + attention, then + the MLP)."""
    model = build_model(tiny_args(), seed=3, init_std=None).eval()
    lm = model.language_model
    layer, T = lm.layers[0], 7
    attn = VarlenAttention.from_lengths([3, 4], "cpu")
    assert layer_ops(attn) is TORCH_OPS and layer_ops(lambda *a: None) is TORCH_OPS
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = lm.rotary(torch.arange(T).expand(3, -1), x.dtype)

    def reference(x):
        a, n = layer.self_attn, layer.input_layernorm(x)
        q, k, v = (p(n).view(T, -1, a.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        x = x + a.o_proj(attn(0, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v).reshape(T, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    x.requires_grad_(True)
    got = layer(x, cos, sin, attn)
    assert torch.equal(got, reference(x))
    got.sum().backward()  # the torch path keeps autograd
    assert x.grad is not None and layer.mlp.down_proj.weight.grad is not None


def test_kernel_and_engine_cases():
    assert_cases_pass(["fused_decode_triton_cases.py"], timeout=600)


@pytest.mark.slow  # ~30 s of two interpreted ranks; python -m pytest -q -m slow tests/test_fused_decode.py
def test_tensor_parallel_engine_runs_fused():
    """Under TP a layer's all-reduced outputs arrive wrapped and its norms' weights as DTensors:
    the fused ops read them as plain tensors. tests/test_engine_tp.py (2 ranks equal 1) with the
    fused ops on, in the interpreter on CPU."""
    env = fresh_env(ROLLPLEX_FUSED_DECODE="1", **({} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(ROOT, "tests", "test_engine_tp.py") + "::test_tp2_equals_tp1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-1000:]
