"""What the engine, the trainer and the RL loop may call on a model, whatever
its family (each family's package is one implementation; rollplex.models.family
says what else a family provides), and what reading a family's checkpoint raises.

A model takes packed tokens (no padding) and an attention backend from
rollplex.ops.attention; it holds no parallelism (each family's `tp_plan` splits
it from outside) and reads its head counts off its weights, so a TP-sharded
model runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, TypeVar, runtime_checkable

import torch

from rollplex.models.inputs import VisionEmbeds, VisionSlots
from rollplex.models.rope import RopeIndexSpec
from rollplex.ops.attention import AttentionBackend

# position_ids (3, T), or the rotary (cos, sin) they give, which decode steps read off a table.
Positions = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read: the message says what is wrong and where."""


_Method = TypeVar("_Method", bound=Callable)
_FSDP_ENTRY = "_rollplex_fsdp_entry"


def fsdp_entry(method: _Method) -> _Method:
    """Marks a model method that the engine or trainer calls from outside and that
    reads the root module's own parameters (not only those of its blocks): FSDP2
    must gather the root there as it does in `forward` (rollplex.train.parallelize
    registers every marked method). Mark only methods that call no other entry:
    when entries nest, the outer one's end reshards the root."""
    setattr(method, _FSDP_ENTRY, True)
    return method


def fsdp_entry_methods(model_class: type) -> list[str]:
    """The names of the methods `fsdp_entry` marked on a model class (its bases included)."""
    return sorted(name for name in dir(model_class) if getattr(getattr(model_class, name), _FSDP_ENTRY, False))


@dataclass(frozen=True)
class RecurrentStateShapes:
    """The state one sequence keeps, on this rank, in each decoder layer that carries a
    recurrent state instead of K/V (Qwen3.5's Gated DeltaNet): the engine's state pool and
    the kept-prefix passes hold one per sequence."""

    layers: tuple[int, ...]  # the decoder layers that keep one, ascending
    conv: tuple[int, int]  # (channels, kernel - 1): the short convolution's last inputs, in the weights' dtype
    recurrent: tuple[int, int, int]  # (value heads, key dim, value dim), float32


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
    attn_backend: str  # "torch", "flash", "flex" or "varlen", as rollplex.ops.attention names them

    @property
    def device(self) -> torch.device: ...

    def set_attn_backend(self, name: str) -> None:
        """auto / torch / flash (rollplex.ops.attention), resolved for the model's device, for every attention."""

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

    def embed_prompts(self, input_ids: torch.Tensor, vision: VisionEmbeds | None,
                      slots: VisionSlots) -> torch.Tensor:
        """Prompt token embeddings with the vision features at their slots (a prompt
        forward that runs layer by layer starts here)."""

    def layer_by_layer(self, h: torch.Tensor, position_ids: Positions, attn: AttentionBackend,
                       vision: VisionEmbeds | None = None,
                       slots: VisionSlots | None = None) -> Iterator[torch.Tensor]:
        """Embedded tokens through the decoder one layer at a time: the hidden state
        after each layer, then the final normed state. A family that adds vision
        features inside the decoder (DeepStack) reads them from `vision` at `slots`."""

    def forward_generated(self, input_ids: torch.Tensor, position_ids: Positions,
                          attn: AttentionBackend) -> torch.Tensor:
        """Final hidden states of generated (text) tokens: the decode forward."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits over the vocabulary."""

    def kv_heads_per_rank(self) -> int:
        """The KV heads this rank's attention layers hold (a share of them under tensor parallelism)."""

    def kv_layers(self) -> list[int]:
        """The decoder layers whose attention keeps K/V, ascending (every layer of an attention-only decoder)."""

    def recurrent_state_shapes(self) -> RecurrentStateShapes | None:
        """What each sequence keeps in the layers that carry a recurrent state; None where no layer does."""

    def text_rotary_table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos | sin of text positions 0 .. num_positions - 1, which decode steps read rows of."""

    def decoder_stages(self) -> dict[str, torch.nn.Module]:
        """The text decoder's modules in order, by name: where a non-finite value is looked for."""
