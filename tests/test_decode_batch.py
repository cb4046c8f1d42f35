"""The running sequences' decode state (rollplex.engine.decode_batch): a row written
when a sequence joins, a token per step, the stop checks, a sequence's state read
through its row while it decodes, and taken along when it leaves (finished, or
preempted to be recomputed)."""

import numpy as np
import torch

from rollplex.engine.decode_batch import DecodeBatch
from rollplex.engine.sampler import uniforms
from rollplex.engine.sequence import PromptState, Request, Sequence
from rollplex.models.inputs import Prompt

SINK, STOP = 9, 99
PROMPT = [1, 2, 3, 4, 5]


def group(n: int, max_length: int) -> PromptState:
    return PromptState(0, Request(Prompt(torch.tensor(PROMPT)), n=n), torch.zeros(3, len(PROMPT), dtype=torch.long), rope_delta=7,
                       seeds=[11 + j for j in range(n)], max_length=max_length)


def step(batch: DecodeBatch, tokens: list[int], logprobs: list[float], start: int = 0) -> list[int]:
    """Issue a step's tokens and record them at once (no step ahead)."""
    return batch.record(batch.advance(torch.tensor(tokens), start), np.array(tokens), np.array(logprobs, np.float32))


def test_a_sequence_from_join_to_leave():
    p = group(n=2, max_length=8)
    batch = DecodeBatch([p], num_rows=3, max_blocks=4, sink_block=SINK, stop_ids={STOP}, device=torch.device("cpu"))
    a, b = (Sequence(p, j, list(PROMPT), block_table=[0, 1 + j]) for j in range(2))
    assert batch.join([a, b]) == 0
    rows = [a.decode_row, b.decode_row]
    inputs = batch.step_inputs(block_size=4)
    assert inputs.lengths.tolist() == [5, 5] and inputs.longest == 5  # the first token to sample is token 5
    assert inputs.positions.tolist() == [4 + 7, 4 + 7]  # the fed token, index 4, + the rope delta
    assert inputs.slots.tolist() == [1 * 4 + 0, 2 * 4 + 0]  # index 4: the first slot of each one's block 1
    # Each sample's own seed, at the index of the token it samples.
    assert torch.equal(batch.uniforms(), uniforms(torch.tensor([11, 12]), torch.tensor([5, 5])))
    assert batch.step_inputs(block_size=4) is inputs  # made once per step
    assert batch.block_tables[rows].tolist() == [[0, 1, SINK, SINK], [0, 2, SINK, SINK]]

    assert step(batch, [STOP, 40], [-0.5, -1.5]) == [0]  # a samples a stop token
    assert batch.leave([0]) == [a]
    assert (a.token_ids, a.logprobs, a.decode_row) == (PROMPT + [STOP], [-0.5], -1)
    assert batch.seqs == [b] and batch.rows.tolist() == [b.decode_row]
    assert (b.token_ids, b.logprobs, len(b)) == (PROMPT + [40], [-1.5], len(PROMPT) + 1)  # read through its row
    b.block_table[-1] = 6  # a private copy of its block 1 (copy-on-write): the fed token, index 5, goes there
    batch.last_blocks_changed([0])
    assert batch.block_tables[b.decode_row].tolist() == [0, 6, SINK, SINK]
    assert batch.step_inputs(block_size=4).slots.tolist() == [6 * 4 + 1]

    assert step(batch, [141], [-1.0]) == []  # an id past the largest stop id is no stop
    assert batch.last_tokens[b.decode_row] == 141 and batch.step_inputs(block_size=4).lengths.tolist() == [7]
    assert torch.equal(batch.uniforms(), uniforms(torch.tensor([12]), torch.tensor([7])))
    assert step(batch, [42], [-2.0]) == [0]  # at its maximum length, 8 tokens
    batch.leave([0])
    assert (b.token_ids, b.logprobs) == (PROMPT + [40, 141, 42], [-1.5, -1.0, -2.0])

    # A row comes back with a table of sink blocks past the new sequence's own.
    c = Sequence(p, 0, list(PROMPT), block_table=[3])
    assert batch.join([c]) == 0 and c.decode_row in rows
    assert batch.block_tables[c.decode_row].tolist() == [3, SINK, SINK, SINK]


