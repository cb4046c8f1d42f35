"""Group-shared ("cascade") decode attention against the plain paged decode path.

A decode batch's rows that fork from one prompt hold the same full prompt blocks;
the cascade path attends each group's queries over those blocks once and each row
over its own remaining blocks, merging the two by log-sum-exp. The engine's use of
it (rollout.shared_prefix_decode) is tested in tests/test_engine.py.
"""

import torch

from rollplex.engine.cascade import CascadeDecodeAttention, PrefixGroups
from rollplex.ops.attention import paged_decode_attention

BLOCK = 4


def random_batch(groups: list[tuple[int, int]], singles: list[int], tails: list[int], seed: int = 0,
                 block_size: int = BLOCK):
    """Block tables and context lengths of a decode batch: each (members, prefix blocks)
    group's rows share their first blocks, then own `tails[row]` tokens; a single row
    owns `singles[i]` tokens, its last block partial."""
    g = torch.Generator().manual_seed(seed)
    next_block, tables, lens, members, prefix_tables = 0, [], [], [], []

    def take(n: int) -> list[int]:
        nonlocal next_block
        next_block += n
        return list(range(next_block - n, next_block))

    row = 0
    for size, prefix_blocks in groups:
        prefix = take(prefix_blocks)
        members.append(list(range(row, row + size)))
        prefix_tables.append(prefix)
        for _ in range(size):
            tail = tails[row]
            tables.append(prefix + take(-(-tail // block_size)))
            lens.append(prefix_blocks * block_size + tail)
            row += 1
    for tokens in singles:
        tables.append(take(-(-tokens // block_size)))
        lens.append(tokens)
    width = max(map(len, tables))
    sink = next_block
    block_tables = torch.tensor([t + [sink] * (width - len(t)) for t in tables], dtype=torch.int32)
    # Shuffle the blocks' order in the pool so that a table is not a contiguous run.
    perm = torch.randperm(sink, generator=g)
    block_tables = torch.where(block_tables == sink, sink, perm[block_tables.clamp(max=sink - 1).long()].int())
    prefix_tables = [perm[torch.tensor(t)].tolist() for t in prefix_tables]
    return block_tables, torch.tensor(lens, dtype=torch.int32), members, prefix_tables, sink, g


def test_cascade_equals_plain_paged_decode():
    # Groups of 5, 3 and 2 rows over 3, 1 and 6 prompt blocks; rows' own tokens from 1 (the copied partial
    # block just written) to 9; two rows in no group (one recomputed after a preemption, one with n = 1).
    groups, singles = [(5, 3), (3, 1), (2, 6)], [7, 13]
    tails = [1, 3, 9, 2, 5, 4, 1, 6, 3, 8]
    tables, lens, members, prefix_tables, sink, g = random_batch(groups, singles, tails)
    q_heads, kv_heads, head_dim = 6, 2, 8
    k_cache = torch.randn(sink + 1, BLOCK, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(sink + 1, BLOCK, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), q_heads, head_dim, generator=g)
    layout = PrefixGroups.build(members, prefix_tables, len(lens), sink, BLOCK, q.device)
    tail_blocks = max(-(-t // BLOCK) for t in tails + singles)
    cascade = CascadeDecodeAttention(layout, tables, lens, tail_blocks, BLOCK)(q, k_cache, v_cache)
    plain = paged_decode_attention(q, k_cache, v_cache, tables, lens)
    assert (cascade - plain).abs().max() <= 1e-5


def test_prefix_blocks_are_read_once_per_group():
    """What the cascade path buys: the prefix part gathers each group's blocks once,
    not once per member; the tails hold only each row's own blocks."""
    tables, lens, members, prefix_tables, sink, _ = random_batch([(8, 16)], [], [2] * 8)
    layout = PrefixGroups.build(members, prefix_tables, len(lens), sink, BLOCK, torch.device("cpu"))
    step = CascadeDecodeAttention(layout, tables, lens, 1, BLOCK)
    assert layout.prefix_tables.shape == (1, 16)
    assert step.tail_tables.shape == (8, 1) and step.tail_lens.tolist() == [2] * 8
    assert step.tail_tables[:, 0].tolist() == tables[:, 16].tolist()

