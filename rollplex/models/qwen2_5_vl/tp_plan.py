"""Qwen2.5-VL's tensor-parallel plan, applied by rollplex.train.parallelize
(the trainer) and rollplex.rl.weights (the engine's own TP mesh).

The decoder's plan (Megatron-style layers, a vocab-parallel embedding and LM
head when untied), `check_tp` and the FSDP units are rollplex.models.qwen_vl.tp_plan's.

Each vision block is split the same way as a decoder layer: attn.q/k/v and mlp
gate/up column-parallel, attn.proj and mlp down_proj row-parallel (the model
keeps q, k and v as three Linears for this; the loader splits the hub's fused
qkv). The patch merger's MLP is column- then row-parallel too: its first
matrix, (hidden * merge^2)^2, is the largest of the tower, and the split costs
one all-reduce over the merged tokens, a quarter of the patches. The patch
embedding stays replicated: it is small, and every rank's first block needs
its whole output. When the TP size does not divide the vision head count or
MLP width (the 3B and 7B towers' width 3420 at tp=8), the tower stays
replicated, as small next to the decoder, and the language model is still split.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollplex.models.qwen2_5_vl.args import ModelArgs
from rollplex.models.qwen2_5_vl.model import Qwen2_5_VL
from rollplex.models.qwen_vl.tp_plan import (apply_decoder_tp, check_tp, repeated_blocks, swiglu_plan,
                                             vision_attention_plan, vision_tower)

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_splits", "vision_tower"]


def vision_splits(args: ModelArgs, tp: int) -> bool:
    """Whether the vision tower can be split `tp` ways (else it stays replicated)."""
    v = args.vision
    return v.num_heads % tp == 0 and v.intermediate_size % tp == 0


def apply_tp(model: Qwen2_5_VL, tp_mesh: DeviceMesh) -> Qwen2_5_VL:
    """Shard the language model and, when it divides, the vision tower (but its
    patch embedding) over `tp_mesh` in place (parameters become DTensors)."""
    check_tp(model.args, tp_mesh.size())
    if vision_splits(model.args, tp_mesh.size()):
        block_plan = {**vision_attention_plan(), **swiglu_plan("mlp")}
        for block in model.visual.blocks:
            parallelize_module(block, tp_mesh, block_plan)
        parallelize_module(model.visual.merger, tp_mesh, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
    apply_decoder_tp(model, tp_mesh, qk_norm=False)  # q/k/v with biases (split with their rows), no q/k norms
    return model
