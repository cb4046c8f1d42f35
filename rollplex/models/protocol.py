"""What the engine, the trainer and the RL loop may call on a model, whatever
its family (rollplex.models.qwen2_5_vl is the one today), and what reading a
family's checkpoint raises.

A model takes packed tokens (no padding) and an attention backend from
rollplex.ops.attention; it holds no parallelism (each family's `tp_plan` splits
it from outside) and reads its head counts off its weights, so a TP-sharded
model runs unchanged.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch

from rollplex.models.rope import RopeIndexSpec
from rollplex.ops.attention import AttentionBackend

# position_ids (3, T), or the rotary (cos, sin) they give, which decode steps read off a table.
Positions = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read: the message says what is wrong and where."""


class RopeArgs(Protocol):
    """A family's args as packing reads them (rollplex.models.packing): its M-RoPE
    positions and where its vision pad tokens are."""

    @property
    def rope_spec(self) -> RopeIndexSpec: ...


class VisionLanguageModel(Protocol):
    """The calls made on a model from outside rollplex.models. Vision features are
    the family's own object, passed back to it as they came."""

    args: Any

    @property
    def device(self) -> torch.device: ...

    def encode_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> Any:
        """A prompt's (or batch's) images and videos -> their features."""

    def layer_by_layer(self, h: torch.Tensor, position_ids: Positions,
                       attn: AttentionBackend) -> Iterator[torch.Tensor]:
        """Embedded tokens through the decoder one layer at a time: the hidden state
        after each layer, then the final normed state."""

    def forward_generated(self, input_ids: torch.Tensor, position_ids: Positions,
                          attn: AttentionBackend) -> torch.Tensor:
        """Final hidden states of generated (text) tokens: the decode forward."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits over the vocabulary."""

    def kv_heads_per_rank(self) -> int:
        """The KV heads this rank's attention layers hold (a share of them under tensor parallelism)."""
