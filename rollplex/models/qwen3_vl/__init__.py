"""Qwen3-VL (dense): its args, named sizes and parameter counts (`args`), the
model (`model`), the Hugging Face config and key mapping (`hf`), its
tensor-parallel plan and FSDP units (`tp_plan`), its processor (`processor`)
and its tiny checkpoint's config (`tiny`), gathered in `FAMILY`, the one object
the rest of Rollplex reads them through (rollplex.models.family).

What the tests use is exported here too; the layers themselves are `model`'s own."""

from rollplex.models.family import ModelFamily
from rollplex.models.qwen3_vl import processor, tiny

from rollplex.models.qwen3_vl.args import (PRESETS, VISION_MLP_WIDTHS, ModelArgs, TextArgs, VisionArgs, count_params,
                                           linear_params, tiny_args, vision_feature_levels)
from rollplex.models.qwen3_vl.hf import (ARCHITECTURE, MODEL_TYPE, args_from_hf_config,
                                         hf_config_from_args, hf_key_to_params, param_to_hf_key)
from rollplex.models.qwen3_vl.model import Qwen3_VL
from rollplex.models.qwen3_vl.tp_plan import apply_tp, check_tp, repeated_blocks, vision_splits, vision_tower

# The TinySpec fields a tiny Qwen3-VL changes: 16 px patches, and pixel budgets of whole 32 px merged patches
# (the same token counts as the Qwen2.5-VL tiny's 28 px), and the words of the processor's video timestamps
# ("<0.5 seconds>"). The window is Qwen2.5-VL's alone (Qwen3-VL attends fully in every block); it only has to
# pass TinySpec's check.
TINY_SPEC = {"patch_size": 16, "vision_window_size": 64, "min_pixels": 64 * 64, "max_pixels": 32 * 32 * 16,
             "video_min_pixels": 64 * 64, "video_max_pixels": 32 * 32 * 16, "extra_words": ("seconds", "<", ">")}

FAMILY = ModelFamily(
    name=MODEL_TYPE,
    hf_architecture=ARCHITECTURE,
    hf_processor="Qwen3VLProcessor",
    args_class=ModelArgs,
    model_class=Qwen3_VL,
    args_from_hf_config=args_from_hf_config,
    hf_config_from_args=hf_config_from_args,
    hf_key_to_params=hf_key_to_params,
    param_to_hf_key=param_to_hf_key,
    param_to_hf_module_key=param_to_hf_key,  # Qwen3-VL's checkpoints name parameters as its model does
    check_tp=check_tp,
    apply_tp=apply_tp,
    repeated_blocks=repeated_blocks,
    vision_tower=vision_tower,
    count_params=count_params,
    linear_params=linear_params,
    vision_feature_levels=vision_feature_levels,
    vision_mlp_widths=VISION_MLP_WIDTHS,
    presets=PRESETS,
    tiny_args=tiny_args,
    tiny_spec=TINY_SPEC,
    tiny_mrope_section=tiny.mrope_section,
    tiny_hf_config=tiny.tiny_hf_config,
    tiny_processor_files=processor.tiny_processor_files,
    load_processor=processor.load_processor,
)

__all__ = [
    "ARCHITECTURE", "FAMILY", "MODEL_TYPE", "PRESETS", "VISION_MLP_WIDTHS", "ModelArgs", "Qwen3_VL", "TextArgs",
    "VisionArgs", "apply_tp", "args_from_hf_config", "check_tp", "count_params",
    "hf_config_from_args", "hf_key_to_params", "linear_params", "param_to_hf_key",
    "repeated_blocks", "tiny_args", "vision_feature_levels", "vision_splits", "vision_tower",
]
