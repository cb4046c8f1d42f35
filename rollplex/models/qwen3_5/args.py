"""Qwen3.5's shape (the dense models): the args dataclasses, the named sizes and the
parameter counts the memory plan and FLOP counts read.

The vision tower is Qwen3-VL's without DeepStack, so its args are Qwen3-VL's
`VisionArgs` with no DeepStack blocks. The text decoder is hybrid: `layer_types`
says for each layer whether it is a Gated DeltaNet ("linear_attention") or a gated
full attention ("full_attention"); field names are Qwen3-VL's wherever the meaning
is the same, and transformers' Qwen3_5TextConfig's for the DeltaNet's own sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollplex.models.family import LinearParams, ParamCounts
from rollplex.models.qwen3_vl.args import VISION_MLP_WIDTHS, VisionArgs, vision_counts, vision_linear_params
from rollplex.models.qwen_vl.args import TINY_TOKEN_IDS, QwenVLArgs
from rollplex.models.rope import RopeIndexSpec

__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "PRESETS", "VISION_MLP_WIDTHS", "HybridArgs", "ModelArgs",
           "TextArgs", "VisionArgs", "count_params", "dense_mlp_params", "hybrid_layer_types", "kv_layers",
           "linear_params", "recurrent_state_bytes", "tiny_args", "vision_args"]

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> list[str]:
    """transformers' default pattern: every `full_attention_interval`-th layer is full attention, the rest DeltaNet."""
    return [FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


def vision_args(**sizes: int) -> VisionArgs:
    """Qwen3-VL's VisionArgs without DeepStack (Qwen3.5's tower), `sizes` replacing its defaults."""
    return VisionArgs(**{"out_hidden_size": 4096, **sizes}, deepstack_visual_indexes=[])


@dataclass
class TextArgs:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    # Full-attention layers: q_proj is twice num_attention_heads * head_dim wide ([q | gate] per head).
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    partial_rotary_factor: float = 0.25  # the first head_dim * factor dims of q and k rotate
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])  # sums to rotary_dim / 2
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)  # empty: hybrid_layer_types(num_hidden_layers)
    # Gated DeltaNet layers: key heads can be fewer than value heads (each serves a group of value heads).
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = hybrid_layer_types(self.num_hidden_layers)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet's convolution: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim


@dataclass
class HybridArgs(QwenVLArgs):
    """What every Qwen3.5's args hold, dense (`ModelArgs`) or MoE (rollplex.models.qwen3_5_moe):
    the tower, the hybrid decoder and Qwen3.5's vocabulary's token ids (the rest: `QwenVLArgs`).
    The two families' args are siblings, not parent and child, because the registry tells
    families apart by their args' class (isinstance)."""

    vision: VisionArgs = field(default_factory=vision_args)
    text: TextArgs = field(default_factory=TextArgs)
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    eos_token_id: int | list[int] | None = 248044  # the hub's text_config value (<|endoftext|>)
    bos_token_id: int | None = None

    @property
    def rope_spec(self) -> RopeIndexSpec:
        # As Qwen3-VL: every frame group of a video is its own block of t = 1, timestamps between them.
        return RopeIndexSpec(self.image_token_id, self.video_token_id, self.vision.spatial_merge_size,
                             tokens_per_second=1.0, split_video_frames=True)


@dataclass
class ModelArgs(HybridArgs):
    """Everything the dense model's shape and inputs depend on; built from a HF config.json."""


def tiny_args(tie: bool = False, layer_types: tuple[str, ...] = (LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION),
              depth: int = 2) -> ModelArgs:
    """A model of a few hundred thousand parameters for tests, with the Qwen VL tiny token
    ids (rollplex.models.qwen_vl.args.TINY_TOKEN_IDS). Both layer kinds; DeltaNet key heads
    (2) fewer than value heads (4); a quarter of head_dim 48 rotates, [2, 2, 2] over t, h, w."""
    return ModelArgs(
        vision=vision_args(depth=depth, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=36),
        text=TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
                      num_attention_heads=4, num_key_value_heads=2, head_dim=48, rope_theta=10000.0,
                      partial_rotary_factor=0.25, mrope_section=[2, 2, 2], max_position_embeddings=4096,
                      layer_types=list(layer_types), linear_key_head_dim=16, linear_value_head_dim=24,
                      linear_num_key_heads=2, linear_num_value_heads=4),
        tie_word_embeddings=tie, **TINY_TOKEN_IDS)


