"""Qwen3.5's Hugging Face side: config.json <-> `ModelArgs`, and checkpoint keys <->
parameter names.

config.json is the nested style of Qwen3-VL (`text_config` / `vision_config`),
with the text rotary in `rope_parameters` (rope_theta, partial_rotary_factor,
mrope_section) and the layer kinds in `layer_types` (or, absent, one full-attention
layer every `full_attention_interval`). The vision config is Qwen3-VL's without
DeepStack. Keys: rollplex.models.qwen_vl.hf's mapping (`model.visual.*` with the
fused vision qkv, `model.language_model.*`, `lm_head.*`; written in the nested
style), plus each DeltaNet layer's two fused tensors: `in_proj_qkv.weight` and
`conv1d.weight` hold q, k and v by rows, which the model keeps as three
parameters each (rollplex.models.qwen3_5.deltanet), split at load and
concatenated back at save in row order as the vision qkv is. transformers'
model names its modules as the checkpoints do, so the same mapping names the
modules peft adapts (`param_to_hf_key`). The hub's checkpoints also hold
`mtp.*`, a multi-token-prediction head that transformers drops on load: the
loader skips it and says so once (`DROPPED_KEYS`).
"""

from __future__ import annotations

from typing import Any

import torch

from rollplex.models.family import unit_norm_scales
from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen3_5.args import FULL_ATTENTION, LINEAR_ATTENTION, ModelArgs, TextArgs, hybrid_layer_types
from rollplex.models.qwen3_vl.hf import vision_args_from_config, vision_config
from rollplex.models.qwen_vl.hf import hf_key_to_params as qwen_vl_key_to_params
from rollplex.models.qwen_vl.hf import nested_config_top, nested_model_args, param_to_nested_key, pick_fields

__all__ = ["ARCHITECTURE", "DROPPED_KEYS", "MODEL_TYPE", "args_from_hf_config", "check_args", "hf_config_from_args",
           "hf_key_to_params", "init_constant", "init_draw", "param_to_hf_key", "text_args"]

MODEL_TYPE = "qwen3_5"
ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
# Checkpoint key prefixes that no parameter takes, with why (rollplex.models.family.ModelFamily.dropped_keys).
DROPPED_KEYS = {"mtp.": "Qwen3.5's multi-token-prediction head, which only speculative decoding reads "
                        "(transformers drops it too)"}

# A DeltaNet layer's fused checkpoint tensors -> the parameters they hold, in row order
# (rollplex.models.qwen3_5.deltanet keeps q, k and v apart).
_FUSED_DELTANET = {
    ".linear_attn.in_proj_qkv.weight": (".linear_attn.in_proj_q.weight", ".linear_attn.in_proj_k.weight",
                                        ".linear_attn.in_proj_v.weight"),
    ".linear_attn.conv1d.weight": (".linear_attn.conv1d_q", ".linear_attn.conv1d_k", ".linear_attn.conv1d_v"),
}


def hf_key_to_params(key: str) -> list[str]:
    """Checkpoint key (either style) -> the parameter names it holds, in row order: none for
    keys we do not keep, three for a vision block's fused qkv and a DeltaNet's in_proj_qkv and conv1d."""
    names = qwen_vl_key_to_params(key)
    for fused, parts in _FUSED_DELTANET.items():
        if len(names) == 1 and names[0].endswith(fused):
            stem = names[0].removesuffix(fused)
            return [stem + part for part in parts]
    return names


def param_to_hf_key(name: str) -> str:
    """Our parameter name -> its key in the nested style transformers 5 writes (hf_key_to_params
    reads the flat one too); the parts of a fused tensor share one."""
    for fused, parts in _FUSED_DELTANET.items():
        for part in parts:
            if name.endswith(part):
                return param_to_nested_key(name.removesuffix(part) + fused)
    return param_to_nested_key(name)


def init_constant(key: str) -> float | None:
    """What build_model fills the checkpoint tensor `key` with (ModelFamily.init_constant): 0 for
    the decoder's zero-centred norms, x * (1 + w), whose identity scale is w = 0 (the layers' two,
    q_norm, k_norm, the final norm); 1 for the DeltaNet's gated norm and the tower's LayerNorms,
    which scale by w; None (drawn) for every other tensor."""
    zero_centred = key.startswith("model.language_model.") and key.endswith("norm.weight") \
        and ".linear_attn." not in key
    return 0.0 if zero_centred else unit_norm_scales(key)


