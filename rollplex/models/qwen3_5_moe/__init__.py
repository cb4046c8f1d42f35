"""Qwen3.5-MoE: Qwen3.5 (rollplex.models.qwen3_5: Qwen3-VL's tower without DeepStack,
the hybrid Gated DeltaNet / gated attention decoder) with a sparse MoE block and a
shared expert as every decoder layer's MLP (rollplex.models.moe). Its args, named
sizes and parameter counts (`args`), the model (`model`), the Hugging Face config
and key mapping, experts stacked from one key per expert (`hf`), its parallel plan
(`tp_plan`: tensor parallel 1 only) and its tiny checkpoint's shape and config
(`tiny`), gathered in `FAMILY` (rollplex.models.family). The recurrent state, the
layer kinds' caches and the processor are Qwen3.5's.
"""

from dataclasses import replace

from rollplex.models.qwen3_5 import FAMILY as QWEN3_5
from rollplex.models.qwen3_5_moe import tiny
from rollplex.models.qwen3_5_moe.args import (PRESETS, ModelArgs, TextArgs, count_params, linear_params, tiny_args,
                                              with_experts)
from rollplex.models.qwen3_5_moe.hf import (ARCHITECTURE, MODEL_TYPE, args_from_hf_config, hf_config_from_args,
                                            hf_key_to_params, param_to_hf_key, stacked_tensor)
from rollplex.models.qwen3_5_moe.model import Qwen3_5Moe
from rollplex.models.qwen3_5_moe.tp_plan import apply_tp, check_tp

# Qwen3.5's family (keys, processor, vision tower, FSDP units, recurrent state, init) but for what the experts change.
FAMILY = replace(
    QWEN3_5, name=MODEL_TYPE, hf_architecture=ARCHITECTURE, args_class=ModelArgs, model_class=Qwen3_5Moe,
    args_from_hf_config=args_from_hf_config, hf_config_from_args=hf_config_from_args, check_tp=check_tp,
    apply_tp=apply_tp, count_params=count_params, linear_params=linear_params, presets=PRESETS,
    tiny_args=tiny_args, tiny_hf_config=tiny.tiny_hf_config, stacked_tensor=stacked_tensor,
)

__all__ = [
    "ARCHITECTURE", "FAMILY", "MODEL_TYPE", "PRESETS", "ModelArgs", "Qwen3_5Moe", "TextArgs", "apply_tp",
    "args_from_hf_config", "check_tp", "count_params", "hf_config_from_args", "hf_key_to_params", "linear_params",
    "param_to_hf_key", "stacked_tensor", "tiny_args", "with_experts",
]
