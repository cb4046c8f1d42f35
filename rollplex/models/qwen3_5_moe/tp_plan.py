"""Qwen3.5-MoE's tensor-parallel plan and FSDP units: no tensor parallelism yet (a TP
size above 1 is refused before any work starts: Qwen3.5's plan would split the
mixers and leave every rank all the experts, most of the weights; expert
parallelism is to split those over ranks instead), and Qwen3.5's FSDP units
(vision blocks, decoder layers of both kinds, each with its router and experts)
and vision tower.
"""

from rollplex.models.moe import apply_tp, check_tp
from rollplex.models.qwen3_5.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]
