"""FlexAttention compiles once, not once per micro-batch.

On CUDA every flex layer calls `flex_attention.compile_flex_attention()`'s function. Dynamo
keeps at most 8 compiled entries for FlexAttention's code and then runs it eagerly, which
materialises the whole score matrix, so a run whose micro-batches (each with its own
layout: segment count and lengths, token and key-row counts) each compiled again would
fall back within a few steps. Here that same compile function runs with a compile counter
as its backend, through the layers' own entry points: PackedSegments, SharedPrefixAttention
and KeptPrefixAttention with attn_backend "flex". On CPU dynamo traces as on CUDA and the
traced graph runs eagerly; on CUDA inductor compiles it, as in a run (its lowering may add
guards of its own). Outputs are checked against the torch path on the way.

Every layout is one mask kind (two key-row intervals per query token, the tensors given as
inputs) and sizes are dynamic, so micro-batches of every layout share one compilation. Sizes
of 1 are the exception dynamo always makes: queries, or queries and key rows, within one
128-token block compile once more each (and a single query token once more again). With the masks and compile settings of before (a
closure per mask kind, `torch.compile(flex_attention)`), the first test's 16 micro-batches
compiled 8 times (as many with dynamo's limit raised), and the second test 4 times by its
third check.
"""

import itertools

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from rollplex.ops import flex_attention
from rollplex.ops.attention import GroupLayout, KeptPrefixAttention, PackedSegments, SharedPrefixAttention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
HEAD_DIM = 16
# Every one spans at least two 128-token blocks of queries.
PACKED = [(5, 140, 17, 64, 1, 30), (200, 90), (3, 3, 3, 250, 1), (129, 128, 7, 300)]
SHARED = [[GroupLayout.packed(0, 37, (9, 150, 4)), GroupLayout.packed(200, 12, (1, 33, 20, 7))],
          [GroupLayout.packed(0, 100, (80, 90))],
          [GroupLayout.packed(0, 5, (300,)), GroupLayout.packed(305, 60, (2, 2, 2))],
          [GroupLayout.packed(0, 250, (64, 64, 64, 64))]]
KEPT = [(49, [GroupLayout(0, 37, 0, (9, 150, 4)), GroupLayout(37, 12, 163, (1, 33, 20, 7))]),
        (300, [GroupLayout(0, 300, 0, (100, 200))]),
        (700, [GroupLayout(0, 500, 0, (130, 3, 90)), GroupLayout(500, 200, 223, (40, 40, 40))]),
        (20, [GroupLayout(0, 20, 0, (400,))])]


@pytest.fixture(params=DEVICES)
def compiling(request, monkeypatch):
    """A device, and the counter of the compilations its flex layers make (compiled as on
    CUDA); dynamo's caches are empty before and after."""
    torch._dynamo.reset()
    device = torch.device(request.param)
    counter = CompileCounterWithBackend("inductor" if device.type == "cuda" else "eager")
    compiled = flex_attention.compile_flex_attention(counter)
    monkeypatch.setattr(flex_attention, "_kernel", lambda device: compiled)
    yield device, counter
    torch._dynamo.reset()


def qkv(tokens: int, key_rows: int, seed: int, device: torch.device):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(rows, heads, HEAD_DIM, generator=g).to(device)
                 for rows, heads in ((tokens, 4), (key_rows, 2), (key_rows, 2)))


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 1e-4 if got.is_cuda else 2e-6  # inductor's kernel sums in another order than SDPA's
    torch.testing.assert_close(got, want, atol=tolerance, rtol=max(tolerance, 1e-5))


def packed(lengths: tuple[int, ...], causal: bool, device: torch.device) -> None:
    q, k, v = qkv(sum(lengths), sum(lengths), len(lengths), device)
    cu_seqlens = [0, *itertools.accumulate(lengths)]
    same(PackedSegments(cu_seqlens, causal, "flex", device)(q, k, v),
         PackedSegments(cu_seqlens, causal, "torch", device)(q, k, v))


def shared(groups: list[GroupLayout], device: torch.device) -> None:
    q, k, v = qkv(groups[-1].end, groups[-1].end, len(groups), device)
    same(SharedPrefixAttention(groups, "flex")(0, q, k, v), SharedPrefixAttention(groups, "torch")(0, q, k, v))


def kept(kept_rows: int, groups: list[GroupLayout], device: torch.device) -> None:
    q, k, v = qkv(groups[-1].end, groups[-1].end, kept_rows, device)
    _, kept_k, kept_v = qkv(0, kept_rows, kept_rows + 1, device)
    same(KeptPrefixAttention([kept_k], [kept_v], groups, "flex")(0, q, k, v),
         KeptPrefixAttention([kept_k], [kept_v], groups, "torch")(0, q, k, v))


@torch.no_grad()
def test_micro_batches_of_every_layout_share_one_compilation(compiling):
    device, compilations = compiling
    for lengths, causal in itertools.product(PACKED, (True, False)):
        packed(lengths, causal, device)
    for groups in SHARED:
        shared(groups, device)
    for kept_rows, groups in KEPT:
        kept(kept_rows, groups, device)
    assert compilations.frame_count == 1


@torch.no_grad()
def test_single_block_micro_batches_compile_at_most_twice_more(compiling):
    device, compilations = compiling
    packed(PACKED[0], True, device)
    assert compilations.frame_count == 1
    for lengths in [(5, 40), (100,), (7, 7, 7)]:  # queries and key rows in one block
        packed(lengths, True, device)
    assert compilations.frame_count == 2
    for kept_rows, responses in [(300, (50, 20)), (400, (10, 9)), (150, (1, 2, 3))]:  # queries in one block
        kept(kept_rows, [GroupLayout(0, kept_rows, 0, responses)], device)
    assert compilations.frame_count == 3
    for lengths, causal in itertools.product(PACKED[1:], (True, False)):
        packed(lengths, causal, device)
    assert compilations.frame_count == 3
