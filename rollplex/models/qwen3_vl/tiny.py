"""config.json of a tiny Qwen3-VL (rollplex.tiny writes the rest of its folder:
tokenizer, chat template, processor files, weights)."""

from __future__ import annotations

import math
from typing import Any


def mrope_section(head_dim: int) -> tuple[int, int, int]:
    """head_dim/2 rotary frequencies over (t, h, w) in Qwen3-VL's 24:20:20
    proportion. Interleaved M-RoPE gives h the frequencies 1, 4, 7, ... and w
    2, 5, 8, ..., so h and w take at most a third each; t takes the rest."""
    half = head_dim // 2
    spatial = min(half * 20 // 64, half // 3) or 1
    return half - 2 * spatial, spatial, spatial


def deepstack_indexes(vision_depth: int) -> list[int]:
    """The tiny tower's DeepStack blocks: its first ones, up to three, never the last
    (whose output is the main merger's)."""
    return list(range(min(3, vision_depth - 1)))


def tiny_hf_config(spec: Any, vocab_size: int, ids: dict[str, int], style: str = "nested",
                   dtype: str = "float32") -> dict[str, Any]:
    """config.json of the tiny model `spec` (a rollplex.tiny.TinySpec) with `vocab_size`
    embedding rows and the tokenizer's token `ids` (by config key), in the nested
    style transformers 5 writes: Qwen3-VL has no other."""
    if style != "nested":
        raise ValueError(f"a Qwen3-VL config.json has the nested style only, got style {style!r}")
    side = math.isqrt(spec.max_pixels) // spec.patch_size  # the learned position grid covers the largest image
    text = {
        "model_type": "qwen3_vl_text",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": spec.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "tie_word_embeddings": spec.tie_word_embeddings,
        "dtype": dtype,
    }
    vision = {
        "model_type": "qwen3_vl_vision",
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden_size,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_num_heads,
        "in_channels": 3,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "out_hidden_size": spec.hidden_size,
        "num_position_embeddings": max(side, 2) ** 2,
        "deepstack_visual_indexes": deepstack_indexes(spec.vision_depth),
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "dtype": dtype,
        "text_config": text,
        "vision_config": vision,
        **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
