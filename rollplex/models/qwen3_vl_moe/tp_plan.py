"""Qwen3-VL-MoE's tensor-parallel plan and FSDP units.

Tensor parallelism is refused past 1 (`check_tp`, before any work starts): the
experts are not split over a TP group (Qwen3-VL's plan would split the attention
and leave every rank all the experts, most of the weights); expert parallelism is
to split them over ranks instead. At tp 1 there is nothing to apply. FSDP's units
(vision blocks, decoder layers: a sparse layer with its router and experts) and
the vision tower are Qwen3-VL's (rollplex.models.qwen_vl.tp_plan).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from rollplex.models.qwen_vl.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]


def check_tp(args: Any, tp: int) -> None:
    """Raise for any tensor parallel size but 1 (see the module docstring)."""
    if tp != 1:
        # The caller names the setting and its value (rollplex.rl.setup: "parallel.tp 2: ...").
        raise ValueError("MoE families run at tensor parallel 1 for now: split the experts over ranks with parallel.ep")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """`model` as it is on a TP mesh of one rank (the only size `check_tp` lets through)."""
    check_tp(model.args, tp_mesh.size())
    return model
