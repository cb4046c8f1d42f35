"""Requests and the sequences they become.

A request is one prompt with `n` samples (a GRPO group); generation returns a
`Group` per request (rollplex.models.inputs). The engine prefills
the prompt once as a single "prompt" sequence, off which the scheduler forks n
child sequences that share the prompt's KV blocks: each samples its first token
from the prompt's logits, then decodes independently.

A sequence's tokens, logprobs and finish reason have one owner at a time: the
sequence itself while it waits or is done, and its row of the engine's
`DecodeBatch` while it decodes (the batch writes a step's tokens for every row
at once, with no Python work per sequence). `token_ids`, `logprobs`, `len()`
and `finish_reason` read whichever owns them, so no reader ever sees a copy
that is behind.

A multi-turn (agentic) sample pauses when its turn ends: it leaves the decode
batch but keeps its KV blocks, and when its tool's or environment's observation
comes back, the observation's tokens are appended and prefilled onto the KV it
already has (`num_cached`: the tokens whose K/V its blocks hold), its earlier
turns never computed again. Its M-RoPE positions continue across the turns
(rollplex.models.rope.response_positions), and only the prompt's and the
observations' image pads take vision features (`context_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from rollplex.models.inputs import Observation, Prompt, Sample, VisionEmbeds
from rollplex.models.rope import response_positions


@dataclass
class Request:
    """One prompt and how many samples to draw from it (a GRPO group)."""

    prompt: Prompt
    n: int = 1
    seed: int | None = None  # this request's own sampling seed; default: from SamplingParams.seed and its index
    max_tokens: int | None = None  # this request's generation limit; default: SamplingParams.max_tokens
    vision: VisionEmbeds | None = None  # the prompt's vision features when already encoded (on these weights)


@dataclass(eq=False)
class PromptState:
    """Per-request data every sequence of the group shares."""

    index: int
    request: Request
    positions: torch.Tensor  # (3, prompt_len) M-RoPE position ids of the prompt
    rope_delta: int
    seeds: list[int]  # one sampling seed per child
    max_length: int  # a sample is done at this length: prompt + max_tokens, at most the model's maximum
    vision: VisionEmbeds | None = None  # filled at the first prefill, reused by recomputes
    samples: list[Sample | None] = field(default_factory=list)
    routes: torch.Tensor | None = None  # (prompt len, layers, k): its prefill's experts, when recorded (engine.routes)

    @property
    def has_vision(self) -> bool:
        return self.request.prompt.has_vision


class DecodeRows(Protocol):
    """What holds a decoding sequence's state: the engine's `DecodeBatch`, by row."""

    def token_ids_of(self, row: int) -> list[int]: ...
    def logprobs_of(self, row: int) -> list[float]: ...
    def finish_reason_of(self, row: int) -> str | None: ...
    def length_of(self, row: int) -> int: ...


class Sequence:
    """A group's prompt before its prefill, or one of its samples."""

    def __init__(self, prompt: PromptState, sample_index: int, token_ids: list[int],
                 block_table: list[int] | None = None):
        self.prompt = prompt
        self.sample_index = sample_index  # -1 for the group's prompt sequence, else the child's index
        self.block_table = [] if block_table is None else block_table
        # Its own state, while no DecodeBatch holds it (`batch` is None).
        self._token_ids, self._logprobs = token_ids, []
        self._finish_reason: str | None = None
        self.batch: DecodeRows | None = None  # the decode batch that holds its state while it decodes
        self.decode_row = -1  # its row there
        # Its response tokens' recorded experts, as (first response index, routes) pieces (rollplex.engine.routes).
        self.route_pieces: list[tuple[int, torch.Tensor]] = []
        # A multi-turn sample: the observations appended to it so far, each one's vision features once encoded
        # (by its prefill), and how many of its tokens have their K/V in its blocks when it waits to continue an
        # episode (0: its next prefill computes every token).
        self.observations: list[Observation] = []
        self.observation_vision: list[VisionEmbeds | None] = []
        self.num_cached = 0
        # While it waits for an observation: how many of its tokens its blocks hold K/V of (all, or all but the last
        # sampled one, which no decode step fed), and a recurrent model's state after exactly those.
        self.kept_len = 0
        self.kept_state: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def token_ids(self) -> list[int]:
        """Its prompt and the tokens it has sampled (those the host has read back)."""
        return self._token_ids if self.batch is None else self.batch.token_ids_of(self.decode_row)

    @property
    def logprobs(self) -> list[float]:
        """The logprob of each token it has sampled."""
        return self._logprobs if self.batch is None else self.batch.logprobs_of(self.decode_row)

    @property
    def finish_reason(self) -> str | None:
        """"stop" or "length" once it has finished, else None."""
        return self._finish_reason if self.batch is None else self.batch.finish_reason_of(self.decode_row)

    def __len__(self) -> int:
        return len(self._token_ids) if self.batch is None else self.batch.length_of(self.decode_row)

    def attach(self, batch: DecodeRows, row: int) -> None:
        """It starts decoding in `batch`'s `row`, which has taken its state over."""
        self.batch, self.decode_row = batch, row
        self._token_ids, self._logprobs = [], []

    def detach(self, token_ids: list[int], logprobs: list[float], finish_reason: str | None) -> None:
        """It leaves its decode batch (finished, or preempted to be recomputed) with its state."""
        self.batch, self.decode_row = None, -1
        self._token_ids, self._logprobs, self._finish_reason = token_ids, logprobs, finish_reason

    @property
    def is_group_prompt(self) -> bool:
        return self.sample_index < 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt.request.prompt.input_ids)

    @property
    def rope_delta(self) -> int:
        """The rope delta of the tokens it samples next: its prompt's, plus its observations'."""
        return self.prompt.rope_delta + sum(o.rope_delta for o in self.observations)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions (3, end - start) of tokens [start, end): the prompt's own,
        then the response's (sampled tokens and observations)."""
        p = self.prompt
        n_prompt = self.num_prompt
        parts = []
        if start < n_prompt:
            parts.append(p.positions[:, start:min(end, n_prompt)])
        if end > n_prompt:
            response, _ = response_positions(n_prompt, p.rope_delta, end - n_prompt, self.observations,
                                             p.positions.device)
            parts.append(response[:, max(start - n_prompt, 0):])
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def context_mask(self, start: int, end: int) -> torch.Tensor:
        """(end - start,) bool: True at the tokens it did not sample (its prompt's and its
        observations'), the only ones whose vision pads take vision features."""
        index = torch.arange(start, end)
        mask = index < self.num_prompt
        for o in self.observations:
            mask |= (index >= self.num_prompt + o.start) & (index < self.num_prompt + o.end)
        return mask

    def pause(self, last_token_fed: bool, state: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """It waits for an observation, out of the decode batch: its blocks hold the K/V of every
        token it has when a decode step already fed its last one (run ahead), else of all but that
        one; `state`: a recurrent model's state after those same tokens."""
        self.kept_len = len(self) if last_token_fed else len(self) - 1
        self.kept_state = state

    def forget_kept(self) -> None:
        """Its blocks (and kept state) went to others: its next prefill computes every token."""
        self.num_cached, self.kept_len, self.kept_state = 0, 0, None

    def continue_with(self, observation: Observation) -> None:
        """Its episode goes on: `observation`'s tokens follow the ones it has (a placeholder
        logprob of 0.0 each) and its next prefill computes them (with its last sampled token
        where no decode step fed it) onto the K/V its blocks hold (`pause`)."""
        assert self.batch is None, "a sequence continues its episode once it has left the decode batch"
        if observation.start != len(self) - self.num_prompt:
            raise ValueError(f"an observation starting at response index {observation.start} cannot follow a "
                             f"response of {len(self) - self.num_prompt} tokens")
        self.num_cached = self.kept_len if self.block_table else 0
        self._token_ids = self._token_ids + observation.prompt.input_ids.tolist()
        self._logprobs = self._logprobs + [0.0] * len(observation)
        self._finish_reason = None
        self.observations.append(observation)
        self.observation_vision.append(None)

    def end_episode(self, finish_reason: str) -> None:
        """Its episode ends (it stopped, or waited, outside the decode batch) with `finish_reason`."""
        assert self.batch is None
        self._finish_reason = finish_reason

    def sample(self) -> Sample:
        """Its response as a finished sample."""
        return Sample(self.token_ids[self.num_prompt:], self.logprobs, self.finish_reason,
                      observations=list(self.observations))
