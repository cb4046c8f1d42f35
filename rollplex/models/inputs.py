"""What a prompt is, everywhere: the data side makes one, the engine generates
from it, the trainer packs it with its responses.

`Prompt` is one prompt's token ids with its images' and videos' processor
outputs; `Sample` is one generated response; `Group` is a prompt with the n
samples drawn for it (a GRPO group), as the engine returns it and as the
training passes read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rollplex.models.qwen2_5_vl import VisionEmbeds


@dataclass
class Prompt:
    """One prompt: token ids (pad tokens already expanded, one per merged patch)
    and the processor's vision tensors for its images and videos."""

    input_ids: torch.Tensor  # (L,) long
    pixel_values: torch.Tensor | None = None  # (image patches, C*T*p*p)
    image_grid_thw: torch.Tensor | None = None  # (images, 3)
    pixel_values_videos: torch.Tensor | None = None  # (video patches, C*T*p*p)
    video_grid_thw: torch.Tensor | None = None  # (videos, 3)
    second_per_grid_ts: torch.Tensor | None = None  # (videos,) seconds per temporal patch
    text: str = ""  # the rendered prompt before pad expansion, when it came from text

    @property
    def has_vision(self) -> bool:
        return self.pixel_values is not None or self.pixel_values_videos is not None


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]
    logprobs: list[float]  # float32 logprob of each token under logits / temperature (greedy: the logits')
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens or the model's maximum length)


@dataclass
class Group:
    """A prompt and the samples drawn for it."""

    prompt: Prompt
    samples: list[Sample]
    vision: VisionEmbeds | None = None  # the prompt's vision features when the engine computed them

    @property
    def responses(self) -> list[list[int]]:
        return [s.token_ids for s in self.samples]
