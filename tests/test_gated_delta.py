"""The Gated DeltaNet ops (rollplex.ops.gated_delta) against the rule's per-token definition,
transformers' own Qwen3.5 torch kernels, and F.conv1d; then the engine's uses (prefill, decode,
forked states) and autograd. Then the backend choice (torch, or flash-linear-attention on CUDA)
and, where fla is importable, the layouts handed to it: its chunk kernel's contract through fla's
own naive reference, and its fused recurrent kernel itself in Triton's interpreter, which
TRITON_INTERPRET=1 turns on only when set before triton is imported: a process of its own
(`test_fla_decode_kernel_in_the_interpreter`)."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from kernel_cases import ROOT, fresh_env
from rollplex.ops import gated_delta
from rollplex.ops.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_step,
    resolve_delta_backend,
)

HAS_FLA = importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention (fla-core) is not installed")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# fla's fused recurrent kernel loops `tl.range(0, T)` to a runtime T, which Triton's interpreter runs from
# 3.9 on (3.6's raises); compiled on a GPU every version does.
TRITON_INTERPRETS_FLA = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2]) >= (3, 9)

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 8


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def random_inputs(total: int, num_seqs: int, seed: int = 0, dtype=torch.float32):
    """q, k (normalised), v, g, beta, initial state as a Qwen3.5 layer makes them: g = -A softplus(a + dt),
    A up to 16, so some heads decay to nothing within a chunk and others barely decay."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(total, KEY_HEADS, KEY_DIM, generator=gen)).to(dtype)
    k = l2norm(torch.randn(total, KEY_HEADS, KEY_DIM, generator=gen)).to(dtype)
    v = torch.randn(total, VALUE_HEADS, VALUE_DIM, generator=gen).to(dtype)
    decay_rate = torch.tensor([0.01, 0.3, 2.0, 16.0])
    g = -decay_rate * F.softplus(torch.randn(total, VALUE_HEADS, generator=gen) - 2.0)
    beta = torch.rand(total, VALUE_HEADS, generator=gen).to(dtype)
    state = torch.randn(num_seqs, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=gen)
    return q, k, v, g, beta, state


def naive_gated_delta(q, k, v, g, beta, cu_seqlens, initial_state):
    """The rule token by token, in the order transformers' torch_recurrent_gated_delta_rule applies it:
    decay S, read the decayed S at k, write beta * (v - read) at k, read the new S at q / sqrt(Dk).
    Key heads serve consecutive value heads (repeat_interleave)."""
    group = VALUE_HEADS // KEY_HEADS
    q = q.repeat_interleave(group, dim=1) * KEY_DIM**-0.5
    k = k.repeat_interleave(group, dim=1)
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = initial_state[seq]
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            read = torch.einsum("hkv,hk->hv", state, k[t])
            state = state + k[t][:, :, None] * ((v[t] - read) * beta[t][:, None])[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        finals.append(state)
    return torch.stack(outs), torch.stack(finals)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_per_token_recurrence_over_packed_sequences(with_initial_state, chunk_size):
    lengths = [5, 70, 1, 33, 64, 17]  # shorter than a chunk, several chunks, exactly one, one token
    cu = cu_seqlens_of(lengths)
    q, k, v, g, beta, state = random_inputs(sum(lengths), len(lengths))
    state = state if with_initial_state else torch.zeros_like(state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, state if with_initial_state else None, chunk_size)
    as64 = [x.double() for x in (q, k, v, g, beta)]
    ref_out, ref_final = naive_gated_delta(*as64, cu, state.double())
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(final.double(), ref_final, atol=1e-5, rtol=0)


def test_sequences_do_not_leak_into_each_other():
    """A sequence's output and final state depend on its own tokens only: changing its neighbours
    (and their initial states) changes nothing of it."""
    lengths = [40, 9, 75]
    cu = cu_seqlens_of(lengths)
    q, k, v, g, beta, state = random_inputs(sum(lengths), 3)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, state, chunk_size=16)
    middle = slice(40, 49)
    noise = [torch.randn_like(x) for x in (v, state)]
    v2 = v + noise[0]
    v2[middle] = v[middle]
    state2 = state + noise[1]
    state2[1] = state[1]
    out2, final2 = chunk_gated_delta_rule(q, k, v2, g, beta, cu, state2, chunk_size=16)
    torch.testing.assert_close(out2[middle], out[middle], atol=0, rtol=0)
    torch.testing.assert_close(final2[1], final[1], atol=0, rtol=0)
    assert not torch.allclose(out2[:40], out[:40])


