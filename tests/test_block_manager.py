"""Tests for rollplex.engine.block_manager: paged KV blocks, ref counts, group prefix sharing."""

from __future__ import annotations

import pytest

from rollplex.engine.block_manager import BlockManager, NoFreeBlocks


def decode(bm: BlockManager, table: list[int], length: int, new_tokens: int) -> list[tuple[int, int]]:
    """Append `new_tokens` tokens to a sequence of `length` tokens, as the scheduler does; returns the copies."""
    copies = []
    for n in range(length + 1, length + new_tokens + 1):
        _, copy = bm.append_slot(table, n)
        if copy is not None:
            copies.append(copy)
    return copies


def test_allocate_lowest_ids_first_and_sizes():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free == 8
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.allocate(5) == [0, 1]
    assert bm.allocate(4) == [2]
    assert bm.num_free == 5
    assert bm.can_allocate(20) and not bm.can_allocate(21)


def test_append_slot_new_block_and_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(3)  # [0]
    assert bm.append_slot(table, 4) == (3, None)  # last slot of block 0
    assert table == [0]
    assert bm.append_slot(table, 5) == (4, None)  # token 4 starts block 1
    assert table == [0, 1]
    other = bm.allocate(1)  # [2]
    assert bm.append_slot(table, 6) == (5, None)
    decode(bm, table, 6, 3)  # tokens 6, 7 fill block 1; token 8 starts block 3
    assert table == [0, 1, 3] and other == [2]
    assert bm.slots(table, 0, 9) == [0, 1, 2, 3, 4, 5, 6, 7, 12]
    assert bm.slots(table, 7, 9) == [7, 12]
    with pytest.raises(ValueError, match="out of range"):
        bm.slots(table, 0, 13)


def test_append_slot_rejects_a_table_that_does_not_fit_the_length():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(4)
    with pytest.raises(ValueError, match="does not cover"):
        bm.append_slot(table, 10)


def test_group_fork_shares_prompt_and_copies_partial_last_block_once_per_child():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = bm.allocate(10)  # 2 full blocks + a partial one holding tokens 8, 9
    assert prompt == [0, 1, 2] and bm.num_free == 29

    n = 4
    children = [bm.fork(prompt) for _ in range(n)]
    assert all(c == prompt and c is not prompt for c in children)
    assert bm.num_free == 29  # forking is free

    for i, child in enumerate(children):
        slot, copy = bm.append_slot(child, 11)  # token 10 goes into the shared block 2
        dst = child[-1]
        assert copy == (2, dst) and dst == 3 + i
        assert child[:2] == [0, 1]  # full blocks stay shared
        assert slot == dst * 4 + 2
    assert bm.num_free == 29 - n  # prompt blocks + one copy per child
    # Block 2 is the parent's alone again: it writes in place.
    assert bm.append_slot(prompt, 11) == (2 * 4 + 2, None)

    # Later tokens of a child are private: no more copies, fresh blocks at 12 and 16.
    assert decode(bm, children[0], 11, 6) == []
    assert bm.num_free == 29 - n - 2

    bm.free(prompt)
    assert bm.num_free == 29 - n - 2 + 1  # only block 2 was the parent's alone
    for child in children:
        bm.free(child)
        assert child == []
    assert bm.num_free == 32  # no leak


def test_fork_of_a_block_aligned_prompt_needs_no_copy():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = bm.allocate(8)
    children = [bm.fork(prompt) for _ in range(3)]
    for i, child in enumerate(children):
        assert bm.append_slot(child, 9) == ((2 + i) * 4, None)  # token 8 starts a fresh block
    assert bm.num_free == 16 - 2 - 3
    for table in [prompt, *children]:
        bm.free(table)
    assert bm.num_free == 16


def test_free_blocks_are_reused():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(4)
    b = bm.allocate(4)
    bm.free(a)
    assert bm.allocate(3) == [0, 1]
    bm.free(b)
    assert bm.num_free == 2


def test_double_free_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate(4)
    stale = list(table)
    bm.free(table)
    with pytest.raises(ValueError, match="double free"):
        bm.free(stale)
    assert bm.num_free == 4

    # A table whose second block was already freed: the first is left alone.
    a, b = bm.allocate(2), bm.allocate(2)
    bm.free(list(b))
    with pytest.raises(ValueError, match="double free"):
        bm.free(a + b)
    bm.free(a)
    assert bm.num_free == 4

    with pytest.raises(ValueError, match="not allocated"):
        bm.fork(stale)


def test_no_free_blocks_leaves_state_unchanged():
    bm = BlockManager(num_blocks=3, block_size=4)
    prompt = bm.allocate(6)  # [0, 1]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(5)
    assert bm.num_free == 1

    child = bm.fork(prompt)
    bm.allocate(1)  # takes the last block
    with pytest.raises(NoFreeBlocks):
        bm.append_slot(child, 7)  # would copy-on-write block 1
    assert child == [0, 1] and bm.num_free == 0

    bm.free(prompt)  # block 1 is now the child's alone: no copy needed
    assert bm.append_slot(child, 7) == (6, None)
    with pytest.raises(NoFreeBlocks):
        bm.append_slot(child, 9)  # token 8 needs a new block
    assert child == [0, 1]
