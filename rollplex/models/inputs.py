"""What a prompt is, everywhere: the data side makes one, the engine generates
from it, the trainer packs it with its responses.

`Prompt` is one prompt's token ids with its images' and videos' processor
outputs; `Sample` is one generated response; `Group` is a prompt with the n
samples drawn for it (a GRPO group), as the engine returns it and as the
training passes read it. A multi-turn (agentic) sample's response holds, besides
the tokens the policy sampled, the `Observation`s its tools or environment
returned: context, which no loss, KL or logprob comparison counts. `VisionEmbeds` are a prompt's (or batch's) vision
features once the tower has run, kept for the passes that read them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollplex.models.rope import mrope_positions


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
    instead of running the tower again. Rows follow the order of the pad tokens.

    A family with DeepStack (Qwen3-VL) also keeps, per kind, the merged features
    of some early vision blocks, (levels, rows, hidden): the decoder adds level i
    to its hidden states at the pad tokens after decoder layer i. None elsewhere."""

    image: torch.Tensor | None = None
    video: torch.Tensor | None = None
    image_deepstack: torch.Tensor | None = None
    video_deepstack: torch.Tensor | None = None

    @classmethod
    def concat(cls, parts: list[VisionEmbeds | None]) -> VisionEmbeds:
        """Several prompts' features, prompt after prompt (the order of their pad tokens)."""
        present = [p for p in parts if p is not None]

        def cat(name: str, dim: int) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in present if getattr(p, name) is not None]
            return torch.cat(tensors, dim) if tensors else None

        return cls(cat("image", 0), cat("video", 0), cat("image_deepstack", 1), cat("video_deepstack", 1))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (to check or move them all)."""
        return [t for t in (self.image, self.video, self.image_deepstack, self.video_deepstack) if t is not None]


@dataclass
class VisionSlots:
    """Where a packed input's vision features go: the token rows of its image and
    of its video pad tokens (prompt tokens only), as index tensors on the input's device."""

    image: torch.Tensor
    video: torch.Tensor

    @classmethod
    def find(cls, args, input_ids: torch.Tensor, prompt_mask: torch.Tensor | None = None) -> VisionSlots:
        """The pad tokens of `args.image_token_id` and `args.video_token_id`. Reads the
        token ids on the host (nonzero): a prompt forward that must not wait on the
        device finds its slots before it starts."""
        rows = []
        for token_id in (args.image_token_id, args.video_token_id):
            mask = input_ids == token_id
            if prompt_mask is not None:
                mask &= prompt_mask
            rows.append(mask.nonzero().flatten())
        return cls(*rows)


@dataclass
class Observation:
    """What a tool or an environment answered, inside a multi-turn sample's response:
    tokens the policy reads but did not sample. `prompt` holds them as the chat template
    rendered them (vision pads expanded) with their images, as a prompt holds its own;
    `positions` are their M-RoPE positions counted from 0 (rollplex.models.rope.mrope_positions),
    which `rope.response_positions` shifts to where the observation starts."""

    start: int  # index in the response of its first token
    prompt: Prompt
    positions: torch.Tensor  # (3, len) long
    rope_delta: int  # what it adds to the rope delta of the tokens after it
    text: str = ""  # as the model reads it (the samples file shows it)

    @classmethod
    def of(cls, prompt: Prompt, start: int, spec, text: str = "") -> Observation:
        """`prompt`'s tokens as an observation starting at response index `start`; `spec`: the
        model's `RopeIndexSpec` (`args.rope_spec`). A pad / grid mismatch is a ValueError."""
        positions, delta = mrope_positions(prompt.input_ids, spec, prompt.image_grid_thw, prompt.video_grid_thw,
                                           prompt.second_per_grid_ts)
        return cls(start, prompt, positions, delta, text)

    def __len__(self) -> int:
        return len(self.prompt.input_ids)

    @property
    def end(self) -> int:
        return self.start + len(self)


@dataclass
class EpisodeLog:
    """How a multi-turn sample's episode went (rollplex.agent): the reward function and
    the metrics read it."""

    turns: int = 1  # the policy's turns
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, hung, returned a value that is no observation, or did not parse
    rewards: list[float] = field(default_factory=list)  # an environment's reward at each of its steps
    messages: list[dict] = field(default_factory=list)  # the trajectory as chat messages (images as placeholders)
    seconds: float = 0.0  # tool / environment time, summed over its calls


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]
    # float32 logprob of each token under logits / temperature (greedy: the logits'); 0.0 at an observation's tokens
    logprobs: list[float]
    # "stop" (EOS or a stop token), "length" (max_tokens or the model's maximum length); a multi-turn episode's
    # also "max_turns" (it asked for a tool on its last allowed turn)
    finish_reason: str
    # MoE models with routing replay (rollplex.models.moe): the top-k experts of each token, per decoder layer, as
    # the forward that fed it routed them: its prompt's (prompt len, layers, k), shared by the group's samples, and
    # its response's (response len, layers, k) int16, UNRECORDED for a token no forward fed (the last one).
    prompt_routes: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    # A multi-turn sample: the observations inside its response, in order, and how its episode went.
    observations: list[Observation] = field(default_factory=list)
    episode: EpisodeLog | None = None

    def sampled_mask(self) -> torch.Tensor:
        """(len(token_ids),) bool: True at the tokens the policy sampled, False at observations'."""
        mask = torch.ones(len(self.token_ids), dtype=torch.bool)
        for o in self.observations:
            mask[o.start:o.end] = False
        return mask

    @property
    def sampled_tokens(self) -> int:
        return len(self.token_ids) - sum(len(o) for o in self.observations)


@dataclass
class Group:
    """A prompt and the samples drawn for it."""

    prompt: Prompt
    samples: list[Sample]
    vision: VisionEmbeds | None = None  # the prompt's vision features when the engine computed them

    @property
    def responses(self) -> list[list[int]]:
        return [s.token_ids for s in self.samples]
