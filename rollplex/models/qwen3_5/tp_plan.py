"""Qwen3.5's tensor-parallel plan and FSDP units.

No tensor-parallel plan yet: a DeltaNet layer splits by key-head groups (each
rank its key heads with their value heads, the convolution's q, k and v
channels of those heads, A_log and dt_bias of its value heads), which needs its
own plan; until then a model with a TP size above 1 is refused before any work
starts. The FSDP units (vision blocks, decoder layers of both kinds) and the
vision tower are rollplex.models.qwen_vl.tp_plan's.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from rollplex.models.qwen_vl.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]


def check_tp(args: Any, tp: int) -> None:
    """Raise when the model cannot be split `tp` ways: any tp above 1, for now."""
    if tp > 1:
        raise ValueError(f"tensor parallel size {tp}: Qwen3.5 has no tensor-parallel plan yet (its Gated DeltaNet "
                         "layers need one of their own); use tp 1")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """A TP mesh of size 1 leaves the model as it is; larger ones are refused (`check_tp`)."""
    check_tp(model.args, tp_mesh.size())
    return model
