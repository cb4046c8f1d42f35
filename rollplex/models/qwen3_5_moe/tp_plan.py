"""Qwen3.5-MoE's tensor-parallel plan and FSDP units: no tensor parallelism yet (a TP
size above 1 is refused before any work starts: Qwen3.5's plan would split the
mixers and leave every rank all the experts, most of the weights; expert
parallelism is to split those over ranks instead), and Qwen3.5's FSDP units
(vision blocks, decoder layers of both kinds, each with its router and experts)
and vision tower.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from rollplex.models.qwen3_5.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]


def check_tp(args: Any, tp: int) -> None:
    """Raise for any TP size but 1."""
    if tp != 1:
        # The caller names the setting and its value (rollplex.rl.setup: "parallel.tp 2: ...").
        raise ValueError("MoE families run at tensor parallel 1 for now: split the experts over ranks with parallel.ep")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """`model` as it is on a TP mesh of one rank (the only size `check_tp` lets through)."""
    check_tp(model.args, tp_mesh.size())
    return model