def _hub_size(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, value_heads: int, tie: bool,
              tower: dict) -> ModelArgs:
    text = TextArgs(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv_heads, linear_num_value_heads=value_heads)
    return ModelArgs(vision=vision_args(**tower, out_hidden_size=hidden), text=text, tie_word_embeddings=tie)


# The towers: the 9B and 27B take Qwen3-VL-8B's (27 blocks of 1152, transformers' default); the smaller ones a
# narrower one (remembered, not checked: 24 blocks of 1024 as Qwen3-VL-2B/4B's for the 2B and 4B, 12 blocks of 768
# for the 0.8B).
_LARGE_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)
_SMALL_TOWER = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)
_TINY_TOWER = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)

# Qwen/Qwen3.5-{0.8B,2B,4B,9B,27B}, written without hub access (check config.json before relying on a number).
# Every size: vocabulary 248320, head_dim 256 with a quarter rotating (mrope [11, 11, 10], rope_theta 1e7),
# DeltaNet heads of 128 with 16 key heads, 3 DeltaNet layers then 1 full attention, 262144 positions.
# - 9B: transformers' Qwen3_5TextConfig defaults ("Qwen3.5-9B style"), and a published fine-tune's config.json.
# - 27B: hidden 5120, 64 layers, 24 / 4 attention heads, MLP 17408 from its model card; 48 value heads is
#   remembered (MAX's Qwen3_5Config default), not checked.
# - 4B: hidden 2560, MLP 9216, 32 layers, 32 value heads from a derived config.json; 16 / 4 attention heads and
#   tied embeddings remembered.
# - 0.8B: hidden 1024, 24 layers, 8 / 2 attention heads from a model listing; MLP 3584 and 16 value heads from a
#   derived config.json; tied embeddings remembered.
# - 2B: least sure of all (hidden 2048, MLP 6144, 24 layers, 8 / 2 heads, 16 value heads, tied): remembered.
PRESETS: dict[str, ModelArgs] = {
    "qwen3.5-0.8b": _hub_size(1024, 3584, 24, 8, 2, 16, tie=True, tower=_TINY_TOWER),
    "qwen3.5-2b": _hub_size(2048, 6144, 24, 8, 2, 16, tie=True, tower=_TINY_TOWER),
    "qwen3.5-4b": _hub_size(2560, 9216, 32, 16, 4, 32, tie=True, tower=_SMALL_TOWER),
    "qwen3.5-9b": _hub_size(4096, 12288, 32, 16, 4, 32, tie=False, tower=_LARGE_TOWER),
    "qwen3.5-27b": _hub_size(5120, 17408, 64, 24, 4, 48, tie=False, tower=_LARGE_TOWER),
}


def dense_mlp_params(t: TextArgs) -> int:
    """A layer's SwiGLU (gate, up and down): its elements, and the matmul weights a token goes through."""
    return 3 * t.hidden_size * t.intermediate_size


def _layer_params(t: Any, mlp: int) -> dict[str, tuple[int, int]]:
    """One decoder layer's elements by kind, as (split by tensor parallelism, left whole on every
    rank) under rollplex.models.qwen3_5.tp_plan, its MLP being `mlp` elements: the MLP and the
    mixer's projections split, and so are a DeltaNet's convolution, A_log and dt_bias; the norms
    stay whole."""
    norms = 2 * t.hidden_size  # input_layernorm, post_attention_layernorm
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attention = t.hidden_size * (2 * q + 2 * kv) + q * t.hidden_size  # q_proj (with the gate), k, v, o
    heads = t.linear_num_value_heads
    deltanet = (t.hidden_size * (t.linear_conv_dim + t.linear_value_dim + 2 * heads)  # in_proj_q/k/v, _z, _b, _a
                + t.linear_conv_dim * t.linear_conv_kernel_dim + 2 * heads  # conv1d_q/k/v, dt_bias, A_log
                + t.linear_value_dim * t.hidden_size)  # out_proj
    return {FULL_ATTENTION: (mlp + attention, norms + 2 * t.head_dim),  # q_norm, k_norm
            LINEAR_ATTENTION: (mlp + deltanet, norms + t.linear_value_head_dim)}  # the gated norm


