"""Qwen2.5-VL: its args and named sizes (`args`), the model (`model`), the
Hugging Face config and key mapping (`hf`) and its tensor-parallel plan (`tp_plan`).

What the rest of Rollplex uses is exported here; the layers themselves are
`model`'s own."""

from rollplex.models.qwen2_5_vl.args import PRESETS, ModelArgs, TextArgs, VisionArgs, tiny_args
from rollplex.models.qwen2_5_vl.model import Qwen2_5_VL, VisionInputs, VisionSlots

__all__ = ["PRESETS", "ModelArgs", "Qwen2_5_VL", "TextArgs", "VisionArgs", "VisionInputs", "VisionSlots", "tiny_args"]
