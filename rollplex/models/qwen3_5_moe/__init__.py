"""Qwen3.5-MoE: Qwen3.5 (rollplex.models.qwen3_5: Qwen3-VL's tower without DeepStack,
the hybrid Gated DeltaNet / gated attention decoder) with a sparse MoE block and a
shared expert as every decoder layer's MLP (rollplex.models.moe). Its args, named
sizes and parameter counts (`args`), the model (`model`), the Hugging Face config
and key mapping, experts stacked from one key per expert (`hf`), its parallel plan
(`tp_plan`: tensor parallel 1 only) and its tiny checkpoint's shape and config
(`tiny`), gathered in `FAMILY` (rollplex.models.family). The recurrent state, the
layer kinds' caches and the processor are Qwen3.5's.
"""

from rollplex.models.family import ModelFamily
from rollplex.models.qwen3_5 import FAMILY as QWEN3_5
from rollplex.models.qwen3_5_moe import tiny
from rollplex.models.qwen3_5_moe.args import (PRESETS, ModelArgs, TextArgs, count_params, kv_layers, linear_params,
                                              recurrent_state_bytes, tiny_args, with_experts)
from rollplex.models.qwen3_5_moe.hf import (ARCHITECTURE, DROPPED_KEYS, MODEL_TYPE, args_from_hf_config,
                                            hf_config_from_args, hf_key_to_params, init_constant, init_draw,
                                            param_to_hf_key, stacked_tensor)
from rollplex.models.qwen3_5_moe.model import Qwen3_5Moe
from rollplex.models.qwen3_5_moe.tp_plan import apply_tp, check_tp, repeated_blocks, vision_tower

FAMILY = ModelFamily(
    name=MODEL_TYPE,
    hf_architecture=ARCHITECTURE,
    hf_processor=QWEN3_5.hf_processor,
    args_class=ModelArgs,
    model_class=Qwen3_5Moe,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
    hf_key_to_params=hf_key_to_params,
    param_to_hf_key=param_to_hf_key,
    param_to_hf_module_key=param_to_hf_key,  # transformers' model names its parameters as the checkpoints do
    check_tp=check_tp,
    apply_tp=apply_tp,
    repeated_blocks=repeated_blocks,
    vision_tower=vision_tower,
    count_params=count_params,
    linear_params=linear_params,
    vision_feature_levels=QWEN3_5.vision_feature_levels,
    vision_mlp_widths=QWEN3_5.vision_mlp_widths,
    presets=PRESETS,
    tiny_args=tiny_args,
    tiny_spec=tiny.TINY_SPEC,
    tiny_mrope_section=tiny.mrope_section,
    tiny_hf_config=tiny.tiny_hf_config,
    tiny_processor_files=QWEN3_5.tiny_processor_files,
    load_processor=QWEN3_5.load_processor,
    dropped_keys=DROPPED_KEYS,
    init_constant=init_constant,
    init_draw=init_draw,
    kv_layers=kv_layers,
    recurrent_state_bytes=recurrent_state_bytes,
    stacked_tensor=stacked_tensor,
)

__all__ = [
    "ARCHITECTURE", "FAMILY", "MODEL_TYPE", "PRESETS", "ModelArgs", "Qwen3_5Moe", "TextArgs", "apply_tp",
    "args_from_hf_config", "check_tp", "count_params", "hf_config_from_args", "hf_key_to_params", "linear_params",
    "param_to_hf_key", "stacked_tensor", "tiny_args", "with_experts",
]
