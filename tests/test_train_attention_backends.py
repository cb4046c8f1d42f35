"""The one-call-per-layer training attention backends ("flex", "varlen") against the torch
path, the reference: packed segments (causal text, full-attention vision, GQA) and
prefixed segments (SharedPrefixAttention's groups, KeptPrefixAttention's suffix passes).

On CPU FlexAttention runs eagerly and forward only; "varlen" (torch's flash kernel) is
CUDA-only, so its plumbing (cumulative lengths, key gather, causal window, GQA heads)
runs here through a stand-in kernel with flash's semantics. The kernels themselves run
on the GPU in tools/bench_train_attention.py's device check.
"""

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import _disable_current_modes

from rollplex.config import ConfigError, config_from_dict
from rollplex.ops import attention, flex_attention
from rollplex.ops.attention import (GroupLayout, KeptPrefixAttention, PackedSegments, SharedPrefixAttention,
                                    resolve_backend)
from test_prefix_sync import HostSyncGuard

CPU = torch.device("cpu")
HEAD_DIM = 16
# Unequal segments, some across FlexAttention's 128-token blocks.
LENGTHS = (5, 140, 17, 64, 1, 30)
GROUPS = (GroupLayout.packed(0, 37, (9, 150, 4)), GroupLayout.packed(200, 12, (1, 33, 20, 7)))


def qkv(tokens: int, q_heads: int, kv_heads: int, seed: int = 0, key_rows: int | None = None):
    g = torch.Generator().manual_seed(seed)
    rows = tokens if key_rows is None else key_rows
    return (torch.randn(tokens, q_heads, HEAD_DIM, generator=g), torch.randn(rows, kv_heads, HEAD_DIM, generator=g),
            torch.randn(rows, kv_heads, HEAD_DIM, generator=g))


def cu(lengths) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


@pytest.fixture(params=["flex", "varlen"])
def backend(request, monkeypatch):
    """'varlen' runs through a stand-in for torch's varlen_attn: the torch path over the same
    cumulative lengths, causal bottom-right per segment as flash's kernel is, given K/V at
    the query's head count (torch 2.11's varlen_attn has no GQA)."""
    if request.param == "varlen":
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa=False):
            assert q.shape[1] == k.shape[1] or enable_gqa
            return attention._varlen_attention_torch(q, k, v, cu_q.tolist(), cu_k.tolist(), window_size == (-1, 0))

        monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)
        monkeypatch.setattr(attention, "_VARLEN_GQA", False)
    return request.param


@pytest.mark.parametrize("causal, q_heads, kv_heads", [(True, 4, 4), (False, 4, 4), (True, 4, 2), (False, 4, 2)])
def test_packed_segments_equal_the_torch_path(backend, causal, q_heads, kv_heads):
    q, k, v = qkv(sum(LENGTHS), q_heads, kv_heads)
    with torch.no_grad():
        expected = PackedSegments(cu(LENGTHS), causal, "torch", CPU)(q, k, v)
        got = PackedSegments(cu(LENGTHS), causal, backend, CPU)(q, k, v)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (4, 2)])
def test_shared_prefix_equals_the_torch_path(backend, q_heads, kv_heads):
    q, k, v = qkv(GROUPS[-1].end, q_heads, kv_heads, seed=1)
    with torch.no_grad():
        expected = SharedPrefixAttention(list(GROUPS), "torch")(0, q, k, v)
        got = SharedPrefixAttention(list(GROUPS), backend)(0, q, k, v)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_kept_prefix_equals_the_torch_path(backend):
    # Suffix-only batch: the responses back to back, their prompts' K/V kept at rows [0, 37) and [37, 49).
    groups = [GroupLayout(0, 37, 0, (9, 150, 4)), GroupLayout(37, 12, 163, (1, 33, 20, 7))]
    tokens, kept_rows = groups[-1].end, 49
    q, k, v = qkv(tokens, 4, 2, seed=2)
    _, kept_k, kept_v = qkv(0, 4, 2, seed=3, key_rows=kept_rows)
    with torch.no_grad():
        expected = KeptPrefixAttention([kept_k] * 2, [kept_v] * 2, groups, "torch")
        got = KeptPrefixAttention([kept_k] * 2, [kept_v] * 2, groups, backend)
        for layer in range(2):
            torch.testing.assert_close(got(layer, q, k, v), expected(layer, q, k, v), atol=2e-6, rtol=1e-5)


