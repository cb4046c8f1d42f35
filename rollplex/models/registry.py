"""The model families Rollplex supports, and how a checkpoint or a model finds
its own (rollplex.models.family). Adding a family is one line here."""

from __future__ import annotations

from typing import Any

from rollplex.models.family import ModelFamily
from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen2_5_vl import FAMILY as QWEN2_5_VL
from rollplex.models.qwen3_5 import FAMILY as QWEN3_5
from rollplex.models.qwen3_5_moe import FAMILY as QWEN3_5_MOE
from rollplex.models.qwen3_vl import FAMILY as QWEN3_VL
from rollplex.models.qwen3_vl_moe import FAMILY as QWEN3_VL_MOE

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5,
                                                                       QWEN3_5_MOE)}

# Model types a config.json may name that are not built yet, with what they would need (docs/ARCHITECTURE.md,
# "Adding a model family"): the families' relatives.
NOT_SUPPORTED_YET: dict[str, str] = {
    **{k: why for family in FAMILIES.values() for k, why in family.relatives_not_supported.items()},
}


def supported() -> str:
    return ", ".join(FAMILIES)


def family_named(name: str) -> ModelFamily:
    """The family whose model_type is `name` (a ValueError listing the supported ones otherwise)."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} is not supported; the supported families are {supported()}")
    return FAMILIES[name]


def family_of_config(cfg: dict, source: str = "config.json") -> ModelFamily:
    """The family of a config.json dict, by its model_type."""
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in NOT_SUPPORTED_YET:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not supported yet: "
                              f"{NOT_SUPPORTED_YET[model_type]}")
    raise CheckpointError(f"{source}: model_type {model_type!r} is not a family Rollplex supports "
                          f"(supported: {supported()})")


def family_of(model_or_args: Any) -> ModelFamily:
    """The family of a model (a `VisionLanguageModel`) or of its args."""
    args = getattr(model_or_args, "args", model_or_args)
    for family in FAMILIES.values():
        if isinstance(args, family.args_class):
            return family
    raise TypeError(f"{type(args).__name__} is the args of no registered model family (supported: {supported()})")


# Every family's named sizes (tools/memory_plan.py --model NAME), by name, and those of relatives not built yet.
PRESETS: dict[str, Any] = {name: args for family in FAMILIES.values() for name, args in family.presets.items()}
SIZES_NOT_SUPPORTED: dict[str, str] = {name: why for family in FAMILIES.values()
                                       for name, why in family.sizes_not_supported.items()}
