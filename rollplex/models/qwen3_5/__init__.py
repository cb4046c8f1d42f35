"""Qwen3.5 (dense): its args, named sizes and parameter counts (`args`), the model
(`model`, with its hybrid decoder in `decoder`, the Gated DeltaNet in `deltanet`
and the backend its layers mix tokens through in `mixing`), the Hugging Face
config and key mapping (`hf`), its tensor-parallel plan (`tp_plan`) and its
tiny checkpoint's shape and config (`tiny`), gathered in `FAMILY`
(rollplex.models.family).

The vision tower and processor are Qwen3-VL's.
"""

from rollplex.models.family import ModelFamily
from rollplex.models.qwen3_5 import tiny
from rollplex.models.qwen3_5.args import (FULL_ATTENTION, LINEAR_ATTENTION, PRESETS, VISION_MLP_WIDTHS, ModelArgs,
                                          TextArgs, count_params, kv_layers, linear_params,
                                          recurrent_state_bytes, tiny_args)
from rollplex.models.qwen3_5.hf import (ARCHITECTURE, DROPPED_KEYS, MODEL_TYPE, args_from_hf_config,
                                        hf_config_from_args, hf_key_to_params, init_constant, init_draw,
                                        param_to_hf_key)
from rollplex.models.qwen3_5.model import Qwen3_5
from rollplex.models.qwen3_5.tp_plan import apply_tp, check_tp, repeated_blocks, vision_tower
from rollplex.models.qwen3_vl import processor

FAMILY = ModelFamily(
    name=MODEL_TYPE,
    hf_architecture=ARCHITECTURE,
    hf_processor="Qwen3VLProcessor",  # Qwen3.5's checkpoints name Qwen3-VL's processor (transformers' auto map)
    args_class=ModelArgs,
    model_class=Qwen3_5,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
    hf_key_to_params=hf_key_to_params,
    param_to_hf_key=param_to_hf_key,
    param_to_hf_module_key=param_to_hf_key,  # the checkpoints name parameters as transformers' model does
    check_tp=check_tp,
    apply_tp=apply_tp,
    repeated_blocks=repeated_blocks,
    vision_tower=vision_tower,
    count_params=count_params,
    linear_params=linear_params,
    vision_feature_levels=lambda args: 1,  # no DeepStack: the merged features only
    vision_mlp_widths=VISION_MLP_WIDTHS,
    presets=PRESETS,
    tiny_args=tiny_args,
    tiny_spec=tiny.TINY_SPEC,
    tiny_mrope_section=tiny.mrope_section,
    tiny_hf_config=tiny.tiny_hf_config,
    tiny_processor_files=processor.tiny_processor_files,
    load_processor=processor.load_processor,
    dropped_keys=DROPPED_KEYS,
    init_constant=init_constant,
    init_draw=init_draw,
    kv_layers=kv_layers,
    recurrent_state_bytes=recurrent_state_bytes,
)

__all__ = [
    "ARCHITECTURE", "FAMILY", "FULL_ATTENTION", "LINEAR_ATTENTION", "MODEL_TYPE", "PRESETS", "ModelArgs", "Qwen3_5",
    "TextArgs", "apply_tp", "args_from_hf_config", "check_tp", "count_params", "hf_config_from_args",
    "hf_key_to_params", "init_constant", "init_draw", "linear_params", "param_to_hf_key", "tiny_args",
]
