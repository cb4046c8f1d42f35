"""Qwen2.5-VL: its args, named sizes and parameter counts (`args`), the model
(`model`), the Hugging Face config and key mapping (`hf`), its tensor-parallel
plan and FSDP units (`tp_plan`), its processor and its tiny checkpoint's
config (`tiny`), gathered in `FAMILY`, the one object the rest of Rollplex
reads them through (rollplex.models.family)."""

from rollplex.models.family import ModelFamily
from rollplex.models.qwen2_5_vl import hf, processor, tp_plan
from rollplex.models.qwen2_5_vl.args import PRESETS, ModelArgs, TextArgs, VisionArgs, count_params, linear_params, \
    tiny_args
from rollplex.models.qwen2_5_vl.model import Qwen2_5_VL
from rollplex.models.qwen2_5_vl.tiny import mrope_section, tiny_hf_config
from rollplex.models.qwen_vl.hf import param_to_nested_key


FAMILY = ModelFamily(
    name="qwen2_5_vl",
    hf_architecture="Qwen2_5_VLForConditionalGeneration",
    hf_processor="Qwen2_5_VLProcessor",
    args_class=ModelArgs,
    model_class=Qwen2_5_VL,
    args_from_hf_config=hf.args_from_hf_config,
    hf_config_from_args=hf.hf_config_from_args,
    hf_key_to_params=hf.hf_key_to_params,
    param_to_hf_key=hf.param_to_hf_key,
    param_to_hf_module_key=param_to_nested_key,
    check_tp=tp_plan.check_tp,
    apply_tp=tp_plan.apply_tp,
    repeated_blocks=tp_plan.repeated_blocks,
    vision_tower=tp_plan.vision_tower,
    count_params=count_params,
    linear_params=linear_params,
    vision_feature_levels=lambda args: 1,
    vision_mlp_widths=(4, 3),  # SwiGLU: gate, silu(gate), up and their product; three at once in a forward
    presets=PRESETS,
    tiny_args=tiny_args,
    tiny_spec={},  # TinySpec's defaults are Qwen2.5-VL's
    tiny_mrope_section=mrope_section,
    tiny_hf_config=tiny_hf_config,
    tiny_processor_files=processor.tiny_processor_files,
    load_processor=processor.load_processor,
)

__all__ = ["FAMILY", "PRESETS", "ModelArgs", "Qwen2_5_VL", "TextArgs", "VisionArgs", "tiny_args"]
