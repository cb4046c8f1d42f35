"""Qwen3-VL-MoE's tensor-parallel plan and FSDP units.

Tensor parallelism is refused past 1 (`check_tp`, before any work starts): the
experts are not split over a TP group (Qwen3-VL's plan would split the attention
and leave every rank all the experts, most of the weights); expert parallelism is
to split them over ranks instead. At tp 1 there is nothing to apply. FSDP's units
(vision blocks, decoder layers: a sparse layer with its router and experts) and
the vision tower are Qwen3-VL's (rollplex.models.qwen_vl.tp_plan).
"""

from rollplex.models.moe import apply_tp, check_tp
from rollplex.models.qwen_vl.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]