def count_params(args: HybridArgs, mlp_params: Callable[[Any], int] = dense_mlp_params) -> ParamCounts:
    """Parameter counts from the layer shapes of `model` (the tests check them against a built
    model), split as rollplex.models.qwen3_5.tp_plan splits them: every layer's (`_layer_params`,
    with `mlp_params(args.text)` elements in each layer's MLP: the MoE family passes its own),
    the embedding and head when untied. The vision tower counts as replicated, as Qwen3-VL's
    does (its plan splits it only when the TP size divides its widths). The layers differ by
    kind: the per-layer figures are the kind's with more elements split (the largest FSDP unit on
    a rank at any TP size, but for the norms each keeps whole: a few hundred elements)."""
    t, v = args.text, args.vision
    vision_block, vision_root = vision_counts(v)
    per_kind = _layer_params(t, mlp_params(t))
    embeddings = t.vocab_size * t.hidden_size * (1 if args.tie_word_embeddings else 2)
    root_split = 0 if args.tie_word_embeddings else embeddings
    root = vision_root + t.hidden_size + embeddings  # the tower's root parts, the final norm, embedding (and head)
    layers_split = sum(per_kind[kind][0] for kind in t.layer_types)
    total = v.depth * vision_block + sum(sum(per_kind[kind]) for kind in t.layer_types) + root
    layer_split, layer_whole = max(per_kind[kind] for kind in set(t.layer_types))
    return ParamCounts(total=total, tp_split=layers_split + root_split, vision=v.depth * vision_block + vision_root,
                       root=root, root_tp_split=root_split, layer_tp_split=layer_split, layer_replicated=layer_whole)


def kv_layers(args: HybridArgs) -> list[int]:
    """The decoder layers that keep K/V: the full-attention ones, ascending."""
    return [i for i, kind in enumerate(args.text.layer_types) if kind == FULL_ATTENTION]


def recurrent_state_bytes(args: HybridArgs, tp: int, dtype_bytes: int = 2) -> int:
    """One sequence's state over every DeltaNet layer on one of `tp` ranks: the convolution's last
    kernel - 1 inputs (in the weights' dtype, `dtype_bytes`) and the recurrent state, [value heads,
    key dim, value dim] in float32 (bf16 drifts over a long response)."""
    t = args.text
    conv = t.linear_conv_dim // tp * (t.linear_conv_kernel_dim - 1) * dtype_bytes
    recurrent = t.linear_num_value_heads // tp * t.linear_key_head_dim * t.linear_value_head_dim * 4
    return t.layer_types.count(LINEAR_ATTENTION) * (conv + recurrent)


def linear_params(args: HybridArgs, mlp_linear: Callable[[Any], int] = dense_mlp_params) -> LinearParams:
    """The matmul weights a text token and a patch go through (biases, norms, the convolution
    and the recurrence left out): q_proj (with its gate), k, v and o in full-attention layers;
    in_proj_q/k/v (the checkpoints' in_proj_qkv), _z, _b, _a and out_proj in DeltaNet layers;
    the MLP in every layer, `mlp_linear(args.text)` weights (an MoE MLP's: those of the experts
    a token goes through)."""
    t = args.text
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    per_kind = {FULL_ATTENTION: t.hidden_size * (2 * q + 2 * kv) + q * t.hidden_size,
                LINEAR_ATTENTION: t.hidden_size * (t.linear_conv_dim + 2 * t.linear_value_dim
                                                   + 2 * t.linear_num_value_heads)}
    mlp = mlp_linear(t)
    return LinearParams(sum(per_kind[kind] + mlp for kind in t.layer_types), vision_linear_params(args.vision))
