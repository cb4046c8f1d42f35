"""Group-shared ("cascade") decode attention in Triton: each group's prompt KV read once per step.

The Triton counterpart of `rollplex.engine.cascade.CascadeDecodeAttention`, with its
inputs (shapes as there):

    q              (batch, q_heads, head_dim)
    k/v_cache      (num_blocks, block_size, kv_heads, head_dim), a per-layer view, any strides
    members        (groups, width) int32: each group's rows of q; slots >= batch are padding
    prefix_tables  (groups, prefix width): the blocks the group's rows share
    prefix_lens    (groups,): tokens of those blocks (0: a padding group)
    tail_tables    (batch, tail width) and tail_lens (batch,): each row's own blocks past them
    -> out         (batch, q_heads, head_dim), dtype of q

Three launches, all of paged_decode_triton's kernels:
- tails: the paged decode kernel, each row over its tail, in split-K partitions
  with their log-sum-exp;
- prefixes: the same kernel with one program per (group, KV head, partition),
  whose tile rows are the group's member rows x the query heads of that KV head,
  so each prefix K/V tile is loaded once for the whole group (the M dimension of
  tl.dot); each member row's partitions land next to its tail partitions;
- the split-K merge, over a row's tail and prefix partitions together. A row in
  no group has prefix partitions of lse -inf, which the merge skips.

Every shape (grids, scratch, partition counts) comes from the tensors' shapes,
never from their values, so a CUDA graph captured over static, padded group
buffers replays it with any groups that fit them (the engine pads groups to
half its batch bucket and `prefix_group_width` rows each, prefix tables to the
full table width). Imports without triton, like paged_decode_triton.
"""

from __future__ import annotations

import torch

from rollplex.ops.paged_decode_triton import DecodeLaunch, check_decode_shapes, merge_partitions

PREFIX_TILE_ROWS = 64  # query rows of one prefix program: a group's rows x the query heads of a KV head


def prefix_group_width(queries_per_kv_head: int) -> int:
    """The most rows a prefix group holds; a larger group of rows sharing a prompt is cut
    into groups of at most this many (each reads the prompt once). It fills the prefix
    tile's PREFIX_TILE_ROWS rows, and is at least 4, so that the groups of any batch
    number at most half its rows (a group has at least 2 rows before it is cut, and
    cutting s >= 2 rows into pieces of 4 or more makes at most s / 2)."""
    return max(4, PREFIX_TILE_ROWS // queries_per_kv_head)


def cascade_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    members: torch.Tensor,
    prefix_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    tail_tables: torch.Tensor,
    tail_lens: torch.Tensor,
    scale: float | None = None,
    tail_splits: int | None = None,
    prefix_splits: int | None = None,
) -> torch.Tensor:
    """Each group's rows over its shared prefix (one pass per group and KV head), each
    row over its tail, merged by log-sum-exp; see the module docstring. The partition
    counts default to paged_decode_triton's shape-only heuristic (for the prefixes,
    with as many busy groups as the batch can fill). No host sync."""
    check_decode_shapes(q, k_cache, v_cache)
    batch, q_heads, head_dim = q.shape
    groups, width = members.shape
    if tail_tables.shape[0] != batch or tail_lens.shape != (batch,) or prefix_tables.shape[0] != groups \
            or prefix_lens.shape != (groups,):
        raise ValueError(f"tails {tuple(tail_tables.shape)} / {tuple(tail_lens.shape)} do not match batch {batch}, "
                         f"or prefixes {tuple(prefix_tables.shape)} / {tuple(prefix_lens.shape)} groups {groups}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    scale = head_dim ** -0.5 if scale is None else float(scale)
    tails = DecodeLaunch.plan(q, k_cache, tail_tables, num_splits=tail_splits)
    prefixes = DecodeLaunch.plan(q, k_cache, prefix_tables, num_members=width, num_splits=prefix_splits,
                                 busy_entries=min(groups, -(-batch // width)))
    splits = tails.num_splits + prefixes.num_splits
    part = torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    # Rows in no group never get prefix partitions written: their lse stays -inf, and the merge skips them.
    lse = torch.full((batch, q_heads, splits), float("-inf"), dtype=torch.float32, device=q.device)
    tail_part, prefix_part = part.split([tails.num_splits, prefixes.num_splits], dim=2)
    tail_lse, prefix_lse = lse.split([tails.num_splits, prefixes.num_splits], dim=2)
    tails(q, k_cache, v_cache, tail_tables, tail_lens, tail_part, tail_lse, scale)
    if groups:
        prefixes(q, k_cache, v_cache, prefix_tables, prefix_lens, prefix_part, prefix_lse, scale, members=members)
    merge_partitions(part, lse, out)
    return out
