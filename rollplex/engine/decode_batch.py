"""The running sequences' decode state, kept in persistent arrays between steps.

A sequence that starts decoding takes a row of these arrays and keeps it until
it finishes or is preempted. Its row is written once when it joins (rope delta,
block table, the length where it stops, the sampler's U for every token it may
sample), then updated in place: one token per step, and one block-table entry
when the block manager gives it a new or a private block. A decode step reads its
inputs off the running rows and records its sampled tokens and stop checks with a
few array operations for the whole batch: no Python work per sequence, except for
the few that need a block, finish or are preempted.

Where each array lives:
- on the host, as numpy arrays, what the scheduler reads every step without
  waiting on the device: each row's length, the length where it stops, and the
  tokens and logprobs it sampled, at their positions in the sequence (a
  sequence's own lists catch up when it leaves the batch: to make its Sample, or
  to be recomputed after a preemption); and what the step's inputs are made
  from, with the lengths: each row's rope delta and U per token. numpy, not
  torch: a step's bookkeeping is a few dozen operations on a few hundred
  numbers, and numpy dispatches each several times faster, the more so right
  after the model has swept the caches;
- on the model's device, what the model and the sampler read: each row's last
  token and block table (torch), and the step's inputs (`StepInputs`), made on
  the host (from a copy of the block tables there) and copied over in one
  transfer per step.

A step's tokens are recorded in two parts, so that the host can schedule the
next step before it reads this one's tokens back (the engine runs one step
ahead): `advance` when the step is issued, with the tokens still on the device
(each row's length grows by one and the tokens become the next step's input),
and `record` once they are on the host (the tokens and logprobs stored, the stop
checks). A row that finished at one step has run the next one before the host
knows: `record` drops that token. Rows join, and are preempted, only when every
issued token is recorded (`settled`).

`seqs` and `rows` are the running sequences and their rows in running order,
oldest first: the scheduler preempts from the end.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rollplex.device import to_device
from rollplex.engine.sampler import uniforms
from rollplex.engine.sequence import PromptState, Sequence
from rollplex.ops.attention import PrefixGroups


class StepInputs(NamedTuple):
    """What changes every decode step for each running sequence, in running order,
    on the device (int64 but `uniforms`), and the longest length, on the host."""

    lengths: torch.Tensor  # tokens so far: the last one is fed, the next one sampled at this index
    positions: torch.Tensor  # the fed token's rope position (text: one for all three axes)
    slots: torch.Tensor  # the KV pool slot the fed token's K/V goes to
    uniforms: torch.Tensor  # float64: the sampler's U for the next token (rollplex.engine.sampler.uniforms)
    longest: int


class Advanced(NamedTuple):
    """A step's sampled tokens, issued (`DecodeBatch.advance`) and waiting to be recorded."""

    rows: np.ndarray  # the rows that sampled, in running order at the step
    positions: np.ndarray  # the index each row's token takes in its sequence


