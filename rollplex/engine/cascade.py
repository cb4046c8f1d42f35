"""Group-shared ("cascade") decode attention: each group's shared prompt blocks read once per step.

A GRPO group's samples share its prompt's full KV blocks in memory, but plain
paged decode still reads them once per sample at every step. With
`EngineConfig.shared_prefix_decode` (off by default), a decode step attends each
group's queries over its shared prompt blocks in one pass, each row over its own
blocks past them (its tail: the copied partial prompt block and its generated
tokens), and merges the two by log-sum-exp (`CascadeDecodeAttention`). On CUDA
with triton that runs rollplex/ops/cascade_decode_triton.py's kernel, else a
torch path with the same logic.

Everything of it the engine does is here, behind one hook the runner holds
(`SharedPrefixDecode`, None when the option is off):
- which running rows share prompt blocks (`find_prefix_groups`): found when a row
  joins or leaves, and kept until the next does, so a group shrinks as its
  samples finish or are preempted;
- an eager step's groups (`SharedPrefixDecode.step_groups`);
- the CUDA graphs' static group buffers: a graph is captured over them
  (`graph_groups`), and they are refilled before a replay only when the groups
  have changed (`fill_graph_buffers`). A group holds at most `group_width` rows
  (the kernel's tile; a larger group is cut into pieces, each reading the prompt
  once), so the buffers hold half the bucket's rows of groups (cut groups number
  no more), that many rows each, prefix tables as wide as the block tables, and
  tails over the full table width: no recapture and no eager fallback for any
  group size. A step without groups replays the same graphs with padding groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollplex.device import to_device
from rollplex.engine.decode_batch import DecodeBatch
from rollplex.ops.cascade_decode_triton import cascade_decode_attention_triton, prefix_group_width
from rollplex.ops.paged_decode_triton import triton_available


@dataclass(frozen=True)
class PrefixGroups:
    """Which rows of a decode batch share prompt KV blocks: group g's members
    (running indices `members[g]`, padded with indices >= the batch size) all hold the same
    first `prefix_lens[g]` tokens in blocks `prefix_tables[g]` (padded with any
    block). `shared_blocks[row]` is how many leading blocks of a row's table its
    group covers (0 for a row in no group). Changes only when rows join or leave."""

    # int32, as the block tables and lengths of plain decode: the kernels' loop and position arithmetic
    # stays 32-bit (only a K/V address is widened to 64 bits).
    members: torch.Tensor  # (groups, most members) int32
    prefix_tables: torch.Tensor  # (groups, most prefix blocks) int32
    prefix_lens: torch.Tensor  # (groups,) int32
    shared_blocks: torch.Tensor  # (batch,) int32

    @classmethod
    def build(cls, members: list[list[int]], prefix_tables: list[list[int]], batch: int, pad_block: int,
              block_size: int, device: torch.device) -> PrefixGroups:
        """From each group's running indices and shared block ids (host lists; maybe none)."""
        most_members, most_blocks = max(map(len, members), default=1), max(map(len, prefix_tables), default=1)
        shared = [0] * batch
        for rows, table in zip(members, prefix_tables):
            for row in rows:
                shared[row] = len(table)

        def int32(values: list, *shape: int) -> torch.Tensor:
            return to_device(values, device, torch.int32).view(*shape)

        return cls(
            int32([m + [batch] * (most_members - len(m)) for m in members], len(members), most_members),
            int32([t + [pad_block] * (most_blocks - len(t)) for t in prefix_tables], len(members), most_blocks),
            int32([len(t) * block_size for t in prefix_tables], len(members)),
            int32(shared, batch))


