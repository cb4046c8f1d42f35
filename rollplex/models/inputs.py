"""What a prompt is, everywhere: the data side makes one, the engine generates
from it, the trainer packs it with its responses.

`Prompt` is one prompt's token ids with its images' and videos' processor
outputs; `Sample` is one generated response; `Group` is a prompt with the n
samples drawn for it (a GRPO group), as the engine returns it and as the
training passes read it. `VisionEmbeds` are a prompt's (or batch's) vision
features once the tower has run, kept for the passes that read them again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
class VisionEmbeds:
    """Merged vision features of a batch, kept so that later passes reuse them
    instead of running the tower again. Rows follow the order of the pad tokens."""

    image: torch.Tensor | None = None
    video: torch.Tensor | None = None

    @classmethod
    def concat(cls, parts: list[VisionEmbeds | None]) -> VisionEmbeds:
        """Several prompts' features, prompt after prompt (the order of their pad tokens)."""
        images = [p.image for p in parts if p is not None and p.image is not None]
        videos = [p.video for p in parts if p is not None and p.video is not None]
        return cls(torch.cat(images) if images else None, torch.cat(videos) if videos else None)


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
