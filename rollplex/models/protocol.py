"""What the engine, the trainer and the RL loop may call on a model, whatever
its family (rollplex.models.qwen2_5_vl is the one today), and what reading a
family's checkpoint raises.

A model takes packed tokens (no padding) and an attention backend from
rollplex.ops.attention; it holds no parallelism (each family's `tp_plan` splits
it from outside) and reads its head counts off its weights, so a TP-sharded
model runs unchanged.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

import torch

from rollplex.models.inputs import VisionEmbeds
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


@runtime_checkable
class VisionLanguageModel(Protocol):
    """The calls the engine makes on a model (rollplex.engine annotates its model
    with this), and those the trainer makes. A family's model is an nn.Module
    (parameters, buffers, train/eval) with these besides."""

    # The family's args; the engine reads text.num_hidden_layers, text.head_dim,
    # text.max_position_embeddings, eos_token_id and rope_spec (M-RoPE positions).
    args: Any
    attn_backend: str  # "torch" or "flash", as rollplex.ops.attention names them

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the engine's KV cache is kept in it)."""

    def encode_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> VisionEmbeds:
        """A prompt's (or batch's) images and videos -> their features."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionBackend,
                 vision: VisionEmbeds | None = None, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Packed prompt tokens (T,) with their vision features at the pad tokens -> final hidden states (prefill)."""

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

    def text_rotary_table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos | sin of text positions 0 .. num_positions - 1, which decode steps read rows of."""

    def decoder_stages(self) -> dict[str, torch.nn.Module]:
        """The text decoder's modules in order, by name: where a non-finite value is looked for."""
