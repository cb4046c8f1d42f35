"""Paged KV-cache bookkeeping: which blocks each sequence uses, and who shares them.

The KV pool is `num_blocks` blocks of `block_size` token slots each; token i of
a sequence lives in slot `block_table[i // block_size] * block_size + i %
block_size`. This module only hands out block ids and counts references; it
never touches KV tensors. When a write needs a private copy of a shared block
(copy-on-write), it returns a (src, dst) instruction and the runner copies the
KV.

GRPO samples n responses per prompt. The prompt is prefilled once and the n
children are forked from it: they share every prompt block. Full blocks stay
shared for good; a partial last block is copied by each child the first time
it writes its own token there.
"""

from __future__ import annotations

import heapq
from collections import Counter


class NoFreeBlocks(Exception):
    """Not enough free blocks for an allocation; the scheduler preempts and retries."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # A min-heap, so the lowest free id is always handed out first: runs are
        # deterministic and tests can predict block ids.
        self.free_blocks = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free

    def allocate(self, num_tokens: int) -> list[int]:
        """Fresh (unshared) blocks for a prompt of `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        n = self.blocks_needed(num_tokens)
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks for {num_tokens} tokens, {self.num_free} free")
        return [self._take() for _ in range(n)]

    def fork(self, block_table: list[int]) -> list[int]:
        """A child sequence sharing all of the parent's blocks; returns the child's table."""
        for block in block_table:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"cannot fork a table holding block {block}, which is not allocated")
        for block in block_table:
            self.ref_counts[block] += 1
        return list(block_table)

    def append_slot(self, block_table: list[int], num_tokens: int) -> tuple[int, tuple[int, int] | None]:
        """Make room for token `num_tokens - 1`; `block_table` covers the tokens before it.

        Returns the token's flat KV slot and, after a copy-on-write, the
        (src_block, dst_block) whose already written slots the runner must copy
        before writing. `block_table` is updated in place. Raises NoFreeBlocks,
        changing nothing, when a block is needed and none is free.
        """
        idx = num_tokens - 1
        if idx < 0 or len(block_table) != self.blocks_needed(idx):
            raise ValueError(
                f"block table of {len(block_table)} blocks does not cover exactly the "
                f"{idx} tokens before token {idx} (block_size {self.block_size})"
            )
        copy = None
        if idx % self.block_size == 0:
            block_table.append(self._take())
        elif self.ref_counts[block_table[-1]] > 1:
            # Other sequences still read this block's written slots: write into a
            # private copy and leave theirs untouched.
            src, dst = block_table[-1], self._take()
            self.ref_counts[src] -= 1
            block_table[-1] = dst
            copy = (src, dst)
        return block_table[-1] * self.block_size + idx % self.block_size, copy

    def blocks_to_extend(self, block_table: list[int], start: int, end: int) -> int:
        """How many free blocks `extend(block_table, start, end)` takes."""
        index = start // self.block_size
        shared = index < len(block_table) and self.ref_counts[block_table[index]] > 1
        return max(0, self.blocks_needed(end) - len(block_table)) + shared

    def extend(self, block_table: list[int], start: int, end: int) -> tuple[int, int] | None:
        """Room for tokens [start, end) of a sequence whose table covers at least the `start`
        tokens before them (a multi-turn episode's next turn, written after its earlier ones).
        Returns the (src_block, dst_block) copy to make first when token `start`'s block was
        shared (copy-on-write), else None. `block_table` is updated in place; raises
        NoFreeBlocks, changing nothing, when too few blocks are free."""
        if len(block_table) < self.blocks_needed(start):
            raise ValueError(f"block table of {len(block_table)} blocks does not cover the {start} tokens before "
                             f"token {start} (block_size {self.block_size})")
        needed = self.blocks_to_extend(block_table, start, end)
        if needed > self.num_free:
            raise NoFreeBlocks(f"need {needed} blocks for tokens [{start}, {end}), {self.num_free} free")
        copy = None
        index = start // self.block_size
        if index < len(block_table) and self.ref_counts[block_table[index]] > 1:
            src, dst = block_table[index], self._take()
            self.ref_counts[src] -= 1
            block_table[index] = dst
            copy = (src, dst)
        block_table += [self._take() for _ in range(self.blocks_needed(end) - len(block_table))]
        return copy

    def free(self, block_table: list[int]) -> None:
        """Drop this sequence's references; blocks nobody uses any more become free."""
        # Check everything before changing anything, so a bad call leaves no half-freed table.
        for block, times in Counter(block_table).items():
            if times > self.ref_counts[block]:
                raise ValueError(
                    f"block {block} freed {times} time(s) but its ref count is "
                    f"{self.ref_counts[block]}: double free?"
                )
        for block in block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                heapq.heappush(self.free_blocks, block)
        block_table.clear()

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat KV slots of tokens [start, end)."""
        if not 0 <= start <= end <= len(block_table) * self.block_size:
            raise ValueError(
                f"tokens [{start}, {end}) out of range of a table of {len(block_table)} blocks "
                f"(block_size {self.block_size})"
            )
        bs = self.block_size
        return [block_table[i // bs] * bs + i % bs for i in range(start, end)]

    def _take(self) -> int:
        if not self.free_blocks:
            raise NoFreeBlocks("no free block for the next token")
        block = heapq.heappop(self.free_blocks)
        self.ref_counts[block] = 1
        return block