def test_output_dtype_is_values_and_state_stays_fp32():
    lengths = [20, 7]
    q, k, v, g, beta, state = random_inputs(sum(lengths), 2)
    out, final = chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta.bfloat16(), cu_seqlens_of(lengths), state)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    rounded = [x.bfloat16().float() for x in (v, beta)]
    reference, _ = chunk_gated_delta_rule(q, k, rounded[0], g, rounded[1], cu_seqlens_of(lengths), state)
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


def hf_torch_kernel(kernel):
    """transformers' plain-torch kernel: where fla is importable, transformers swaps fla's kernel in for
    its torch_*_gated_delta_rule, on any device, and keeps its own as the wrapped function."""
    return getattr(kernel, "__wrapped__", kernel)


def hf_layout(x: torch.Tensor, group: int = 1) -> torch.Tensor:
    """Packed [T, H, ...] of one sequence -> transformers' [1, T, H, ...]; key heads expanded as its layer
    does (transformers 5.17 repeat_interleaves in the layer, 5.24 inside the kernel: the same result)."""
    return x.repeat_interleave(group, dim=1).unsqueeze(0) if group > 1 else x.unsqueeze(0)


def test_matches_transformers_chunk_and_recurrent_kernels_on_one_sequence():
    length, group = 150, VALUE_HEADS // KEY_HEADS
    gen = torch.Generator().manual_seed(3)
    raw_q = torch.randn(length, KEY_HEADS, KEY_DIM, generator=gen)
    raw_k = torch.randn(length, KEY_HEADS, KEY_DIM, generator=gen)
    _, _, v, g, beta, state = random_inputs(length, 1, seed=3)
    ours, our_final = chunk_gated_delta_rule(l2norm(raw_q), l2norm(raw_k), v, g, beta, cu_seqlens_of([length]), state)
    hf_args = (hf_layout(raw_q, group), hf_layout(raw_k, group), hf_layout(v), hf_layout(g), hf_layout(beta))
    hf_kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for kernel in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        theirs, their_final = hf_torch_kernel(kernel)(*hf_args, **hf_kwargs)
        torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(our_final, their_final, atol=1e-5, rtol=0)


