"""Continuous batching: which sequences run in the next step.

Each step is either a prefill (waiting sequences whose prompt, or prompt plus
tokens generated before a preemption, is computed from scratch) or a decode
(every running sequence advances by one token). Prefill goes first, so new
work joins the running batch as soon as blocks allow.

The running sequences are the rows of a `DecodeBatch`. A decode step asks the
block manager for the few sequences whose next token starts a block (or that
just joined, whose last block may be shared); every other sequence's KV slot
follows from its block-table row and length, on the tensors. Sampled tokens go
to the batch, which holds a running sequence's tokens and whose stop checks say
which sequences finish.

When decode needs a block and none is free, the youngest running sequence is
preempted: its blocks are freed and it waits to be recomputed. It then resumes
with the same tokens it had, so no request is dropped, and under greedy decoding
(or seeded sampling, whose noise depends only on seed and position) it finishes
with the same tokens it would have produced without the preemption.

The scheduler owns each sequence's life: a request's prompt is admitted as one
waiting sequence; when it is scheduled for prefill its n children fork off it
(sharing its blocks, copy-on-write on the last partial one) and join the running
batch, to sample their first tokens from its logits; each step's sampled tokens
are issued to the batch when the step runs and recorded when the host has them
(`finish`), and a sequence that finishes records its sample and frees its blocks.

A multi-turn sample (with `episodes`, rollplex.engine.episodes) whose turn ends
pauses: it leaves the decode batch, keeps its blocks, and waits in `paused` for its
observation; `resume` appends it and hands its images to be encoded (the engine's
low-priority vision stream), and once they are (`queue_prepared`) it is queued for a
prefill of its new tokens onto the K/V it holds (the front of the queue: finishing it
frees its blocks). A paused episode's
blocks are the first to go when decode needs blocks (before any running sequence is
preempted), and when nothing runs and the waiting sequence at the front cannot get its
blocks (then a waiting episode's too): it is recomputed whole, as after a preemption.

The engine schedules a decode step before the host has read the previous one's
tokens (`can_run_ahead`) unless the step may need what only those tokens tell:
a prefill (a sequence that finishes makes room for it), or a preemption (the
preempted sequence takes its tokens along).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from rollplex.engine.block_manager import BlockManager, NoFreeBlocks
from rollplex.engine.decode_batch import Advanced, DecodeBatch
from rollplex.engine.episodes import Episodes, SampleKey
from rollplex.engine.sequence import PromptState, Sequence
from rollplex.models.inputs import Observation, VisionEmbeds


class Ready(Protocol):
    """When work on another stream is done (a torch.cuda.Event): an observation's images encoded."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclass
class Step:
    """One engine step: the sequences the model runs, and those that sample a token
    from its logits (running indices `first` on)."""

    seqs: list[Sequence]  # prefill: whole sequences, end to end; decode: every running sequence's last token
    is_prefill: bool
    sampling: list[Sequence]  # prefill: the sequences that decode from it on (a group prompt's children)
    first: int = 0  # the running index of sampling[0]
    slots: list[list[int]] = field(default_factory=list)  # prefill: each sequence's KV slot per token
    logit_rows: list[int] | None = None  # prefill: which sequence's logits each of `sampling` samples from
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies to make first


