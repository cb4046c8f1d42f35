"""Qwen2.5-VL: its args and named sizes (`args`), the model (`model`), the
Hugging Face config and key mapping (`hf`) and its tensor-parallel plan (`tp_plan`)."""

from rollplex.models.qwen2_5_vl.args import PRESETS, ModelArgs, TextArgs, VisionArgs, mrope_for, tiny_args
from rollplex.models.qwen2_5_vl.model import (Attention, DecoderLayer, LanguageModel, PatchEmbed, PatchMerger,
                                              Qwen2_5_VL, RMSNorm, SwiGLU, VisionAttention, VisionBlock,
                                              VisionEmbeds, VisionInputs, VisionLayout, VisionPlan, VisionSlots,
                                              VisionTransformer, check_pixels, vision_layout)

__all__ = [
    "PRESETS", "Attention", "DecoderLayer", "LanguageModel", "ModelArgs", "PatchEmbed", "PatchMerger", "Qwen2_5_VL",
    "RMSNorm", "SwiGLU", "TextArgs", "VisionArgs", "VisionAttention", "VisionBlock", "VisionEmbeds", "VisionInputs",
    "VisionLayout", "VisionPlan", "VisionSlots", "VisionTransformer", "check_pixels", "mrope_for", "tiny_args",
    "vision_layout",
]