def test_a_preempted_sequence_takes_its_samples_along_and_resumes_after_them():
    p = group(n=3, max_length=20)
    batch = DecodeBatch([p], num_rows=3, max_blocks=8, sink_block=SINK, stop_ids=set(), device=torch.device("cpu"))
    seqs = [Sequence(p, j, list(PROMPT), block_table=[0, 1]) for j in range(3)]
    batch.join(seqs)
    step(batch, [20, 30, 40], [-2.0, -3.0, -4.0])
    step(batch, [21, 31, 41], [-2.5, -3.5, -4.5])
    (youngest,) = batch.leave([2])  # what the scheduler does to preempt
    assert (youngest.token_ids, youngest.logprobs) == (PROMPT + [40, 41], [-4.0, -4.5])
    # Recomputed (prefill of its 7 tokens), it joins again and samples from token 7 on.
    youngest.block_table = [2, 3]
    assert batch.join([youngest]) == 2
    assert torch.equal(batch.uniforms(2), uniforms(torch.tensor([13]), torch.tensor([7])))  # after its prefill
    assert batch.step_inputs(block_size=4).lengths.tolist() == [7, 7, 7]
    assert torch.equal(batch.uniforms(2), uniforms(torch.tensor([13]), torch.tensor([7])))
    assert step(batch, [42], [-5.0], start=2) == []
    batch.leave([0, 1, 2])
    assert [s.token_ids[len(PROMPT):] for s in seqs] == [[20, 21], [30, 31], [40, 41, 42]]
    assert seqs[2].logprobs == [-4.0, -4.5, -5.0]
    assert len(batch) == 0 and sorted(batch.free_rows) == [0, 1, 2]


def test_rows_needing_blocks_are_those_starting_a_block_or_just_joined():
    p = group(n=3, max_length=20)
    batch = DecodeBatch([p], num_rows=4, max_blocks=8, sink_block=SINK, stop_ids=set(), device=torch.device("cpu"))
    batch.join([Sequence(p, j, list(PROMPT)) for j in range(3)])
    step(batch, [20, 30, 40], [0.0] * 3)  # 6 tokens each: the next one written is token 5
    assert batch.rows_needing_blocks(block_size=4) == ([0, 1, 2], [6, 6, 6])  # just joined: maybe shared
    step(batch, [21, 31, 41], [0.0] * 3)
    assert batch.rows_needing_blocks(block_size=4) == ([], [])  # token 6 goes in their own block 1
    step(batch, [22, 32, 42], [0.0] * 3)
    assert batch.rows_needing_blocks(block_size=4) == ([], [])
    step(batch, [23, 33, 43], [0.0] * 3)
    assert batch.join([Sequence(p, 0, list(PROMPT))]) == 3
    step(batch, [50], [0.0], start=3)
    assert batch.rows_needing_blocks(block_size=4) == ([0, 1, 2, 3], [9, 9, 9, 6])  # token 8 starts block 2


def test_a_step_issued_ahead_drops_the_token_of_a_sequence_that_finished_before_it():
    """The engine issues the next step before it records this one's tokens: a sequence
    that stops at the first runs the second too, and its token there is dropped; `rewind`
    takes a step back to run it again."""
    p = group(n=2, max_length=20)
    batch = DecodeBatch([p], num_rows=2, max_blocks=8, sink_block=SINK, stop_ids={STOP}, device=torch.device("cpu"))
    a, b = (Sequence(p, j, list(PROMPT), block_table=[0, 1]) for j in range(2))
    batch.join([a, b])
    first = batch.advance(torch.tensor([STOP, 40]))
    assert batch.last_tokens[[a.decode_row, b.decode_row]].tolist() == [STOP, 40]  # the next step's input
    assert batch.step_inputs(block_size=4).lengths.tolist() == [6, 6] and not batch.settled()
    second = batch.advance(torch.tensor([50, 41]))  # issued before the first is recorded

    assert batch.record(first, np.array([STOP, 40]), np.array([-0.5, -1.5], np.float32)) == [0]
    assert batch.leave([0]) == [a]
    assert a.token_ids == PROMPT + [STOP]  # not its token of the second step
    assert batch.live(second).tolist() == [False, True]
    assert batch.record(second, np.array([50, 41]), np.array([-0.1, -2.5], np.float32)) == []
    assert batch.settled() and batch.step_inputs(block_size=4).lengths.tolist() == [7]

    third = batch.advance(torch.tensor([42]))
    batch.rewind(third)  # back to the third step's inputs: b's length and the token it fed
    assert batch.step_inputs(block_size=4).lengths.tolist() == [7] and batch.last_tokens[b.decode_row] == 41
    batch.leave([0])
    assert (b.token_ids, b.logprobs) == (PROMPT + [40, 41], [-1.5, -2.5])