class CascadeDecodeAttention:
    """Decode attention that reads each group's shared prompt blocks once per step:
    all of a group's queries attend over its prefix in one pass, each row over its
    own blocks past the prefix (its tail), and the two partial results are merged by
    their log-sum-exp. Equal to `rollplex.ops.attention.paged_decode_attention` up to
    rounding. On CUDA with triton it runs the kernel (each group's prompt K/V tiles
    loaded once), else this torch path, with the same logic; built once per decode step
    (the tails' block tables), called once per layer. No host sync: a CUDA graph can
    capture both over static (padded) group buffers.

    `tail_blocks`: the most blocks any row holds past its shared ones, counted on
    the host (from the lengths there) so that no call reads the device."""

    def __init__(self, groups: PrefixGroups, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 tail_blocks: int, block_size: int):
        self.groups = groups
        columns = torch.arange(tail_blocks, device=block_tables.device)[None, :] + groups.shared_blocks[:, None]
        # Columns past a row's table are masked by its tail length; clamp only keeps the gather in range.
        self.tail_tables = block_tables.gather(1, columns.clamp(max=block_tables.shape[1] - 1))
        self.tail_lens = context_lens - groups.shared_blocks * block_size

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: (batch, q_heads, head_dim); the caches as `paged_decode_attention` takes them."""
        if q.is_cuda and triton_available(q.device):
            g = self.groups
            return cascade_decode_attention_triton(q, k_cache, v_cache, g.members, g.prefix_tables, g.prefix_lens,
                                                   self.tail_tables, self.tail_lens)
        batch, q_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        tail_out, tail_lse = _paged_attention_with_lse(q.view(batch, kv_heads, -1, head_dim), k_cache, v_cache,
                                                       self.tail_tables, self.tail_lens)
        prefix_out, prefix_lse = self._prefix_attention(q, k_cache, v_cache)
        # Rows in no group: their prefix part has lse -inf, so weight 0.
        prefix_weight = torch.sigmoid(prefix_lse - tail_lse)[..., None]
        out = tail_out + prefix_weight * (prefix_out - tail_out)
        return out.reshape(batch, q_heads, head_dim).to(q.dtype)

    def _prefix_attention(self, q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's queries over its prefix as one query block per KV head:
        (batch, kv_heads, heads per KV head, head_dim) and its log-sum-exp per row."""
        g = self.groups
        batch, _, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        groups, most_members = g.members.shape
        padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # row `batch`: the padding members' query
        members = g.members.clamp(max=batch)
        group_q = padded[members].view(groups, most_members, kv_heads, -1, head_dim).transpose(1, 2)
        per_kv_head = group_q.shape[3]
        out, lse = _paged_attention_with_lse(group_q.reshape(groups, kv_heads, most_members * per_kv_head, head_dim),
                                             k_cache, v_cache, g.prefix_tables, g.prefix_lens)
        rows = members.flatten()
        row_out = out.new_zeros(batch + 1, kv_heads, per_kv_head, head_dim)
        row_lse = out.new_full((batch + 1, kv_heads, per_kv_head), float("-inf"))
        row_out[rows] = out.view(groups, kv_heads, most_members, per_kv_head, head_dim).transpose(1, 2).flatten(0, 1)
        row_lse[rows] = lse.view(groups, kv_heads, most_members, per_kv_head).transpose(1, 2).flatten(0, 1)
        return row_out[:batch], row_lse[:batch]


def _paged_attention_with_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                              context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries q (n, kv_heads, queries per KV head, head_dim) of entry i over the first
    context_lens[i] tokens of its paged blocks block_tables[i]. Returns the float32
    output (same shape) and its log-sum-exp (n, kv_heads, queries per KV head), what
    a merge of partial attentions needs."""
    n, width = block_tables.shape
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    k = k_cache[block_tables].view(n, width * block_size, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables].view(n, width * block_size, kv_heads, head_dim).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * head_dim ** -0.5
    visible = torch.arange(width * block_size, device=q.device)[None, :] < context_lens[:, None]
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    lse = scores.logsumexp(-1)
    weights = torch.exp(scores - lse[..., None])
    return torch.matmul(weights.to(v.dtype), v).float(), lse


@dataclass(frozen=True)
class StepGroups:
    """What a decode step attends groups through: its groups, and the most blocks any
    row holds past its shared ones (its tail), counted on the host."""

    groups: PrefixGroups
    tail_blocks: int

    def attention(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                  block_size: int) -> CascadeDecodeAttention:
        """The step's attention over these groups: made inside the decode forward, so
        that a CUDA graph captures the tails' tables too."""
        return CascadeDecodeAttention(self.groups, block_tables, context_lens, self.tail_blocks, block_size)


