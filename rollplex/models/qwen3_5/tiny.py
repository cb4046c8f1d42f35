"""A tiny Qwen3.5's shape and config.json (rollplex.tiny writes the rest of its folder:
tokenizer, chat template, the processor files, which are Qwen3-VL's, and the weights)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rollplex.models.qwen3_5.args import FULL_ATTENTION, LINEAR_ATTENTION, ModelArgs, TextArgs, vision_args
from rollplex.models.qwen3_5.hf import hf_config_from_args
from rollplex.models.qwen3_vl import TINY_SPEC as QWEN3_VL_TINY_SPEC

# The TinySpec fields a tiny Qwen3.5 changes: Qwen3-VL's tower and processor, and a quarter of each head rotating
# as in the hub's models; 2 heads of 32 (TinySpec's head_dim is hidden_size / num_heads) leave 8 rotary dims, the
# fewest that give each of t, h and w a frequency.
TINY_SPEC = {**QWEN3_VL_TINY_SPEC, "num_heads": 2, "num_kv_heads": 1, "partial_rotary_factor": 0.25}


def mrope_section(rotary_dim: int) -> tuple[int, int, int]:
    """rotary_dim/2 frequencies over (t, h, w) in near thirds, as the hub's [11, 11, 10] of 32.
    Interleaved M-RoPE gives h the frequencies 1, 4, 7, ... and w 2, 5, 8, ..., so neither can
    take more than a third; t takes the rest."""
    half = rotary_dim // 2
    height, width = (half + 1) // 3, half // 3
    return half - height - width, height, width


def layer_types(num_layers: int) -> list[str]:
    """The tiny decoder's layer kinds: the hub's pattern (three Gated DeltaNet layers, then a
    full attention) ending in a full attention, so two or more layers have both kinds."""
    interval = min(4, num_layers)
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


def args_of_spec(spec: Any, vocab_size: int, ids: dict[str, int]) -> ModelArgs:
    """The args of the tiny model `spec` (a rollplex.tiny.TinySpec) with `vocab_size` embedding
    rows and the tokenizer's token `ids` (by config key)."""
    side = math.isqrt(spec.max_pixels) // spec.patch_size  # the learned position grid covers the largest image
    text = TextArgs(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
        partial_rotary_factor=spec.partial_rotary_factor, mrope_section=list(spec.mrope_section),
        max_position_embeddings=spec.max_position_embeddings,
        layer_types=list(spec.layer_types) or layer_types(spec.num_layers),
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim, linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim, linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads)
    vision = vision_args(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
                         intermediate_size=spec.vision_intermediate_size, num_heads=spec.vision_num_heads,
                         patch_size=spec.patch_size, spatial_merge_size=spec.spatial_merge_size,
                         temporal_patch_size=spec.temporal_patch_size, out_hidden_size=spec.hidden_size,
                         num_position_embeddings=max(side, 2) ** 2)
    return ModelArgs(vision=vision, text=text, tie_word_embeddings=spec.tie_word_embeddings,
                     **{key: ids[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id", "eos_token_id", "bos_token_id")})


def tiny_hf_config(spec: Any, vocab_size: int, ids: dict[str, int], style: str = "nested",
                   dtype: str = "float32") -> dict[str, Any]:
    """config.json of the tiny model `spec` (see `args_of_spec`), as hf_config_from_args writes a
    Qwen3.5's, with weights of `dtype` and the tokenizer's pad token; nested, Qwen3.5's only style."""
    return tiny_config(args_of_spec(spec, vocab_size, ids), ids, style, dtype)


def tiny_config(args: Any, ids: dict[str, int], style: str, dtype: str,
                config_from_args: Callable[[Any], dict[str, Any]] = hf_config_from_args) -> dict[str, Any]:
    """config.json of a tiny model of `args`, as `config_from_args` writes it (the MoE family gives
    its own), with weights of `dtype` and the tokenizer's pad token (`ids`); nested style only."""
    if style != "nested":
        raise ValueError(f"a Qwen3.5 config.json has the nested style only, got style {style!r}")
    config = config_from_args(args)
    config["dtype"] = config["text_config"]["dtype"] = dtype
    config["text_config"]["pad_token_id"] = ids["pad_token_id"]
    return config
