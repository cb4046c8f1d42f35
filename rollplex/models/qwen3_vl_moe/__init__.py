"""Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-VL whose decoder MLPs are sparse mixtures
of experts (rollplex.models.moe). Its args, named sizes and parameter counts (`args`),
the model (`model`), the Hugging Face config and key mapping with the experts' two
checkpoint layouts (`hf`), its tensor-parallel refusal and FSDP units (`tp_plan`) and
its tiny checkpoint's config (`tiny`), gathered in `FAMILY` (rollplex.models.family).

The vision tower, DeepStack, the attention, the processor and most of config.json
are Qwen3-VL's (rollplex.models.qwen3_vl), reused from there.
"""

from dataclasses import replace

from rollplex.models.qwen3_vl import FAMILY as QWEN3_VL
from rollplex.models.qwen3_vl_moe import tiny
from rollplex.models.qwen3_vl_moe.args import (PRESETS, ModelArgs, TextArgs, count_params, linear_params, tiny_args,
                                               with_experts)
from rollplex.models.qwen3_vl_moe.hf import (ARCHITECTURE, MODEL_TYPE, args_from_hf_config, hf_config_from_args,
                                             hf_key_to_params, param_to_hf_key, stacked_tensor)
from rollplex.models.qwen3_vl_moe.model import Qwen3_VL_MoE
from rollplex.models.qwen3_vl_moe.tp_plan import apply_tp, check_tp, repeated_blocks, vision_tower

# Qwen3-VL's family (checkpoint keys, processor, vision tower, DeepStack levels, FSDP units) but for what the
# experts change: the expert tensors' layouts (stacked_tensor) among them.
FAMILY = replace(
    QWEN3_VL, name=MODEL_TYPE, hf_architecture=ARCHITECTURE, args_class=ModelArgs, model_class=Qwen3_VL_MoE,
    args_from_hf_config=args_from_hf_config, hf_config_from_args=hf_config_from_args, check_tp=check_tp,
    apply_tp=apply_tp, count_params=count_params, linear_params=linear_params, presets=PRESETS,
    tiny_args=tiny_args, tiny_spec=tiny.TINY_SPEC, tiny_hf_config=tiny.tiny_hf_config, stacked_tensor=stacked_tensor,
)

__all__ = [
    "ARCHITECTURE", "FAMILY", "MODEL_TYPE", "PRESETS", "ModelArgs", "Qwen3_VL_MoE", "TextArgs", "apply_tp",
    "args_from_hf_config", "check_tp", "count_params", "hf_config_from_args", "hf_key_to_params", "linear_params",
    "param_to_hf_key", "repeated_blocks", "stacked_tensor", "tiny_args", "vision_tower", "with_experts",
]