def test_flex_layers_issue_no_host_sync(monkeypatch):
    """The block masks are built once per micro-batch; every layer after only launches the kernel.
    The guard's dispatch mode cannot run FlexAttention's operator, so the kernel runs outside its
    modes (on CUDA it is one compiled kernel, whose mask reads the prebuilt index tensors on the
    device); everything around it, per layer, runs inside them."""
    kernel = flex_attention._kernel

    def outside_modes(device):
        def run(*args, **kwargs):
            with _disable_current_modes():
                return kernel(device)(*args, **kwargs)
        return run

    monkeypatch.setattr(flex_attention, "_kernel", outside_modes)
    q, k, v = qkv(GROUPS[-1].end, 4, 2)
    packed = PackedSegments(cu(LENGTHS), True, "flex", CPU)
    shared = SharedPrefixAttention(list(GROUPS), "flex")
    with torch.no_grad():
        shared(0, q, k, v)  # builds its segments on the first layer's call
        with HostSyncGuard() as guard:
            for layer in range(3):
                shared(layer, q, k, v)
                packed(q[:sum(LENGTHS)], k[:sum(LENGTHS)], v[:sum(LENGTHS)])
    assert guard.calls == []


def _same_block_mask(got, want):
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("causal", [True, False])
def test_flex_packed_block_mask_equals_create_block_mask(causal):
    flex = PackedSegments(cu(LENGTHS), causal, "flex", CPU).flex
    mask = flex.block_mask.mask_mod
    _same_block_mask(flex.block_mask, create_block_mask(mask, None, None, sum(LENGTHS), sum(LENGTHS), device=CPU))


@pytest.mark.parametrize("kept_rows", [0, 49])
def test_flex_prefixed_block_mask_equals_create_block_mask(kept_rows):
    if kept_rows:
        groups = [GroupLayout(0, 37, 0, (9, 150, 4)), GroupLayout(37, 12, 163, (1, 33, 20, 7))]
        segments = [s for g in groups for s in g.response_segments(own_keys_offset=kept_rows)]
    else:
        segments = attention.shared_prefix_segments(list(GROUPS))
    flex = attention.PrefixedSegments(segments, "flex", CPU).flex
    tokens = sum(s.length for s in segments)
    _same_block_mask(flex.block_mask, create_block_mask(flex.block_mask.mask_mod, None, None, tokens,
                                                        kept_rows + tokens, device=CPU))


def test_flex_block_masks_are_built_without_waiting_for_the_device():
    """Building them copies host lists to the device without blocking, and create_block_mask
    reads nothing back (a CUDA kernel's own syncs are the device check's to see)."""
    with HostSyncGuard(copies=True) as guard:
        PackedSegments(cu(LENGTHS), False, "flex", CPU)
        attention.PrefixedSegments(attention.shared_prefix_segments(list(GROUPS)), "flex", CPU)
    assert guard.calls == []


def test_flex_backward_on_cpu_is_a_clear_error():
    q, k, v = (t.requires_grad_() for t in qkv(sum(LENGTHS), 4, 2))
    with pytest.raises(RuntimeError, match="'flex' has no backward on CPU.*'torch'"):
        PackedSegments(cu(LENGTHS), True, "flex", CPU)(q, k, v)


def test_backend_names(monkeypatch):
    assert resolve_backend("auto", CPU) == "torch"
    assert resolve_backend("flex", CPU) == "flex"
    with pytest.raises(RuntimeError, match="'varlen'.*only on CUDA"):
        resolve_backend("varlen", CPU)
    with pytest.raises(ValueError, match="xformers"):
        resolve_backend("xformers", CPU)
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", False)
    assert resolve_backend("auto", torch.device("cuda")) == "torch"  # until flex/varlen are measured on a GPU
    assert resolve_backend("varlen", torch.device("cuda")) == "varlen"
    monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", True)
    assert resolve_backend("auto", torch.device("cuda")) == "flash"


@pytest.mark.parametrize("name", ["flex", "varlen", "torch", "flash", "auto"])
def test_config_takes_the_backend_names(name):
    assert config_from_dict({"model": {"attn_backend": name}}).model.attn_backend == name


def test_config_rejects_an_unknown_backend():
    with pytest.raises(ConfigError, match="model.attn_backend.*one of"):
        config_from_dict({"model": {"attn_backend": "sdpa"}})
