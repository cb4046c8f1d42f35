"""Kernel cases for the Triton cascade decode attention against the torch paths.

Not collected by pytest directly: tests/test_paged_decode_triton.py runs this file in
a fresh process, with TRITON_INTERPRET=1 on CPU (see paged_decode_triton_cases.py),
or compiled on a CUDA machine. The references run on CPU in fp32: the torch
`CascadeDecodeAttention` (the same inputs) and the plain paged decode.
"""

import os

import pytest
import torch

from rollplex.ops import paged_decode_triton as pdt
from rollplex.engine.cascade import CascadeDecodeAttention, PrefixGroups
from rollplex.ops.attention import paged_decode_attention
from rollplex.ops.cascade_decode_triton import cascade_decode_attention_triton
from test_cascade_decode import random_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 on CPU (see tests/test_paged_decode_triton.py)")


@pytest.fixture(scope="module", autouse=True)
def kernel_env():
    pdt._kernels.cache_clear()  # kernels are built on first use, under this module's setting


def cut(members: list[list[int]], prefix_tables: list[list[int]], width: int):
    """Groups cut into groups of at most `width` rows, as the engine cuts them."""
    pieces = [(rows[i:i + width], table) for rows, table in zip(members, prefix_tables)
              for i in range(0, len(rows), width)]
    return [rows for rows, _ in pieces], [table for _, table in pieces]


