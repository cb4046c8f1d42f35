"""Requests and the sequences they become.

A request is one prompt with `n` samples (a GRPO group); generation returns a
`Group` per request (rollplex.models.inputs). The engine prefills
the prompt once as a single "prompt" sequence, off which the scheduler forks n
child sequences that share the prompt's KV blocks: each samples its first token
from the prompt's logits, then decodes independently.

While a sequence decodes, the tokens and logprobs it samples are kept in the
engine's `DecodeBatch`, not in its own lists: they catch up when it leaves the
batch (it finished, or it was preempted and will be recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollplex.models.inputs import Prompt, Sample, VisionEmbeds
from rollplex.models.rope import generated_positions


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

    @property
    def has_vision(self) -> bool:
        return self.request.prompt.has_vision


@dataclass(eq=False)
class Sequence:
    prompt: PromptState
    sample_index: int  # -1 for the group's prompt sequence, else the child's index
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    decode_row: int = -1  # its row of the DecodeBatch while it decodes

    @property
    def is_group_prompt(self) -> bool:
        return self.sample_index < 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt.request.prompt.input_ids)

    def __len__(self) -> int:
        """Tokens in its own list: while it decodes, its DecodeBatch row is ahead."""
        return len(self.token_ids)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions (3, end - start) of tokens [start, end): the prompt's own,
        then the generated tokens'."""
        p = self.prompt
        n_prompt = self.num_prompt
        parts = []
        if start < n_prompt:
            parts.append(p.positions[:, start:min(end, n_prompt)])
        if end > n_prompt:
            parts.append(generated_positions(max(start, n_prompt), end, p.rope_delta, p.positions.device))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