def test_decode_step_matches_transformers_recurrent_kernel():
    batch, group = 3, VALUE_HEADS // KEY_HEADS
    q, k, v, g, beta, state = random_inputs(batch, batch, seed=4)
    theirs, their_state = hf_torch_kernel(hf.torch_recurrent_gated_delta_rule)(
        q.repeat_interleave(group, 1).unsqueeze(1), k.repeat_interleave(group, 1).unsqueeze(1), v.unsqueeze(1),
        g.unsqueeze(1), beta.unsqueeze(1), initial_state=state, output_final_state=True,
    )
    ours = recurrent_gated_delta_step(q, k, v, g, beta, state)
    torch.testing.assert_close(ours, theirs[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(state, their_state, atol=1e-5, rtol=0)


def test_prefill_then_decode_equals_whole_sequence_and_forked_states_decode_independently():
    """The engine's use: chunk over each prompt, fork the state to several rows, decode token by token;
    each row equals the chunked rule over its own prompt + continuation."""
    prompts, forks, steps = [37, 70], 3, 5
    q, k, v, g, beta, _ = random_inputs(sum(prompts), len(prompts), seed=5)
    _, prompt_states = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_of(prompts), chunk_size=16)
    rows = len(prompts) * forks
    row_prompt = torch.arange(len(prompts)).repeat_interleave(forks)
    states = prompt_states[row_prompt].clone()
    dq, dk, dv, dg, dbeta, _ = random_inputs(rows * steps, 1, seed=6)
    step_inputs = [x.reshape(steps, rows, *x.shape[1:]) for x in (dq, dk, dv, dg, dbeta)]
    decoded = torch.stack([recurrent_gated_delta_step(*(x[s] for x in step_inputs), states) for s in range(steps)])

    bounds = cu_seqlens_of(prompts).tolist()
    for row in range(rows):
        prompt = slice(bounds[row_prompt[row]], bounds[row_prompt[row] + 1])
        whole = [torch.cat([x[prompt], y[:, row]]) for x, y in zip((q, k, v, g, beta), step_inputs)]
        out, final = chunk_gated_delta_rule(*whole, cu_seqlens_of([whole[0].shape[0]]), chunk_size=16)
        torch.testing.assert_close(decoded[:, row], out[-steps:], atol=1e-5, rtol=0)
        torch.testing.assert_close(states[row], final[0], atol=1e-5, rtol=0)


def test_gradients_match_per_token_recurrence():
    lengths = [19, 40]
    cu = cu_seqlens_of(lengths)
    inputs = [x.double().requires_grad_() for x in random_inputs(sum(lengths), 2, seed=7)]
    out, final = chunk_gated_delta_rule(*inputs[:5], cu, inputs[5], chunk_size=16)
    ref_out, ref_final = naive_gated_delta(*inputs[:5], cu, inputs[5])
    gen = torch.Generator().manual_seed(8)
    out_weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    final_weight = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad((out * out_weight).sum() + (final * final_weight).sum(), inputs)
    theirs = torch.autograd.grad((ref_out * out_weight).sum() + (ref_final * final_weight).sum(), inputs)
    for name, our_grad, their_grad in zip(("q", "k", "v", "g", "beta", "initial_state"), ours, theirs):
        scale = their_grad.abs().max()
        assert scale > 0, name
        torch.testing.assert_close(our_grad / scale, their_grad / scale, atol=2e-5, rtol=0, msg=name)


def conv_reference(x, weight, history):
    """One sequence through F.conv1d with its K-1 previous inputs as left padding, then SiLU."""
    padded = torch.cat([history, x.t()], dim=1).unsqueeze(0)
    return F.silu(F.conv1d(padded, weight.unsqueeze(1), groups=weight.shape[0])[0].t())


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_causal_conv1d_matches_conv1d_per_sequence(with_initial_state):
    lengths, channels, kernel = [9, 1, 2, 30, 3], 6, 4  # 1 and 2 are shorter than K-1
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    history = torch.randn(len(lengths), channels, kernel - 1, generator=gen)
    history = history if with_initial_state else torch.zeros_like(history)
    cu = cu_seqlens_of(lengths)
    out, final = causal_conv1d(x, weight, cu, history if with_initial_state else None)
    bounds = cu.tolist()
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        expected = conv_reference(x[start:end], weight, history[seq])
        torch.testing.assert_close(out[start:end], expected, atol=1e-6, rtol=0)
        expected_final = torch.cat([history[seq], x[start:end].t()], dim=1)[:, -(kernel - 1):]
        torch.testing.assert_close(final[seq], expected_final, atol=0, rtol=0)


def test_causal_conv1d_continues_across_calls_and_steps():
    """Prefill in two calls (final state handed on), then single-token steps, equals one call over it all."""
    channels, kernel, prompt, steps = 5, 4, 11, 4
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(prompt + steps, channels, generator=gen, requires_grad=True)
    weight = torch.randn(channels, kernel, generator=gen)
    whole, whole_final = causal_conv1d(x, weight, cu_seqlens_of([prompt + steps]))
    first, state = causal_conv1d(x[:6], weight, cu_seqlens_of([6]))
    second, state = causal_conv1d(x[6:prompt], weight, cu_seqlens_of([prompt - 6]), state)
    state = state.detach().clone()
    stepped = [causal_conv1d_step(x[t : t + 1].detach(), weight, state) for t in range(prompt, prompt + steps)]
    torch.testing.assert_close(torch.cat([first, second, *stepped]), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(state, whole_final, atol=0, rtol=0)
    whole.sum().backward()  # differentiable through the packed gather and the conv
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_causal_conv1d_matches_transformers_fn_and_update():
    channels, kernel, length = 6, 4, 10
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    ours, our_state = causal_conv1d(x, weight, cu_seqlens_of([length]))
    theirs = hf.causal_conv1d_fn(x.t().unsqueeze(0), weight, activation="silu")
    torch.testing.assert_close(ours, theirs[0].t(), atol=1e-6, rtol=0)
    new = torch.randn(1, channels, generator=gen)
    their_state = our_state.clone()
    their_step = hf.causal_conv1d_update(new.unsqueeze(-1), their_state, weight, activation="silu")
    our_step = causal_conv1d_step(new, weight, our_state)
    torch.testing.assert_close(our_step, their_step[:, :, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(our_state, their_state, atol=0, rtol=0)


# ---------------------------------------------------------------------- the backend: torch, or fla on CUDA

CUDA = torch.device("cuda")  # resolve_delta_backend reads only the device's type: no GPU needed


def test_cpu_runs_torch_and_fla_by_name_is_refused_there(monkeypatch):
    monkeypatch.setattr(gated_delta, "_HAS_FLA", True)  # even where fla is installed
    cpu = torch.device("cpu")
    assert resolve_delta_backend("auto", cpu) == resolve_delta_backend("torch", cpu) == "torch"
    with pytest.raises(RuntimeError, match=r"needs flash-linear-attention and a CUDA device \(pip install "
                                           r"'rollplex\[gpu\]', or pip install fla-core\)"):
        resolve_delta_backend("fla", cpu)
    with pytest.raises(ValueError, match="unknown gated delta rule backend 'flash'"):
        resolve_delta_backend("flash", cpu)


def test_cuda_runs_fla_where_installed_and_torch_by_name(monkeypatch):
    monkeypatch.setattr(gated_delta, "_HAS_FLA", True)
    assert resolve_delta_backend("auto", CUDA) == resolve_delta_backend("fla", CUDA) == "fla"
    assert resolve_delta_backend("torch", CUDA) == "torch"


def test_cuda_without_fla_falls_back_to_torch_with_one_warning_and_refuses_fla_by_name(monkeypatch):
    monkeypatch.setattr(gated_delta, "_HAS_FLA", False)
    gated_delta._warn_fla_missing.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [resolve_delta_backend("auto", CUDA) for _ in range(3)] == ["torch"] * 3
        assert resolve_delta_backend("torch", CUDA) == "torch"  # asked for: nothing to warn of
    assert len(caught) == 1 and "pip install 'rollplex[gpu]', or pip install fla-core" in str(caught[0].message)
    gated_delta._warn_fla_missing.cache_clear()
    with pytest.raises(RuntimeError, match="needs flash-linear-attention"):
        resolve_delta_backend("fla", CUDA)


def test_cpu_tensors_never_reach_fla(monkeypatch):
    """With fla installed, "auto" on CPU tensors still runs the torch ops (fla's adapters would raise here)."""
    monkeypatch.setattr(gated_delta, "_HAS_FLA", True)

    def refuse(*args):
        raise AssertionError("fla called on CPU tensors")

    monkeypatch.setattr(gated_delta, "_fla_chunk_gated_delta_rule", refuse)
    monkeypatch.setattr(gated_delta, "_fla_gated_delta_step", refuse)
    q, k, v, g, beta, state = random_inputs(10, 1)
    chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_of([10]), state)
    recurrent_gated_delta_step(q[:1], k[:1], v[:1], g[:1], beta[:1], state.clone())


def fla_chunk_contract(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """fla's varlen chunk_gated_delta_rule as its docstring and kernels define it, computed with fla's
    own naive reference (naive_chunk_gated_delta_rule) sequence by sequence: a batch of one [1, T, H, D],
    int64 cu_seqlens, q, k and v of one dtype, value head h reading key head h // (Hv / Hk)
    (fla/ops/gated_delta_rule/chunk_fwd.py), states [N, Hv, Dk, Dv] in fp32, outputs in v's dtype."""
    from fla.ops.gated_delta_rule import naive_chunk_gated_delta_rule

    assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and q.dtype == k.dtype == v.dtype
    assert output_final_state and q.shape[2] == k.shape[2] and v.shape[2] % q.shape[2] == 0
    group = v.shape[2] // q.shape[2]
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = slice(start, end)
        out, final = naive_chunk_gated_delta_rule(
            q[:, rows].repeat_interleave(group, 2), k[:, rows].repeat_interleave(group, 2), v[:, rows], g[:, rows],
            beta[:, rows], chunk_size=chunk_size, scale=scale, output_final_state=True,
            initial_state=None if initial_state is None else initial_state[n:n + 1])
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1).to(v.dtype), torch.cat(finals)


@needs_fla
@pytest.mark.parametrize("with_initial_state", [False, True])
def test_fla_chunk_layouts_against_fla_naive_reference(with_initial_state, monkeypatch):
    """The adapter hands fla's chunk kernel what its contract asks (checked by `fla_chunk_contract`, whose
    arithmetic is fla's naive reference) and reads its answer back: the outputs, final states and the
    initial states' gradient are the torch path's."""
    import fla.ops.gated_delta_rule

    monkeypatch.setattr(fla.ops.gated_delta_rule, "chunk_gated_delta_rule", fla_chunk_contract)
    monkeypatch.setattr(gated_delta, "fla_available", lambda device: True)  # fla "on" these CPU tensors
    lengths = [5, 70, 1, 33]
    cu = cu_seqlens_of(lengths)
    q, k, v, g, beta, state = random_inputs(sum(lengths), len(lengths), seed=12)
    initial = state.requires_grad_() if with_initial_state else None
    results = {}
    for backend in ("torch", "fla"):
        out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, initial, chunk_size=16, backend=backend)
        grad = torch.autograd.grad((out.sum() + final.square().sum()), initial)[0] if with_initial_state else None
        results[backend] = (out, final, grad)
    for ours, theirs in zip(results["torch"], results["fla"]):
        if ours is not None:
            torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=0)


@pytest.mark.skipif(not INTERPRETED, reason="runs in test_fla_decode_kernel_in_the_interpreter's process")
def test_fla_fused_recurrent_kernel_steps_as_the_torch_ops():
    """fla's own fused recurrent kernel, interpreted on CPU tensors, through the decode adapter: the same
    outputs and states as the torch step, rows from forked states, grouped key heads, and after three steps."""
    batch, steps = 3, 3
    _, _, _, _, _, state = random_inputs(1, batch, seed=13)
    fla_state, torch_state = state.clone(), state.clone()
    for step in range(steps):
        q, k, v, g, beta, _ = random_inputs(batch, 1, seed=14 + step)
        theirs = gated_delta._fla_gated_delta_step(q, k, v, g, beta, fla_state)
        ours = gated_delta._torch_gated_delta_step(q, k, v, g, beta, torch_state)
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
        torch.testing.assert_close(fla_state, torch_state, atol=1e-5, rtol=0)


@needs_fla
@pytest.mark.skipif(INTERPRETED, reason="it starts the interpreted test")
@pytest.mark.skipif(not TRITON_INTERPRETS_FLA, reason="this Triton's interpreter cannot run fla's recurrent kernel")
def test_fla_decode_kernel_in_the_interpreter():
    name = "test_fla_fused_recurrent_kernel_steps_as_the_torch_ops"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::{name}"],
                         cwd=ROOT, env=fresh_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    summary = (res.stdout.strip().splitlines() or [""])[-1]
    assert res.returncode == 0 and summary.startswith("1 passed"), res.stdout[-4000:] + res.stderr[-2000:]