def make_case(groups, singles, tails, block_size, kv_heads, per_kv_head, head_dim, width=None, seed=0):
    """A decode batch over a pool of two layers (the kernel gets layer 1's strided view), q a
    non-contiguous slice; its groups, optionally cut into groups of `width` rows."""
    tables, lens, members, prefix_tables, sink, g = random_batch(groups, singles, tails, seed, block_size)
    if width is not None:
        members, prefix_tables = cut(members, prefix_tables, width)
    data = torch.randn(sink + 1, 2, 2, block_size, kv_heads, head_dim, generator=g)
    qkv = torch.randn(len(lens), 2 * kv_heads * per_kv_head, head_dim, generator=g)
    q, k, v = qkv[:, :kv_heads * per_kv_head], data[:, 1, 0], data[:, 1, 1]
    layout = PrefixGroups.build(members, prefix_tables, len(lens), sink, block_size, torch.device("cpu"))
    tail_blocks = int((-(-lens // block_size) - layout.shared_blocks).max())
    return q, k, v, tables, lens, CascadeDecodeAttention(layout, tables, lens, tail_blocks, block_size)


def run_kernel(q, k, v, cascade: CascadeDecodeAttention, **splits) -> torch.Tensor:
    g = cascade.groups
    args = [t.to(DEVICE) for t in (q, k, v, g.members, g.prefix_tables, g.prefix_lens, cascade.tail_tables,
                                   cascade.tail_lens)]
    return cascade_decode_attention_triton(*args, **splits).cpu()


def check(q, k, v, tables, lens, cascade, **splits) -> None:
    out = run_kernel(q, k, v, cascade, **splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, cascade(q, k, v), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, paged_decode_attention(q, k, v, tables, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [dict(tail_splits=1, prefix_splits=1), dict(tail_splits=2, prefix_splits=3)])
def test_groups_and_rows_in_no_group(splits):
    # Groups of 5, 3 and 2 rows over 3, 1 and 6 prompt blocks, two rows in no group; GQA 3 (6 query heads
    # over 2 KV heads), head_dim 8 padded to 16.
    case = make_case([(5, 3), (3, 1), (2, 6)], [7, 13], [1, 3, 9, 2, 5, 4, 1, 6, 3, 8], block_size=4,
                     kv_heads=2, per_kv_head=3, head_dim=8)
    check(*case, **splits)


def test_a_group_cut_leaves_a_group_of_one():
    # 9 rows sharing a prompt, cut into groups of 4, 4 and 1; block size 12 (tiles of 64 keys cut blocks), a
    # prefix of 10 blocks (two tiles), GQA 4.
    case = make_case([(9, 10), (2, 2)], [30], [1, 12, 13, 5, 7, 2, 24, 3, 11, 4, 6], block_size=12, kv_heads=2,
                     per_kv_head=4, head_dim=32, width=4, seed=1)
    assert case[-1].groups.members.shape == (4, 4)
    check(*case, tail_splits=2, prefix_splits=2)


def test_block_larger_than_the_tile_and_one_query_head_per_kv_head():
    # Blocks of 128 keys (two tiles each), no GQA: a group of 6 is 6 tile rows, padded to 16.
    case = make_case([(6, 2), (3, 1)], [200], [1, 130, 5, 64, 65, 2, 128, 7, 3], block_size=128, kv_heads=3,
                     per_kv_head=1, head_dim=16, seed=2)
    check(*case, tail_splits=1, prefix_splits=2)


def test_default_partitions():
    # The shape-only heuristic (the interpreter pretends to have 132 SMs: both parts are split).
    check(*make_case([(4, 6), (2, 4)], [9], [2, 3, 1, 4, 9, 5], block_size=8, kv_heads=1, per_kv_head=2,
                     head_dim=16, seed=3))


def pad_like_a_graph(cascade: CascadeDecodeAttention, tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                     static_groups: int, width: int, table_width: int, sink: int) -> CascadeDecodeAttention:
    """The cascade over static buffers, as the engine's CUDA graphs capture it: groups padded to
    `static_groups` (prefix length 0), members to `width` (slots past the batch), prefix and row
    tables to the full table width (the sink block), tails as wide as the tables."""
    g, batch = cascade.groups, len(lens)
    groups, most = g.members.shape
    members = torch.full((static_groups, width), batch + 3)
    members[:groups, :most] = g.members.masked_fill(g.members >= batch, batch + 3)
    prefix_tables = torch.full((static_groups, table_width), sink)
    prefix_tables[:groups, :g.prefix_tables.shape[1]] = g.prefix_tables
    prefix_lens = torch.zeros(static_groups, dtype=torch.long)
    prefix_lens[:groups] = g.prefix_lens
    full_tables = torch.full((batch, table_width), sink, dtype=torch.int32)
    full_tables[:, :tables.shape[1]] = tables
    padded = PrefixGroups(members, prefix_tables, prefix_lens, g.shared_blocks)
    return CascadeDecodeAttention(padded, full_tables, lens, table_width, block_size)


@pytest.mark.parametrize("groups", [[(3, 2), (4, 1)], []], ids=["groups", "no-group"])
def test_static_padding_as_a_graph_captures_it(groups):
    # Padding groups, padding member slots and full-width tables; the sink block, which the padding
    # points at, holds NaN: the kernel must not read it.
    tails = [2, 1, 5, 3, 4, 1, 6][:sum(n for n, _ in groups)]
    q, k, v, tables, lens, cascade = make_case(groups, [5, 11], tails, block_size=4, kv_heads=2, per_kv_head=2,
                                               head_dim=16, seed=4)
    sink = k.shape[0] - 1
    padded = pad_like_a_graph(cascade, tables, lens, 4, static_groups=len(lens) // 2, width=8,
                              table_width=tables.shape[1] + 3, sink=sink)
    expected = padded(q, k, v)
    torch.testing.assert_close(expected, paged_decode_attention(q, k, v, tables, lens), atol=1e-5, rtol=1e-5)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[sink], v_nan[sink] = float("nan"), float("nan")
    out = run_kernel(q, k_nan, v_nan, padded, tail_splits=2, prefix_splits=2)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_other_groups():
    """Captured over static buffers with one group structure, replayed after they are
    refilled with another (groups shrunk, a row left): the graph's shapes fit both."""
    shape = dict(block_size=16, kv_heads=2, per_kv_head=4, head_dim=64)
    cases = [make_case([(4, 3), (3, 2)], [9], [1, 2, 3, 4, 5, 6, 7], seed=5, **shape),
             make_case([(2, 3), (3, 2)], [9, 20, 3], [1, 2, 3, 4, 5], seed=6, **shape)]  # 8 rows each
    sink = max(c[1].shape[0] for c in cases) - 1
    padded = [pad_like_a_graph(c[-1], c[3], c[4], 16, static_groups=4, width=8, table_width=12, sink=sink)
              for c in cases]
    blocks = sink + 1

    def device_inputs(case, cascade):
        q, k, v = case[:3]
        pool_k = torch.zeros(blocks, *k.shape[1:])
        pool_v = torch.zeros(blocks, *v.shape[1:])
        pool_k[:len(k)], pool_v[:len(v)] = k, v
        g = cascade.groups
        return [t.to(DEVICE) for t in (q, pool_k, pool_v, g.members, g.prefix_tables, g.prefix_lens,
                                       cascade.tail_tables, cascade.tail_lens)]

    static = device_inputs(cases[0], padded[0])
    cascade_decode_attention_triton(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade_decode_attention_triton(*static)
    for case, cascade in zip(cases, padded):
        fresh = device_inputs(case, cascade)
        for buf, value in zip(static, fresh):
            buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        q, k, v = (t.cpu() for t in fresh[:3])
        torch.testing.assert_close(out.cpu(), cascade(q, k, v), atol=1e-5, rtol=1e-5)
