"""config.json of a tiny Qwen2.5-VL (rollplex.tiny writes the rest of its folder:
tokenizer, chat template, processor files, weights)."""

from __future__ import annotations

from typing import Any


def mrope_section(head_dim: int) -> tuple[int, int, int]:
    """head_dim/2 rotary frequencies split 2:3:3 over (t, h, w), as Qwen2.5-VL's 16:24:24."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return t, h, half - t - h


def _vision_config(spec: Any) -> dict[str, Any]:
    return {
        "depth": spec.vision_depth,
        "hidden_act": "silu",
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_num_heads,
        "in_channels": 3,
        "out_hidden_size": spec.hidden_size,
        "patch_size": spec.patch_size,
        "spatial_merge_size": spec.spatial_merge_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "tokens_per_second": spec.tokens_per_second,
        "window_size": spec.vision_window_size,
        "fullatt_block_indexes": list(spec.fullatt_block_indexes),
        "initializer_range": 0.02,
    }


def _text_fields(spec: Any, vocab_size: int, ids: dict[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": spec.rms_norm_eps,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.num_layers,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
    }


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}


def tiny_hf_config(spec: Any, vocab_size: int, ids: dict[str, int], style: str = "nested",
                   dtype: str = "float32") -> dict[str, Any]:
    """config.json of the tiny model `spec` (a rollplex.tiny.TinySpec) with `vocab_size`
    embedding rows and the tokenizer's token `ids` (by config key: image_token_id, ...,
    bos/eos/pad_token_id). Style "nested": as transformers 5 writes it (text_config /
    vision_config); "flat": as the hub's Qwen2.5-VL checkpoints (transformers 4.x) have
    it, text fields at the top, `rope_scaling: {"type": "mrope"}`, vision_config without
    a model_type."""
    if style == "flat":
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "torch_dtype": dtype,
            **_text_fields(spec, vocab_size, ids),
            "rope_theta": spec.rope_theta,
            "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
            **_vision_token_ids(ids),
            "vision_token_id": ids["vision_pad_token_id"],
            "tie_word_embeddings": spec.tie_word_embeddings,
            "vision_config": _vision_config(spec),
            "sliding_window": spec.max_position_embeddings,  # the hub files carry a number here
        }
    if style != "nested":
        raise ValueError(f"config style must be 'nested' or 'flat', got {style!r}")
    text = _text_fields(spec, vocab_size, ids)
    text["model_type"] = "qwen2_5_vl_text"
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.rope_theta,
                               "mrope_section": list(spec.mrope_section)}
    text["layer_types"] = ["full_attention"] * spec.num_layers
    text["dtype"] = dtype
    vision = _vision_config(spec)
    vision["model_type"] = "qwen2_5_vl_vision"
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "dtype": dtype,
        "text_config": text,
        "vision_config": vision,
        **_vision_token_ids(ids),
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
