"""Qwen3-VL's tensor-parallel plan and FSDP units, applied by
rollplex.train.parallelize (the trainer) and rollplex.rl.weights (the engine's
own TP mesh), as Qwen2.5-VL's.

The decoder's plan (Megatron-style layers, q_norm and k_norm sequence-parallel
over the heads, a vocab-parallel embedding and LM head when untied), `check_tp`
and the FSDP units are rollplex.models.qwen_vl.tp_plan's.

Each vision block is split the same way as a decoder layer (attn.q/k/v and
mlp.linear_fc1 column-parallel, attn.proj and mlp.linear_fc2 row-parallel; the
loader splits the hub's fused qkv for this), and so is each merger's MLP, the
main one and every DeepStack one: their first matrix, (width * merge^2)^2, is
the largest of the tower, and the split costs one all-reduce over the merged
tokens, a quarter of the patches. The mergers' LayerNorms run before the split,
on whole rows. The patch embedding and the learned position grid stay
replicated: small, and every rank's first block needs their whole output. When
the TP size does not divide the vision heads, MLP width or merged width, the
tower stays replicated (small next to the decoder) and the language model is
still split. The mergers (main and DeepStack), the patch embedding and the
position grid are in FSDP's root unit.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollplex.models.qwen3_vl.args import ModelArgs
from rollplex.models.qwen3_vl.model import Qwen3_VL
from rollplex.models.qwen_vl.tp_plan import (apply_decoder_tp, check_tp, repeated_blocks, vision_attention_plan,
                                             vision_tower)

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_splits", "vision_tower"]


def vision_splits(args: ModelArgs, tp: int) -> bool:
    """Whether the vision tower can be split `tp` ways (else it stays replicated)."""
    v = args.vision
    merged = v.hidden_size * v.spatial_merge_size**2
    return v.num_heads % tp == 0 and v.intermediate_size % tp == 0 and merged % tp == 0


def apply_tp(model: Qwen3_VL, tp_mesh: DeviceMesh) -> Qwen3_VL:
    """Shard the language model and, when it divides, the vision tower (but its patch
    embedding and position grid) over `tp_mesh` in place (parameters become DTensors)."""
    check_tp(model.args, tp_mesh.size())
    apply_vision_tp(model, tp_mesh)
    apply_decoder_tp(model, tp_mesh, qk_norm=True)
    return model


def apply_vision_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the vision tower's blocks and merger(s) over `tp_mesh` in place when the TP size
    divides their widths (`vision_splits`); else the tower stays replicated."""
    if vision_splits(model.args, tp_mesh.size()):
        block_plan = {**vision_attention_plan(), "mlp.linear_fc1": ColwiseParallel(),
                      "mlp.linear_fc2": RowwiseParallel()}
        for block in model.visual.blocks:
            parallelize_module(block, tp_mesh, block_plan)
        merger_plan = {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()}
        for merger in (model.visual.merger, *model.visual.deepstack_merger_list):
            parallelize_module(merger, tp_mesh, merger_plan)
