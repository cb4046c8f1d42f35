"""The running sequences' decode state, kept in persistent tensors between steps.

A sequence that starts decoding takes a row of these tensors and keeps it until
it finishes or is preempted. Its row is written once when it joins (seed, rope
delta, block table, the length where it stops), then updated in place: one token
per step, and one block-table entry when the block manager gives it a new or a
private block. A decode step reads its inputs off the running rows and records
its sampled tokens and stop checks with a few tensor operations for the whole
batch: no Python work per sequence, except for the few that need a block, finish
or are preempted.

Where each tensor lives:
- on the host (CPU), what the scheduler reads every step without waiting on the
  device: each row's length, the length where it stops, and the tokens and
  logprobs it sampled, at their positions in the sequence (a sequence's own lists
  catch up when it leaves the batch: to make its Sample, or to be recomputed
  after a preemption);
- on the model's device, what the model and the sampler read: each row's last
  token, seed, rope delta and block table.

`seqs` and `rows` are the running sequences and their rows in running order,
oldest first: the scheduler preempts from the end.
"""

from __future__ import annotations

import torch

from rollplex.engine.sequence import PromptState, Sequence


class DecodeBatch:
    def __init__(self, prompts: list[PromptState], num_rows: int, max_blocks: int, sink_block: int,
                 stop_ids: set[int], device: torch.device):
        self.sink_block, self.device = sink_block, device
        self.seqs: list[Sequence] = []
        self.free_rows = list(range(num_rows - 1, -1, -1))  # pop() hands out the lowest row first
        # Host.
        self.lengths = torch.zeros(num_rows, dtype=torch.long)  # tokens so far; the last one's KV is not stored yet
        self.max_lengths = torch.zeros(num_rows, dtype=torch.long)  # done at this length
        self.just_joined = torch.zeros(num_rows, dtype=torch.bool)  # no decode step scheduled since it joined
        # Column i: token i of the row's sequence and its logprob, once sampled here (prompts' stay unset).
        longest = max((p.max_length for p in prompts), default=0)
        self.sampled_tokens = torch.empty(num_rows, longest, dtype=torch.long)
        self.sampled_logprobs = torch.empty(num_rows, longest)
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        # Device.
        self.last_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)  # what the next step feeds
        self.seeds = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.rope_deltas = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.block_tables = torch.full((num_rows, max_blocks), sink_block, dtype=torch.int32, device=device)
        self._set_rows(torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.seqs)

    def _set_rows(self, rows: torch.Tensor) -> None:
        self.rows, self.device_rows = rows, rows.to(self.device)

    def join(self, seqs: list[Sequence]) -> int:
        """Start decoding `seqs` (whose next token is still to be sampled) after the
        running ones; returns the running index of the first."""
        first = len(self.seqs)
        for s in seqs:
            s.decode_row = self.free_rows.pop()
        rows = torch.tensor([s.decode_row for s in seqs])
        self.lengths[rows] = torch.tensor([len(s) for s in seqs])
        self.max_lengths[rows] = torch.tensor([s.prompt.max_length for s in seqs])
        self.just_joined[rows] = True
        on_device = rows.to(self.device)
        self.seeds[on_device] = torch.tensor([s.prompt.seeds[s.sample_index] for s in seqs], device=self.device)
        self.rope_deltas[on_device] = torch.tensor([s.prompt.rope_delta for s in seqs], device=self.device)
        # Columns past a table stay the sink block (reset when a sequence leaves).
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [self.sink_block] * (width - len(s.block_table)) for s in seqs]
        self.block_tables[on_device, :width] = torch.tensor(tables, dtype=torch.int32, device=self.device)
        self.seqs += seqs
        self._set_rows(torch.cat([self.rows, rows]))
        return first

    def rows_needing_blocks(self, block_size: int) -> tuple[list[int], list[int]]:
        """Running indices, ascending, and lengths of the sequences whose next token
        needs the block manager: it starts a new block, or the sequence joined since
        the last decode step and its last block may be shared with its group
        (copy-on-write). Called once per decode step: the joined ones count as seen afterwards."""
        lengths = self.lengths[self.rows]
        needs = ((lengths - 1) % block_size == 0) | self.just_joined[self.rows]
        self.just_joined[self.rows] = False
        indices = needs.nonzero().squeeze(1)
        return indices.tolist(), lengths[indices].tolist()

    def last_blocks_changed(self, indices: list[int]) -> None:
        """Copy the last block-table entry of these running sequences to their rows
        (the block manager gave them a new block, or a private copy of a shared one)."""
        if not indices:
            return
        seqs = [self.seqs[i] for i in indices]
        rows = torch.tensor([s.decode_row for s in seqs], device=self.device)
        columns = torch.tensor([len(s.block_table) - 1 for s in seqs], device=self.device)
        blocks = torch.tensor([s.block_table[-1] for s in seqs], dtype=torch.int32, device=self.device)
        self.block_tables[rows, columns] = blocks

    def sampling_inputs(self, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Seeds and positions (the index of the token to sample) on the device, of the
        running sequences from index `start` on."""
        return self.seeds[self.device_rows[start:]], self.lengths[self.rows[start:]].to(self.device)

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, start: int = 0) -> list[int]:
        """Record the token sampled for each running sequence from index `start` on;
        returns the running indices of those now done (a stop token, or their maximum length)."""
        self.last_tokens[self.device_rows[start:]] = tokens
        rows = self.rows[start:]
        tokens, logprobs = tokens.cpu(), logprobs.cpu()  # the step's one wait on the device
        positions = self.lengths[rows]
        self.sampled_tokens[rows, positions] = tokens
        self.sampled_logprobs[rows, positions] = logprobs
        lengths = positions + 1
        self.lengths[rows] = lengths
        done = (lengths >= self.max_lengths[rows]) | torch.isin(tokens, self.stop_ids)
        return [start + i for i in done.nonzero().squeeze(1).tolist()]

    def leave(self, indices: list[int]) -> list[Sequence]:
        """Take the running sequences at these indices (ascending) out of the batch,
        with the tokens and logprobs they sampled here written back to their lists."""
        if not indices:
            return []
        seqs = [self.seqs[i] for i in indices]
        for s in seqs:
            sampled = slice(len(s), int(self.lengths[s.decode_row]))
            s.token_ids += self.sampled_tokens[s.decode_row, sampled].tolist()
            s.logprobs += self.sampled_logprobs[s.decode_row, sampled].tolist()
        rows = torch.tensor([s.decode_row for s in seqs])
        self.block_tables[rows.to(self.device)] = self.sink_block
        keep = torch.ones(len(self.seqs), dtype=torch.bool)
        keep[indices] = False
        self._set_rows(self.rows[keep])
        for i in reversed(indices):
            del self.seqs[i]
        for s in seqs:
            self.free_rows.append(s.decode_row)
            s.decode_row = -1
        return seqs
