"""The model families (one package each, found through `registry`), what
callers may call on a model (`protocol`) and know of its family (`family`), the
prompt types every layer shares (`inputs`), the checkpoint loader and packing
helpers. Nothing here names a family."""

from rollplex.models.family import ModelFamily
from rollplex.models.inputs import Group, Prompt, Sample, VisionEmbeds, VisionSlots
from rollplex.models.loader import build_model, from_pretrained, read_model_args, save_pretrained
from rollplex.models.packing import PackedBatch, pack_sequences
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.registry import FAMILIES, family_named, family_of, family_of_config

__all__ = [
    "FAMILIES", "Group", "ModelFamily", "PackedBatch", "Prompt", "Sample", "VisionEmbeds", "VisionLanguageModel",
    "VisionSlots", "build_model", "family_named", "family_of", "family_of_config", "from_pretrained",
    "pack_sequences", "read_model_args", "save_pretrained",
]
