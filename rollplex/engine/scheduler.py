"""Continuous batching: which sequences run in the next step.

Each step is either a prefill (waiting sequences whose prompt, or prompt plus
tokens generated before a preemption, is computed from scratch) or a decode
(every running sequence advances by one token). Prefill goes first, so new
work joins the running batch as soon as blocks allow.

When decode needs a block and none is free, the youngest running sequence is
preempted: its blocks are freed and it waits to be recomputed. It then resumes
with the same tokens it had, so no request is dropped, and under greedy decoding
(or seeded sampling, whose noise depends only on seed and position) it finishes
with the same tokens it would have produced without the preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rollplex.engine.block_manager import BlockManager, NoFreeBlocks
from rollplex.engine.sequence import Sequence


@dataclass
class Step:
    seqs: list[Sequence]
    is_prefill: bool
    slots: list[int]  # decode: the KV slot of each sequence's new token
    copies: list[tuple[int, int]]  # copy-on-write block copies to make before the step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        prefill = self._schedule_prefill()
        if prefill:
            return Step(prefill, True, [], [])
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
        scheduled, slots, copies = [], [], []
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            while True:
                try:
                    slot, copy = self.blocks.append_slot(seq.block_table, len(seq))
                    break
                except NoFreeBlocks:
                    if queue:
                        self._preempt(queue.pop())
                    else:
                        self._preempt(seq)
                        seq = None
                        break
            if seq is not None:
                scheduled.append(seq)
                slots.append(slot)
                if copy is not None:
                    copies.append(copy)
        self.running = scheduled
        if not scheduled:
            raise RuntimeError("the KV pool cannot hold even one sequence; give the engine more KV memory")
        return Step(scheduled, False, slots, copies)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def start(self, seqs: list[Sequence]) -> None:
        """Sequences that finished prefill and keep decoding."""
        self.running.extend(seqs)

    def finish(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
