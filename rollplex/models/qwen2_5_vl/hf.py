"""Qwen2.5-VL's Hugging Face side: config.json <-> `ModelArgs`, and checkpoint
keys <-> parameter names.

Reads config.json in both styles (the hub's flat one with a nested
`vision_config`, and transformers 5's `text_config` / `vision_config`) and both
key styles (`visual.*` / `model.layers.*` as on the hub, `model.visual.*` /
`model.language_model.*` as transformers 5 saves); writes the hub style, which
every transformers version and other tools read. The key mapping, with the
split of the hub's fused vision qkv, is rollplex.models.qwen_vl.hf's.
"""

from __future__ import annotations

from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen2_5_vl.args import ModelArgs, TextArgs, VisionArgs
from rollplex.models.qwen_vl.hf import SPLIT_QKV, hf_key_to_params, param_to_flat_key, pick_fields, token_ids

__all__ = ["SPLIT_QKV", "args_from_hf_config", "hf_config_from_args", "hf_key_to_params", "param_to_hf_key"]

# ----------------------------------------------------------------------------- config


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a config.json dict of either style."""
    if cfg.get("model_type") not in (None, "qwen2_5_vl"):
        raise CheckpointError(f"{source}: model_type is {cfg.get('model_type')!r}, expected 'qwen2_5_vl'")
    if "vision_config" not in cfg:
        raise CheckpointError(f"{source}: no vision_config; is this a Qwen2.5-VL checkpoint?")
    text = {**cfg, **cfg.get("text_config", {})}  # flat style keeps text fields at the top level
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    vision = cfg["vision_config"]
    vision_rope = vision.get("rope_parameters") or {}
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))

    try:
        text_args = pick_fields(text, TextArgs,
                                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", TextArgs.rope_theta))),
                                mrope_section=list(rope.get("mrope_section", [16, 24, 24])))
        vision_args = pick_fields(vision, VisionArgs, rope_theta=float(vision_rope.get("rope_theta", 10000.0)))
        vision_args.fullatt_block_indexes = list(vision_args.fullatt_block_indexes)
        if "out_hidden_size" not in vision:
            vision_args.out_hidden_size = text_args.hidden_size
        # A null token id is kept (None), not replaced by the default.
        args = ModelArgs(vision=vision_args, text=text_args, tie_word_embeddings=bool(tie),
                         **token_ids(cfg, text, keep_null=True))
    except TypeError as e:
        raise CheckpointError(f"{source}: {e}") from e
    if 2 * sum(text_args.mrope_section) != text_args.head_dim:
        raise CheckpointError(f"{source}: mrope_section {text_args.mrope_section} must sum to head_dim/2 = "
                              f"{text_args.head_dim // 2}")
    if vision_args.out_hidden_size != text_args.hidden_size:
        raise CheckpointError(f"{source}: vision out_hidden_size {vision_args.out_hidden_size} != text hidden_size "
                              f"{text_args.hidden_size}")
    return args


def hf_config_from_args(args: ModelArgs) -> dict:
    """config.json in the hub's flat style, readable by transformers 4 and 5."""
    t, v = args.text, args.vision
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "hidden_act": t.hidden_act,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(t.mrope_section)},
        "tie_word_embeddings": args.tie_word_embeddings,
        "image_token_id": args.image_token_id,
        "video_token_id": args.video_token_id,
        "vision_start_token_id": args.vision_start_token_id,
        "vision_end_token_id": args.vision_end_token_id,
        "eos_token_id": args.eos_token_id,
        "bos_token_id": args.bos_token_id,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "vision_config": {
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "in_channels": v.in_channels,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "tokens_per_second": v.tokens_per_second,
            "window_size": v.window_size,
            "out_hidden_size": v.out_hidden_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "hidden_act": v.hidden_act,
        },
    }


# ----------------------------------------------------------------------------- weight keys


# Written in the hub's flat style (`visual.*`, `model.layers.*`); hf_key_to_params reads both styles.
param_to_hf_key = param_to_flat_key
