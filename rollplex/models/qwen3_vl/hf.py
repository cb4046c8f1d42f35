"""Qwen3-VL's Hugging Face side: config.json <-> `ModelArgs`, and checkpoint keys
<-> parameter names.

config.json is transformers' nested style (`text_config` / `vision_config`, as
the hub's Qwen3-VL checkpoints and transformers 5 write it), with the text
rotary in `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`
(the hub's files, written by transformers 4.57). Keys: `model.visual.*` /
`model.language_model.*` / `lm_head.*` as the hub and transformers 5 write
them; the older `visual.*` / `model.*` style is read too. Writing uses the first.
The key mapping, with the split of the checkpoint's fused vision qkv, is
rollplex.models.qwen_vl.hf's.
"""

from __future__ import annotations

from typing import Any

from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen3_vl.args import ModelArgs, TextArgs, VisionArgs
from rollplex.models.qwen_vl.hf import (hf_key_to_params, nested_config_top, nested_model_args, param_to_nested_key,
                                     pick_fields)

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf_config", "check_args", "hf_config_from_args",
           "hf_key_to_params", "param_to_hf_key", "vision_args_from_config", "vision_config"]

MODEL_TYPE = "qwen3_vl"
ARCHITECTURE = "Qwen3VLForConditionalGeneration"

# ----------------------------------------------------------------------------- config


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a Qwen3-VL config.json dict (a CheckpointError naming `source` otherwise)."""
    model_type = cfg.get("model_type")
    if model_type != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {model_type!r}, expected {MODEL_TYPE!r}")
    args = nested_model_args(cfg, source, "Qwen3-VL", lambda text, vision, **shared: ModelArgs(
        vision=vision_args_from_config(vision), text=_text_args(text, source), **shared))
    check_args(args, source)
    return args


def _text_args(text: dict, source: str) -> TextArgs:
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{source}: text rope_type {rope_type!r} is not supported (Qwen3-VL's is 'default')")
    if text.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias true is not supported (Qwen3-VL's attention has no biases)")
    heads = text.get("num_attention_heads", TextArgs.num_attention_heads)
    return pick_fields(text, TextArgs,
                       rope_theta=float(rope.get("rope_theta", text.get("rope_theta", TextArgs.rope_theta))),
                       mrope_section=list(rope.get("mrope_section", [24, 20, 20])),
                       mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
                       num_key_value_heads=text.get("num_key_value_heads") or heads,
                       # transformers' Qwen3VLTextConfig defaults head_dim to 128 (not hidden / heads)
                       head_dim=int(text.get("head_dim") or TextArgs.head_dim))


def vision_args_from_config(vision: dict, deepstack: bool = True) -> VisionArgs:
    """VisionArgs of a config.json's vision_config; without `deepstack` (Qwen3.5's tower,
    whose config has no deepstack_visual_indexes), no DeepStack blocks."""
    rope = vision.get("rope_parameters") or {}
    indexes = vision.get("deepstack_visual_indexes", [8, 16, 24]) if deepstack else []
    extra: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
                             "deepstack_visual_indexes": [int(i) for i in indexes]}
    for name in ("patch_size", "temporal_patch_size"):  # transformers' type allows a pair; Qwen3-VL's are squares
        value = vision.get(name, getattr(VisionArgs, name))
        if isinstance(value, (list, tuple)):
            if len(set(value)) != 1:
                raise ValueError(f"vision {name} {value} is not square")
            value = value[0]
        extra[name] = int(value)
    return pick_fields(vision, VisionArgs, **extra)


def check_args(args: ModelArgs, source: str = "config.json") -> None:
    """What the model needs of its args beyond their types (a CheckpointError naming `source`)."""
    t, v = args.text, args.vision
    problems = []
    if 2 * sum(t.mrope_section) != t.head_dim:
        problems.append(f"mrope_section {t.mrope_section} must sum to head_dim/2 = {t.head_dim // 2}")
    if not t.mrope_interleaved:
        problems.append("mrope_interleaved is false, but Qwen3-VL's M-RoPE is interleaved (transformers "
                        "interleaves whatever the flag says)")
    if v.out_hidden_size != t.hidden_size:
        problems.append(f"vision out_hidden_size {v.out_hidden_size} != text hidden_size {t.hidden_size}")
    if v.position_grid_side**2 != v.num_position_embeddings:
        problems.append(f"vision num_position_embeddings {v.num_position_embeddings} is not a square grid")
    if v.hidden_size % v.num_heads:
        problems.append(f"vision hidden_size {v.hidden_size} is not a multiple of num_heads {v.num_heads}")
    indexes = v.deepstack_visual_indexes
    if len(set(indexes)) != len(indexes) or any(not 0 <= i < v.depth for i in indexes):
        problems.append(f"deepstack_visual_indexes {indexes} must be distinct vision blocks of 0 .. {v.depth - 1}")
    if t.hidden_act != "silu":
        problems.append(f"text hidden_act {t.hidden_act!r} is not supported (Qwen3-VL's is 'silu')")
    if v.hidden_act != "gelu_pytorch_tanh":
        problems.append(f"vision hidden_act {v.hidden_act!r} is not supported (Qwen3-VL's is 'gelu_pytorch_tanh')")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def hf_config_from_args(args: ModelArgs) -> dict:
    """config.json in the nested style of the hub's Qwen3-VL checkpoints, which
    transformers' Qwen3VLForConditionalGeneration loads (the text rotary written both
    as transformers 5's `rope_parameters` and as the hub's `rope_scaling` + `rope_theta`)."""
    t, v = args.text, args.vision
    rope = {"rope_type": "default", "mrope_section": list(t.mrope_section), "mrope_interleaved": t.mrope_interleaved}
    return {
        **nested_config_top(args, ARCHITECTURE, MODEL_TYPE),
        "text_config": {
            "model_type": "qwen3_vl_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "head_dim": t.head_dim,
            "hidden_act": t.hidden_act,
            "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_parameters": {**rope, "rope_theta": t.rope_theta},
            "rope_scaling": rope,
            "rope_theta": t.rope_theta,
            "tie_word_embeddings": args.tie_word_embeddings,
            "eos_token_id": args.eos_token_id,
            "bos_token_id": args.bos_token_id,
            "dtype": "bfloat16",
        },
        "vision_config": vision_config(v),
    }


def vision_config(v: VisionArgs, deepstack: bool = True) -> dict[str, Any]:
    """The vision_config of a config.json; without `deepstack` (Qwen3.5's tower), no deepstack_visual_indexes."""
    config = {
        "model_type": "qwen3_vl_vision",
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "temporal_patch_size": v.temporal_patch_size,
        "out_hidden_size": v.out_hidden_size,
        "num_position_embeddings": v.num_position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
        "hidden_act": v.hidden_act,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    if not deepstack:
        del config["deepstack_visual_indexes"]
    return config


# ----------------------------------------------------------------------------- weight keys


# Written in the nested style transformers 5 writes (`model.visual.*`, `model.language_model.*`); hf_key_to_params
# reads both styles.
param_to_hf_key = param_to_nested_key