class DecodeBatch:
    def __init__(self, prompts: list[PromptState], num_rows: int, max_blocks: int, sink_block: int,
                 stop_ids: set[int], device: torch.device):
        self.sink_block, self.device = sink_block, device
        self.seqs: list[Sequence] = []
        self.free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest row first
        # Host.
        self.lengths = np.zeros(num_rows, np.int64)  # tokens so far; the last one's KV is not stored yet
        self.recorded = np.zeros(num_rows, np.int64)  # of those, the ones on the host: all but the step in flight
        self.running_index = np.full(num_rows, -1, np.int64)  # each row's index in running order; -1: free
        self.max_lengths = np.zeros(num_rows, np.int64)  # done at this length
        self.just_joined = np.zeros(num_rows, bool)  # no decode step scheduled since it joined
        self.rope_deltas = np.zeros(num_rows, np.int64)
        # Column i: token i of the row's sequence and its logprob, once sampled here (prompts' stay unset),
        # and the sampler's U for it, from the sequence's seed, set for every token it may sample when it joins.
        longest = max((p.max_length for p in prompts), default=0)
        self.sampled_tokens = np.empty((num_rows, longest), np.int64)
        self.sampled_logprobs = np.empty((num_rows, longest), np.float32)
        self.token_uniforms = np.empty((num_rows, longest), np.float64)
        self.host_block_tables = np.full((num_rows, max_blocks), sink_block, np.int64)  # as block_tables, below
        # Whether a token id ends a sequence; the ids past the largest stop id read the last entry, False.
        self.is_stop = np.zeros(max(stop_ids, default=-1) + 2, bool)
        self.is_stop[list(stop_ids)] = True
        # Every rope position a decode step feeds is below this (a generated token's index is below its max_length).
        self.max_position = max((p.max_length + max(p.rope_delta, 0) for p in prompts), default=0)
        # Device.
        self.last_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)  # what the next step feeds
        self.block_tables = torch.full((num_rows, max_blocks), sink_block, dtype=torch.int32, device=device)
        self._set_rows(np.zeros(0, np.int64))
        self.joined_since_step = False  # whether just_joined has rows set

    def __len__(self) -> int:
        return len(self.seqs)

    def _set_rows(self, rows: np.ndarray) -> None:
        self.rows, self.device_rows = rows, to_device(rows, self.device)
        self.running_index[:] = -1
        self.running_index[rows] = np.arange(len(rows))
        self._step_inputs: StepInputs | None = None  # made when first asked for, until a length or row changes
        # The rows that share prompt blocks and, per row, how many (host), for a group width: found when first
        # asked for, until a row joins or leaves (a group shrinks as its samples finish or are preempted).
        self._prefix_groups: tuple[int, PrefixGroups | None, np.ndarray] | None = None

    def join(self, seqs: list[Sequence]) -> int:
        """Start decoding `seqs` (whose next token is still to be sampled) after the
        running ones; returns the running index of the first."""
        assert self.settled(), "a sequence joins only when every issued token is recorded"
        first = len(self.seqs)
        for s in seqs:
            s.decode_row = self.free_rows.pop()
        rows = np.array([s.decode_row for s in seqs], np.int64)
        self.lengths[rows] = self.recorded[rows] = [len(s) for s in seqs]
        self.max_lengths[rows] = [s.prompt.max_length for s in seqs]
        self.just_joined[rows] = True
        self.joined_since_step = True
        self.rope_deltas[rows] = [s.prompt.rope_delta for s in seqs]
        self._hash_uniforms(rows, seqs)
        # Columns past a table stay the sink block (reset when a sequence leaves).
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [self.sink_block] * (width - len(s.block_table)) for s in seqs]
        self.host_block_tables[rows, :width] = tables
        self.block_tables[to_device(rows, self.device), :width] = to_device(tables, self.device, torch.int32)
        self.seqs += seqs
        self._set_rows(np.concatenate([self.rows, rows]))
        return first

    def _hash_uniforms(self, rows: np.ndarray, seqs: list[Sequence]) -> None:
        """Set the U of every token the joining sequences may sample, at its index: one hash
        over all of them here, where a step would hash the batch's U each time (dozens of
        small host ops, slow right after the model has swept the caches)."""
        positions = [np.arange(len(s), s.prompt.max_length) for s in seqs]
        counts = [len(p) for p in positions]
        seeds = np.repeat([s.prompt.seeds[s.sample_index] for s in seqs], counts)
        positions = np.concatenate(positions)
        u = uniforms(torch.from_numpy(seeds), torch.from_numpy(positions))
        self.token_uniforms[np.repeat(rows, counts), positions] = u.numpy()

    def rows_needing_blocks(self, block_size: int) -> tuple[list[int], list[int]]:
        """Running indices, ascending, and lengths of the sequences whose next token
        needs the block manager: it starts a new block, or the sequence joined since
        the last decode step and its last block may be shared with its group
        (copy-on-write). Called once per decode step: the joined ones count as seen afterwards."""
        lengths, needs = self._needing_blocks(block_size)
        if self.joined_since_step:
            self.just_joined[:] = False
            self.joined_since_step = False
        indices = np.flatnonzero(needs)
        return indices.tolist(), lengths[indices].tolist()

    def _needing_blocks(self, block_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The running rows' lengths, and which of them the next decode step takes to the block manager."""
        lengths = self.lengths[self.rows]
        needs = (lengths - 1) % block_size == 0
        if self.joined_since_step:
            needs |= self.just_joined[self.rows]
        return lengths, needs

    def last_blocks_changed(self, indices: list[int]) -> None:
        """Copy the last block-table entry of these running sequences to their rows
        (the block manager gave them a new block, or a private copy of a shared one)."""
        if not indices:
            return
        seqs = [self.seqs[i] for i in indices]
        rows, columns = [s.decode_row for s in seqs], [len(s.block_table) - 1 for s in seqs]
        blocks = [s.block_table[-1] for s in seqs]
        self.host_block_tables[rows, columns] = blocks
        self._step_inputs = None
        self.block_tables[to_device(rows, self.device), to_device(columns, self.device)] = \
            to_device(blocks, self.device, torch.int32)

    def step_inputs(self, block_size: int) -> StepInputs:
        """The running sequences' decode step inputs: made on the host, where the lengths
        are, and copied to the device in one transfer, from pinned memory on CUDA so that
        the copy does not wait for the device. Made once per step: the model's inputs and
        the sampler's read the same."""
        if self._step_inputs is None:
            rows = self.rows
            lengths = self.lengths[rows]
            fed = lengths - 1  # the index of the fed token
            slots = self.host_block_tables[rows, fed // block_size] * block_size + fed % block_size
            # A row at its maximum length samples a token that `record` drops (it ran ahead): any U will do.
            u = self.token_uniforms[rows, np.minimum(lengths, self.token_uniforms.shape[1] - 1)]
            # The position is rope.generated_positions' rule, index + rope delta, on the numpy rows here:
            # all four inputs go to the device in one copy.
            host = torch.from_numpy(np.stack([lengths, fed + self.rope_deltas[rows], slots, u.view(np.int64)]))
            if self.device.type == "cuda":
                host = host.pin_memory()
            on_device, positions, slots, u = host.to(self.device, non_blocking=True)
            self._step_inputs = StepInputs(on_device, positions, slots, u.view(torch.float64), int(lengths.max()))
        return self._step_inputs

    def shared_prefixes(self, block_size: int, group_width: int) -> tuple[PrefixGroups, int] | None:
        """The running rows that share their group's full prompt blocks, in groups of at
        most `group_width` rows (a larger group is cut: each piece reads the prompt once),
        and the most blocks any row holds past the ones it shares (its tail), for this
        step; None when no two rows share a block. The same PrefixGroups object until a
        row joins or leaves."""
        if self._prefix_groups is None or self._prefix_groups[0] != group_width:
            self._prefix_groups = (group_width, *self._find_prefix_groups(block_size, group_width))
        _, groups, shared_blocks = self._prefix_groups
        if groups is None:
            return None
        lengths = self.lengths[self.rows]
        return groups, int((-(-lengths // block_size) - shared_blocks).max())

    def _find_prefix_groups(self, block_size: int, group_width: int) -> tuple[PrefixGroups | None, np.ndarray]:
        """Live sequences hold the same block only when they forked from one prompt, and
        then share all of its full blocks (never copied: copy-on-write touches only a
        partial last block), so the first block identifies a group. A sequence recomputed
        after a preemption has blocks of its own and is in no group."""
        members: dict[int, list[int]] = {}
        for i, s in enumerate(self.seqs):
            if s.num_prompt >= block_size:
                members.setdefault(s.block_table[0], []).append(i)
        groups = [rows[i:i + group_width] for rows in members.values() if len(rows) > 1
                  for i in range(0, len(rows), group_width)]
        if not groups:
            return None, np.zeros(0, np.int64)
        tables = [self.seqs[rows[0]].block_table[:self.seqs[rows[0]].num_prompt // block_size] for rows in groups]
        shared_blocks = np.zeros(len(self.seqs), np.int64)
        for rows, table in zip(groups, tables):
            shared_blocks[rows] = len(table)
        found = PrefixGroups.build(groups, tables, len(self.seqs), self.sink_block, block_size, self.device)
        return found, shared_blocks

    def uniforms(self, start: int = 0) -> torch.Tensor:
        """The sampler's U, on the device, of the running sequences from index `start` on:
        the decode step's (`step_inputs`), or after a prefill, theirs alone."""
        if self._step_inputs is not None:
            return self._step_inputs.uniforms[start:]
        rows = self.rows[start:]
        return to_device(self.token_uniforms[rows, self.lengths[rows]], self.device)

    def advance(self, tokens: torch.Tensor, start: int = 0) -> Advanced:
        """Issue the token sampled for each running sequence from index `start` on, still on
        the device: it is the next step's input, and each row's length grows by one."""
        self.last_tokens[self.device_rows[start:]] = tokens
        rows = self.rows[start:]
        positions = self.lengths[rows]
        self.lengths[rows] = positions + 1
        self._step_inputs = None
        return Advanced(rows, positions)

    def record(self, advanced: Advanced, tokens: np.ndarray, logprobs: np.ndarray) -> list[int]:
        """Record the tokens `advance` issued and their logprobs, read back to the host (one
        per row of the step), for the rows still running; returns the running indices,
        ascending, of those now done (a stop token, or their maximum length)."""
        index = self.running_index[advanced.rows]
        live = index >= 0
        rows, positions = advanced.rows[live], advanced.positions[live]
        tokens = tokens[live]
        self.sampled_tokens[rows, positions] = tokens
        self.sampled_logprobs[rows, positions] = logprobs[live]
        self.recorded[rows] = positions + 1
        done = (positions + 1 >= self.max_lengths[rows]) | self.is_stop.take(tokens, mode="clip")
        return index[live][done].tolist()  # rows keep their order: ascending

    def live(self, advanced: Advanced) -> np.ndarray:
        """Which rows of an advanced step still run (the others finished at the step before)."""
        return self.running_index[advanced.rows] >= 0

    def settled(self) -> bool:
        """Whether the host has recorded every token issued."""
        return bool((self.recorded[self.rows] == self.lengths[self.rows]).all())

    def runs_on(self) -> bool:
        """Whether some running sequence goes on past the tokens issued (none has reached its maximum length)."""
        return bool((self.lengths[self.rows] < self.max_lengths[self.rows]).any())

    def blocks_needed(self, block_size: int) -> int:
        """At most how many new blocks the next decode step takes: one per row starting
        a block, or just joined (a copy-on-write of its shared last block)."""
        return int(self._needing_blocks(block_size)[1].sum())

    def rewind(self, advanced: Advanced) -> None:
        """Undo `advance` for the rows still running, so that their step runs again from the
        same inputs (to locate non-finite logits): their lengths, and the tokens they fed,
        which the host holds."""
        live = self.live(advanced)
        rows, positions = advanced.rows[live], advanced.positions[live]
        self.lengths[rows] = positions
        fed = self.sampled_tokens[rows, positions - 1]
        self.last_tokens[to_device(rows, self.device)] = to_device(fed, self.device)
        self._step_inputs = None

    def leave(self, indices: list[int]) -> list[Sequence]:
        """Take the running sequences at these indices (ascending) out of the batch,
        with the tokens and logprobs they sampled here written back to their lists."""
        if not indices:
            return []
        seqs = [self.seqs[i] for i in indices]
        for s in seqs:
            sampled = slice(len(s), int(self.recorded[s.decode_row]))
            s.token_ids += self.sampled_tokens[s.decode_row, sampled].tolist()
            s.logprobs += self.sampled_logprobs[s.decode_row, sampled].tolist()
        rows = [s.decode_row for s in seqs]
        self.host_block_tables[rows] = self.sink_block
        self.block_tables[to_device(rows, self.device)] = self.sink_block
        self._set_rows(np.delete(self.rows, indices))
        for i in reversed(indices):
            del self.seqs[i]
        for s in seqs:
            self.free_rows.append(s.decode_row)
            s.decode_row = -1
        return seqs
