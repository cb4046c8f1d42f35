"""The model families (Qwen2.5-VL today), what callers may call on them
(`protocol`), the prompt types every layer shares (`inputs`), the checkpoint
loader and packing helpers."""

from rollplex.models.inputs import Group, Prompt, Sample, VisionEmbeds
from rollplex.models.loader import build_model, from_pretrained, save_pretrained
from rollplex.models.packing import PackedBatch, pack_sequences
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.qwen2_5_vl import ModelArgs, Qwen2_5_VL, TextArgs, VisionArgs

__all__ = [
    "Group", "ModelArgs", "PackedBatch", "Prompt", "Qwen2_5_VL", "Sample", "TextArgs", "VisionArgs", "VisionEmbeds",
    "VisionLanguageModel", "build_model", "from_pretrained", "pack_sequences", "save_pretrained",
]