def find_prefix_groups(batch: DecodeBatch, block_size: int,
                       group_width: int) -> tuple[PrefixGroups | None, np.ndarray]:
    """The running rows that share their group's full prompt blocks, in groups of at
    most `group_width` rows (a larger group is cut: each piece reads the prompt once),
    and per row how many blocks it shares; None for no groups when no two rows share a
    block. Live sequences hold the same block only when they forked from one prompt, and
    then share all of its full blocks (never copied: copy-on-write touches only a
    partial last block), so the first block identifies a group. A sequence recomputed
    after a preemption has blocks of its own and is in no group."""
    members: dict[int, list[int]] = {}
    for i, s in enumerate(batch.seqs):
        if s.num_prompt >= block_size:
            members.setdefault(s.block_table[0], []).append(i)
    groups = [rows[i:i + group_width] for rows in members.values() if len(rows) > 1
              for i in range(0, len(rows), group_width)]
    if not groups:
        return None, np.zeros(0, np.int64)
    tables = [batch.seqs[rows[0]].block_table[:batch.seqs[rows[0]].num_prompt // block_size] for rows in groups]
    shared_blocks = np.zeros(len(batch.seqs), np.int64)
    for rows, table in zip(groups, tables):
        shared_blocks[rows] = len(table)
    found = PrefixGroups.build(groups, tables, len(batch.seqs), batch.sink_block, block_size, batch.device)
    return found, shared_blocks


class SharedPrefixDecode:
    """The runner's one hook for group-shared decode attention (None when it is off):
    each decode step asks it for the step's groups, eager (`step_groups`) or, before a
    graph replay, into the graphs' static buffers (`fill_graph_buffers`); a graph
    capture asks for those buffers (`graph_groups`)."""

    def __init__(self, block_size: int, queries_per_kv_head: int, max_num_seqs: int, max_blocks: int,
                 sink_block: int, device: torch.device):
        self.block_size, self.max_num_seqs, self.max_blocks = block_size, max_num_seqs, max_blocks
        self.sink_block, self.device = sink_block, device
        self.group_width = prefix_group_width(queries_per_kv_head)
        # The groups found for one `DecodeBatch.rows` array, and each row's shared blocks: kept until that
        # array is replaced, which it is whenever a row joins or leaves.
        self._found: tuple[np.ndarray, PrefixGroups | None, np.ndarray] | None = None
        self.static: dict[str, torch.Tensor] | None = None  # the graphs' group buffers, made at the first capture
        self._filled: PrefixGroups | None = None  # the groups they hold (None: padding only)

    def step_groups(self, batch: DecodeBatch) -> StepGroups | None:
        """An eager decode step's groups; None when no two rows share a block."""
        groups, shared_blocks = self._groups_of(batch)
        if groups is None:
            return None
        lengths = batch.lengths[batch.rows]
        return StepGroups(groups, int((-(-lengths // self.block_size) - shared_blocks).max()))

    def fill_graph_buffers(self, batch: DecodeBatch) -> None:
        """Before a graph replay: the static group buffers hold the step's groups."""
        self._refill(len(batch), self._groups_of(batch)[0])

    def graph_groups(self, bucket: int) -> StepGroups:
        """What a bucket's graph attends groups through: the static buffers, half the
        bucket's rows of groups (cut groups number at most that many: prefix_group_width),
        tails over the full table width. They are padded first, so that the warm-up and
        the capture attend no stale groups; the next `fill_graph_buffers` refills them."""
        if self.static is None:
            self._make_static_buffers()
        self._pad()
        self._filled = None
        s, groups = self.static, max(1, bucket // 2)
        return StepGroups(PrefixGroups(s["members"][:groups], s["prefix_tables"][:groups], s["prefix_lens"][:groups],
                                       s["shared_blocks"][:bucket]), self.max_blocks)

    def _groups_of(self, batch: DecodeBatch) -> tuple[PrefixGroups | None, np.ndarray]:
        if self._found is None or self._found[0] is not batch.rows:
            self._found = (batch.rows, *find_prefix_groups(batch, self.block_size, self.group_width))
        return self._found[1:]

    def _refill(self, batch: int, groups: PrefixGroups | None) -> None:
        """The static group buffers, from the step's groups (None: no rows share blocks).
        Refilled only when the groups changed (one PrefixGroups is kept until a row joins
        or leaves). Padding: member slots past every bucket (max_num_seqs), groups of no
        prefix (length 0, sink blocks), rows sharing no block."""
        if groups is self._filled:
            return
        self._pad()
        if groups is not None:
            s = self.static
            count, width = groups.members.shape
            padding = groups.members >= batch
            s["members"][:count, :width].copy_(groups.members.masked_fill(padding, self.max_num_seqs))
            s["prefix_tables"][:count, :groups.prefix_tables.shape[1]].copy_(groups.prefix_tables)
            s["prefix_lens"][:count].copy_(groups.prefix_lens)
            s["shared_blocks"][:batch].copy_(groups.shared_blocks)
        self._filled = groups

    def _pad(self) -> None:
        s = self.static
        s["members"].fill_(self.max_num_seqs)
        s["prefix_tables"].fill_(self.sink_block)
        s["prefix_lens"].zero_()
        s["shared_blocks"].zero_()

    def _make_static_buffers(self) -> None:
        """Once per runner, at the first capture: every graph reads its rows of these."""
        dev, n = self.device, self.max_num_seqs
        most_groups = max(1, n // 2)
        self.static = {name: torch.empty(*shape, dtype=torch.int32, device=dev) for name, shape in (
            ("members", (most_groups, self.group_width)), ("prefix_tables", (most_groups, self.max_blocks)),
            ("prefix_lens", (most_groups,)), ("shared_blocks", (n,)))}