def init_draw(key: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor | None:
    """A DeltaNet's decay parameters as transformers initialises them (ModelFamily.init_draw):
    dt_bias 1, and A_log the log of U(0.01, 16) per value head, so that heads decay at rates
    spread over three orders of magnitude (a weight's draw, A_log near 0, would decay every head
    alike); None for every other tensor."""
    if key.endswith(".linear_attn.dt_bias"):
        return torch.ones(shape, device=generator.device)
    if key.endswith(".linear_attn.A_log"):
        return torch.empty(shape, device=generator.device).uniform_(0.01, 16.0, generator=generator).log_()
    return None


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a Qwen3.5 config.json dict (a CheckpointError naming `source` otherwise)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    args = nested_model_args(cfg, source, "Qwen3.5", lambda text, vision, **shared: ModelArgs(
        vision=vision_args_from_config(vision, deepstack=False), text=text_args(text, source), **shared))
    check_args(args, source)
    return args


def text_args(text: dict, source: str, text_class: type = TextArgs, **extra: Any) -> Any:
    """`text_class` (TextArgs, or the MoE family's, which adds `extra`) from a text_config dict."""
    rope = text.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"{source}: text rope_type {rope_type!r} is not supported (Qwen3.5's is 'default')")
    if text.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias true is not supported (Qwen3.5's attention has no biases)")
    layers = int(text.get("num_hidden_layers", text_class.num_hidden_layers))
    layer_types = text.get("layer_types") or hybrid_layer_types(layers, int(text.get("full_attention_interval", 4)))
    return pick_fields(text, text_class, **extra,
                       rope_theta=float(rope.get("rope_theta", text.get("rope_theta", text_class.rope_theta))),
                       partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                            text.get("partial_rotary_factor", 0.25))),
                       mrope_section=list(rope.get("mrope_section", [11, 11, 10])),
                       layer_types=list(layer_types))


def check_args(args: Any, source: str = "config.json") -> None:
    """What the model needs of its args beyond their types (a CheckpointError naming `source`)."""
    t, v = args.text, args.vision
    problems = []
    if 2 * sum(t.mrope_section) != t.rotary_dim:
        problems.append(f"mrope_section {t.mrope_section} must sum to half the rotary width, head_dim "
                        f"{t.head_dim} * partial_rotary_factor {t.partial_rotary_factor} / 2 = {t.rotary_dim // 2}")
    if len(t.layer_types) != t.num_hidden_layers:
        problems.append(f"layer_types has {len(t.layer_types)} entries for {t.num_hidden_layers} layers")
    if unknown := sorted(set(t.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}):
        problems.append(f"layer_types {unknown} are neither {LINEAR_ATTENTION!r} nor {FULL_ATTENTION!r}")
    if t.linear_num_value_heads % t.linear_num_key_heads:
        problems.append(f"linear_num_value_heads {t.linear_num_value_heads} is not a multiple of "
                        f"linear_num_key_heads {t.linear_num_key_heads}")
    if v.out_hidden_size != t.hidden_size:
        problems.append(f"vision out_hidden_size {v.out_hidden_size} != text hidden_size {t.hidden_size}")
    if v.position_grid_side**2 != v.num_position_embeddings:
        problems.append(f"vision num_position_embeddings {v.num_position_embeddings} is not a square grid")
    if t.hidden_act != "silu":
        problems.append(f"text hidden_act {t.hidden_act!r} is not supported (Qwen3.5's is 'silu')")
    if v.hidden_act != "gelu_pytorch_tanh":
        problems.append(f"vision hidden_act {v.hidden_act!r} is not supported (Qwen3.5's is 'gelu_pytorch_tanh')")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))


def hf_config_from_args(args: Any, architecture: str = ARCHITECTURE, model_type: str = MODEL_TYPE) -> dict[str, Any]:
    """config.json in the nested style of the hub's Qwen3.5 checkpoints, which transformers'
    Qwen3_5ForConditionalGeneration loads (another `architecture` and `model_type`: the MoE
    family's, whose text and vision configs are named after it too)."""
    t = args.text
    return {
        **nested_config_top(args, architecture, model_type),
        "text_config": {
            "model_type": f"{model_type}_text",
            **{name: getattr(t, name) for name in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads")},
            "layer_types": list(t.layer_types),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                "partial_rotary_factor": t.partial_rotary_factor,
                                "mrope_section": list(t.mrope_section), "mrope_interleaved": True},
            "tie_word_embeddings": args.tie_word_embeddings,
            "eos_token_id": args.eos_token_id,
            "bos_token_id": args.bos_token_id,
            "dtype": "bfloat16",
        },
        "vision_config": {**vision_config(args.vision, deepstack=False), "model_type": f"{model_type}_vision"},
    }
