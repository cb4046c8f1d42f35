"""The running sequences' decode state, kept in persistent arrays between steps.

A sequence that starts decoding takes a row of these arrays and keeps it until
it finishes or is preempted. The row is then the one owner of the sequence's
state: its tokens (prompt included), their logprobs, its length and its finish
reason; the `Sequence` reads them through it (rollplex.engine.sequence) and
holds them itself again when it leaves. So a stop rule, or anything else that
reads what a sequence has sampled, reads it here. The row is written once when
the sequence joins (the lists of its tokens and logprobs so far, taken over as
they are, rope delta, block table, the length where it stops, the sampler's U
for every token it may sample),
then updated in place: one token per step, and one block-table entry when the
block manager gives it a new or a private block. A decode step reads its
inputs off the running rows and records its sampled tokens and stop checks with
a few array operations for the whole batch: no Python work per sequence, except
for the few that need a block, finish or are preempted.

Where each array lives:
- on the host, as numpy arrays, what the scheduler reads every step without
  waiting on the device: each row's length, the length where it stops, the
  tokens and logprobs it samples here, at their positions in the sequence, and
  its finish reason; and what the step's inputs are made from, with the lengths: each
  row's rope delta and U per token. numpy, not torch: a step's bookkeeping is
  a few dozen operations on a few hundred numbers, and numpy dispatches each
  several times faster, the more so right after the model has swept the caches;
- on the model's device, what the model and the sampler read: each row's last
  token and block table (torch), and the step's inputs (`StepInputs`), made on
  the host (from a copy of the block tables there) and copied over in one
  transfer per step.

A step's tokens are recorded in two parts, so that the host can schedule the
next step before it reads this one's tokens back (the engine runs one step
ahead): `advance` when the step is issued, with the tokens still on the device
(each row's length grows by one and the tokens become the next step's input),
and `record` once they are on the host (the tokens and logprobs stored, the stop
checks and finish reasons). A row that finished at one step has run the next one
before the host knows: `record` drops that token. Rows join, and are preempted,
only when every issued token is recorded (`settled`).

`seqs` and `rows` are the running sequences and their rows in running order,
oldest first: the scheduler preempts from the end. `rows` is replaced, never
written in place, whenever a sequence joins or leaves, so a reader may keep what
it derived from one `rows` array until it changes (rollplex.engine.cascade does).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rollplex.device import to_device
from rollplex.engine.routes import RouteLog
from rollplex.engine.sampler import uniforms
from rollplex.engine.sequence import PromptState, Sequence

# A row's finish, by code: still running, ended at a stop token, reached its maximum length.
RUNNING, STOPPED, AT_MAX_LENGTH = 0, 1, 2
FINISH_REASONS = (None, "stop", "length")


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
                 stop_ids: set[int], device: torch.device, routes: RouteLog | None = None):
        self.sink_block, self.device = sink_block, device
        self.routes = routes  # the generation's recorded experts (MoE routing replay), by row like the rest
        self.seqs: list[Sequence] = []
        self.free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest row first
        # Host.
        self.lengths = np.zeros(num_rows, np.int64)  # tokens so far; the last one's KV is not stored yet
        self.recorded = np.zeros(num_rows, np.int64)  # of those, the ones on the host: all but the step in flight
        self.running_index = np.full(num_rows, -1, np.int64)  # each row's index in running order; -1: free
        self.max_lengths = np.zeros(num_rows, np.int64)  # done at this length
        self.finish_codes = np.zeros(num_rows, np.int8)  # RUNNING, STOPPED or AT_MAX_LENGTH
        self.just_joined = np.zeros(num_rows, bool)  # no decode step scheduled since it joined
        self.rope_deltas = np.zeros(num_rows, np.int64)
        # Per row: the tokens and logprobs its sequence joined with (its prompt, and those it sampled before a
        # preemption), the sequence's own lists, handed over as they are; nothing changes them while it decodes.
        self.joined_tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self.joined_logprobs: list[list[float]] = [[] for _ in range(num_rows)]
        # Column i: token i of the row's sequence and its logprob, once sampled here (those it joined with stay
        # unset), and the sampler's U for it, from the sequence's seed, set for every token it may sample when it joins.
        longest = max((p.max_length for p in prompts), default=0)
        self.tokens = np.empty((num_rows, longest), np.int64)
        self.token_logprobs = np.empty((num_rows, longest), np.float32)
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

    def join(self, seqs: list[Sequence]) -> int:
        """Start decoding `seqs` (whose next token is still to be sampled) after the
        running ones, their rows taking their state over; returns the running index of the first."""
        assert self.settled(), "a sequence joins only when every issued token is recorded"
        first = len(self.seqs)
        rows = np.array([self.free_rows.pop() for _ in seqs], np.int64)
        self.lengths[rows] = self.recorded[rows] = [len(s) for s in seqs]
        self.max_lengths[rows] = [s.prompt.max_length for s in seqs]
        self.finish_codes[rows] = RUNNING
        self.just_joined[rows] = True
        self.joined_since_step = True
        self.rope_deltas[rows] = [s.rope_delta for s in seqs]
        # An observation's vision may move a multi-turn sample's positions past its prompt's bound.
        self.max_position = max(self.max_position, *(s.prompt.max_length + max(s.rope_delta, 0) for s in seqs))
        self._hash_uniforms(rows, seqs)
        # Columns past a table stay the sink block (reset when a sequence leaves).
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [self.sink_block] * (width - len(s.block_table)) for s in seqs]
        self.host_block_tables[rows, :width] = tables
        self.block_tables[to_device(rows, self.device), :width] = to_device(tables, self.device, torch.int32)
        for s, row in zip(seqs, rows.tolist()):
            self.joined_tokens[row], self.joined_logprobs[row] = s.token_ids, s.logprobs
            s.attach(self, row)
        if self.routes is not None:
            self.routes.joined(seqs, rows.tolist())
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
        per row of the step), for the rows still running, and whether each finished: at a
        stop token, or at its maximum length. Returns the running indices, ascending, of
        those now finished. The one place that decides when a sequence ends."""
        index = self.running_index[advanced.rows]
        live = index >= 0
        rows, positions = advanced.rows[live], advanced.positions[live]
        tokens = tokens[live]
        self.tokens[rows, positions] = tokens
        self.token_logprobs[rows, positions] = logprobs[live]
        self.recorded[rows] = positions + 1
        stopped = self.is_stop.take(tokens, mode="clip")
        at_max_length = positions + 1 >= self.max_lengths[rows]
        self.finish_codes[rows] = np.where(stopped, STOPPED, np.where(at_max_length, AT_MAX_LENGTH, RUNNING))
        return index[live][stopped | at_max_length].tolist()  # rows keep their order: ascending

    def token_ids_of(self, row: int) -> list[int]:
        """The tokens of the sequence at `row` that the host has: its prompt, then those it sampled."""
        joined = self.joined_tokens[row]
        return joined + self.tokens[row, len(joined):self.recorded[row]].tolist()

    def logprobs_of(self, row: int) -> list[float]:
        """The logprob of each token the sequence at `row` sampled (and the host has)."""
        sampled_here = slice(len(self.joined_tokens[row]), self.recorded[row])
        return self.joined_logprobs[row] + self.token_logprobs[row, sampled_here].tolist()

    def finish_reason_of(self, row: int) -> str | None:
        """"stop" or "length" once the sequence at `row` has finished (`record`), else None."""
        return FINISH_REASONS[self.finish_codes[row]]

    def length_of(self, row: int) -> int:
        """How many tokens of the sequence at `row` the host has."""
        return int(self.recorded[row])

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
        fed = self.tokens[rows, positions - 1]
        self.last_tokens[to_device(rows, self.device)] = to_device(fed, self.device)
        self._step_inputs = None

    def leave(self, indices: list[int]) -> list[Sequence]:
        """Take the running sequences at these indices (ascending) out of the batch, each
        holding its state (tokens, logprobs, finish reason) itself again."""
        if not indices:
            return []
        seqs = [self.seqs[i] for i in indices]
        rows = [s.decode_row for s in seqs]
        for s, row in zip(seqs, rows):
            s.detach(self.token_ids_of(row), self.logprobs_of(row), self.finish_reason_of(row))
            self.joined_tokens[row], self.joined_logprobs[row] = [], []
            if self.routes is not None:
                self.routes.left(s, row)
        self.host_block_tables[rows] = self.sink_block
        self.block_tables[to_device(rows, self.device)] = self.sink_block
        self._set_rows(np.delete(self.rows, indices))
        for i in reversed(indices):
            del self.seqs[i]
        self.free_rows += rows
        return seqs