class Scheduler:
    def __init__(self, block_manager: BlockManager, batch: DecodeBatch, max_num_seqs: int,
                 max_num_batched_tokens: int, episodes: Episodes | None = None):
        self.blocks, self.batch = block_manager, batch
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.episodes = episodes
        self.waiting: deque[Sequence] = deque()
        self.paused: dict[SampleKey, Sequence] = {}  # multi-turn samples waiting for their observations
        # Continued multi-turn samples whose observations' images are being encoded, and when they will be ready.
        self.preparing: list[tuple[Sequence, Ready | None]] = []
        self.num_preemptions = 0
        self.num_released_episodes = 0  # paused or waiting episodes whose blocks were given up (recomputed)

    @property
    def running(self) -> list[Sequence]:
        return self.batch.seqs

    def add(self, prompt: PromptState) -> None:
        """Admit a request: its prompt waits for prefill, as one sequence for the whole group."""
        self.waiting.append(Sequence(prompt, -1, prompt.request.prompt.input_ids.tolist()))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused or self.preparing)

    def can_step(self) -> bool:
        """Whether a step can be scheduled now (else every unfinished sample waits for an observation)."""
        return bool(self.waiting or self.running)

    def can_run_ahead(self) -> bool:
        """Whether the next step may be scheduled while the host has not yet recorded the
        step in flight: it is a decode step (no waiting sequence could be prefilled now),
        it takes no more blocks than are free (no preemption), and some running sequence
        goes on past the step in flight (else it would only be wasted)."""
        if self.waiting and self._fits(self.waiting[0], len(self.running), bool(self.running)):
            return False
        return self.batch.runs_on() and self.batch.blocks_needed(self.blocks.block_size) <= self.blocks.num_free

    def schedule(self) -> Step:
        prefill, copies = self._schedule_prefill()
        if prefill:
            return self._fork(prefill, copies)
        return self._schedule_decode()

    def _fork(self, prefill: list[Sequence], copies: list[tuple[int, int]]) -> Step:
        """The prefill step of `prefill`, whose sequences decode from it on: a group
        prompt's n children take over its blocks (shared), a recomputed sequence goes on
        as itself. They join the running batch now; their first tokens are sampled from
        the step's logits."""
        slots = [self.blocks.slots(s.block_table, s.num_cached, len(s)) for s in prefill]
        rows, decoding = [], []
        for i, s in enumerate(prefill):
            n = s.prompt.request.n if s.is_group_prompt else 1
            rows += [i] * n
            decoding += ([Sequence(s.prompt, j, list(s.token_ids), self.blocks.fork(s.block_table))
                          for j in range(n)] if s.is_group_prompt else [s])
        for s in prefill:
            if s.is_group_prompt:
                self.blocks.free(s.block_table)
        first = self.batch.join(decoding)
        return Step(prefill, True, decoding, first, slots, rows, copies)

    def _schedule_prefill(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """The waiting sequences the next step prefills, and the block copies to make first."""
        batch: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        tokens = 0
        seqs_after = len(self.running)
        if self.waiting and not self.running:
            self._make_room(self.waiting[0])
        while self.waiting:
            seq = self.waiting[0]
            new_tokens = len(seq) - seq.num_cached
            # A prompt longer than the token budget still runs, alone.
            if not self._fits(seq, seqs_after, bool(batch or self.running)) or (
                    batch and tokens + new_tokens > self.max_num_batched_tokens):
                break
            if seq.num_cached:  # an episode's next turn, onto the K/V its blocks hold
                copy = self.blocks.extend(seq.block_table, seq.num_cached, len(seq))
                copies += [copy] if copy is not None else []
            else:
                seq.block_table = self.blocks.allocate(len(seq))
            self.waiting.popleft()
            batch.append(seq)
            tokens += new_tokens
            seqs_after += seq.prompt.request.n if seq.is_group_prompt else 1
        return batch, copies

    def _fits(self, seq: Sequence, seqs_after: int, accompanied: bool) -> bool:
        """Whether waiting `seq` may be prefilled with `seqs_after` sequences decoding: its
        group stays within max_num_seqs (or runs alone), and the blocks it needs are free."""
        group = seq.prompt.request.n if seq.is_group_prompt else 1
        return (seqs_after + group <= self.max_num_seqs or not accompanied) and self._blocks_for(seq) <= \
            self.blocks.num_free

    def _blocks_for(self, seq: Sequence) -> int:
        if seq.num_cached:
            return self.blocks.blocks_to_extend(seq.block_table, seq.num_cached, len(seq))
        return self.blocks.blocks_needed(len(seq))

    def _make_room(self, seq: Sequence) -> None:
        """With nothing running, give up episodes' blocks (`_release_an_episode`) until `seq` at the
        front of the queue fits: they would otherwise hold the pool while each waits for blocks only
        the others could free."""
        while self._blocks_for(seq) > self.blocks.num_free and self._release_an_episode(keep=seq):
            pass

    def _release_an_episode(self, keep: Sequence | None = None) -> bool:
        """Free the blocks of the youngest paused episode, else of the youngest waiting one that holds
        blocks (but `keep`): it is recomputed whole when it continues, as after a preemption. False
        when none holds any."""
        holders = ([s for s in self.paused.values() if s.block_table] or [s for s, _ in self.preparing if s.block_table]
                   or [s for s in self.waiting if s.num_cached and s is not keep])
        if not holders:
            return False
        victim = holders[-1]
        self.blocks.free(victim.block_table)
        victim.forget_kept()
        self.num_released_episodes += 1
        return True

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
        running = list(self.running)
        return Step(running, False, running, copies=copies)

    def _grow(self, i: int, length: int) -> tuple[int, int] | None:
        """Room in running[i]'s blocks for its next token (at index length - 1),
        giving up paused episodes' blocks first, then preempting the youngest
        sequences (running[i] itself last) until there is;
        returns the copy-on-write copy to make, if any."""
        seq = self.running[i]
        while True:
            try:
                return self.blocks.append_slot(seq.block_table, length)[1]
            except NoFreeBlocks:
                if self._release_an_episode():  # an episode waiting for its tool holds blocks it does not use now
                    continue
                self._preempt_youngest()
                if len(self.running) == i:
                    return None

    def _preempt_youngest(self) -> None:
        assert self.batch.settled(), "preemption needs every issued token on the host: the engine ran ahead too far"
        (seq,) = self.batch.leave([len(self.running) - 1])
        self.blocks.free(seq.block_table)
        seq.forget_kept()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, advanced: Advanced, tokens: np.ndarray, logprobs: np.ndarray, ran_ahead: bool = False,
               keep_state: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None) -> list[Sequence]:
        """Record an issued step's tokens and their logprobs, read back to the host
        (`DecodeBatch.record`, which decides which sequences finish); returns the sequences
        that finished, their samples recorded and blocks freed. A multi-turn sample whose turn
        ended and whose episode goes on pauses instead (`paused`): `ran_ahead`, a decode step
        issued after this one fed its last token; `keep_state(row)`, a recurrent model's state
        of the row it leaves."""
        done = []
        finished = self.batch.record(advanced, tokens, logprobs)
        rows = [self.running[i].decode_row for i in finished]
        for seq, row in zip(self.batch.leave(finished), rows):
            if self.episodes is not None and seq.finish_reason == "stop":
                reason = self.episodes.end_turn(_key(seq), seq.token_ids[seq.num_prompt:])
                if reason is None:
                    seq.pause(ran_ahead, None if keep_state is None else keep_state(row))
                    if ran_ahead and self.batch.routes is not None:
                        self.batch.routes.fed_last(seq, row)
                    self.paused[_key(seq)] = seq
                    continue
                seq.end_episode(reason)
            self._record(seq)
            done.append(seq)
        return done

    def resume(self, key: SampleKey, outcome: Observation | str,
               encode: Callable[[Observation], tuple[VisionEmbeds, Ready | None]]) -> Sequence | None:
        """A paused sample's observation is ready: it is appended, its images handed to `encode`
        (features, and when they will be ready), and the sample is prepared (`queue_prepared` queues it
        for its prefill). Or its episode ends (`outcome` its finish reason; then returned, its sample
        recorded). An observation that leaves no room for one more sampled token ends it as "length",
        not appended: the episode is trained as far as it went."""
        seq = self.paused.pop(key)
        if isinstance(outcome, str) or len(seq) + len(outcome) >= seq.prompt.max_length:
            seq.end_episode(outcome if isinstance(outcome, str) else "length")
            self._record(seq)
            return seq
        seq.continue_with(outcome)
        ready = None
        if outcome.prompt.has_vision:
            seq.observation_vision[-1], ready = encode(outcome)
        self.preparing.append((seq, ready))
        return None

    def queue_prepared(self, wait: bool) -> None:
        """Queue, at the front, the continued episodes whose observations' images are encoded
        (`Ready.query`); with `wait`, when none is, wait for the first (nothing else can run)."""
        ready = [(seq, r) for seq, r in self.preparing if r is None or r.query()]
        if wait and not ready and self.preparing:
            self.preparing[0][1].synchronize()
            ready = self.preparing[:1]
        for seq, _ in ready:
            self.waiting.appendleft(seq)
        self.preparing = [(seq, r) for seq, r in self.preparing if all(seq is not s for s, _ in ready)]

    def _record(self, seq: Sequence) -> None:
        """A finished sequence's sample, recorded; its blocks freed."""
        sample = seq.sample()
        routes = self.batch.routes
        if routes is not None:
            sample.prompt_routes, sample.routes = seq.prompt.routes, routes.sample_routes(seq)
        if self.episodes is not None:
            sample.episode = self.episodes.finish(_key(seq), sample)
        seq.prompt.samples[seq.sample_index] = sample
        self.blocks.free(seq.block_table)


def _key(seq: Sequence) -> SampleKey:
    return seq.prompt.index, seq.sample_index
