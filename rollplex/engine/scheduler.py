"""Continuous batching: which sequences run in the next step.

Each step is either a prefill (waiting sequences whose prompt, or prompt plus
tokens generated before a preemption, is computed from scratch) or a decode
(every running sequence advances by one token). Prefill goes first, so new
work joins the running batch as soon as blocks allow.

The running sequences are the rows of a `DecodeBatch`. A decode step asks the
block manager for the few sequences whose next token starts a block (or that
just joined, whose last block may be shared); every other sequence's KV slot
follows from its block-table row and length, on the tensors. Sampled tokens go
to the batch, whose stop checks say which sequences finish.

When decode needs a block and none is free, the youngest running sequence is
preempted: its blocks are freed and it waits to be recomputed. It then resumes
with the same tokens it had, so no request is dropped, and under greedy decoding
(or seeded sampling, whose noise depends only on seed and position) it finishes
with the same tokens it would have produced without the preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from rollplex.engine.block_manager import BlockManager, NoFreeBlocks
from rollplex.engine.decode_batch import DecodeBatch
from rollplex.engine.sequence import Sequence


@dataclass
class Step:
    seqs: list[Sequence]
    is_prefill: bool
    copies: list[tuple[int, int]]  # decode: copy-on-write block copies to make before the step


class Scheduler:
    def __init__(self, block_manager: BlockManager, batch: DecodeBatch, max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.blocks, self.batch = block_manager, batch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0

    @property
    def running(self) -> list[Sequence]:
        return self.batch.seqs

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        prefill = self._schedule_prefill()
        if prefill:
            return Step(prefill, True, [])
        return self._schedule_decode()

    def _schedule_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        tokens = 0
        seqs_after = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            group = seq.prompt.request.n if seq.is_group_prompt else 1
            if seqs_after + group > self.max_num_seqs and (batch or self.running):
                break
            # A prompt longer than the token budget still runs, alone.
            if batch and tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.blocks.can_allocate(len(seq)):
                break
            seq.block_table = self.blocks.allocate(len(seq))
            self.waiting.popleft()
            batch.append(seq)
            tokens += len(seq)
            seqs_after += group
        return batch

    def _schedule_decode(self) -> Step:
        """Room for every running sequence's next token. Where the pool is short, the
        youngest sequences are preempted, in the order a per-sequence walk in running
        order would preempt them."""
        copies, grown = [], []
        for i, length in zip(*self.batch.rows_needing_blocks(self.blocks.block_size)):
            if i >= len(self.running):
                break  # preempted, with every sequence after it
            copy = self._grow(i, length)
            if i < len(self.running):
                grown.append(i)
            if copy is not None:
                copies.append(copy)
        if not self.running:
            raise RuntimeError("the KV pool cannot hold even one sequence; give the engine more KV memory")
        self.batch.last_blocks_changed(grown)
        return Step(list(self.running), False, copies)

    def _grow(self, i: int, length: int) -> tuple[int, int] | None:
        """Room in running[i]'s blocks for its next token (at index length - 1),
        preempting the youngest sequences (running[i] itself last) until there is;
        returns the copy-on-write copy to make, if any."""
        seq = self.running[i]
        while True:
            try:
                return self.blocks.append_slot(seq.block_table, length)[1]
            except NoFreeBlocks:
                self._preempt_youngest()
                if len(self.running) == i:
                    return None

    def _preempt_youngest(self) -> None:
        (seq,) = self.batch.leave([len(self.running) - 1])
        self.blocks.free(seq.block_table)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def start(self, seqs: list[Sequence]) -> int:
        """Sequences that finished prefill and decode from now on (their next token is
        still to be sampled); returns the running index of the first."""
        return self.batch.join(seqs)

    def append(self, tokens: torch.Tensor, logprobs: torch.Tensor, start: int = 0) -> list[Sequence]:
        """Record the sampled token of each running sequence from index `start` on;
        returns the sequences that finished, their blocks freed."""
        finished = self.batch.leave(self.batch.append(tokens, logprobs, start))
        for seq in finished:
            self.blocks.free(seq.block_table)
        return finished
