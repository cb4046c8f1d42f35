"""Qwen2.5-VL's tensor-parallel plan, applied by rollplex.train.parallelize
(the trainer) and rollplex.rl.weights (the engine's own TP mesh).

Tensor parallelism splits each decoder layer Megatron-style: q/k/v and
gate/up are column-parallel (each rank holds whole heads / a slice of the MLP
width), o_proj and down_proj are row-parallel (their partial outputs are
all-reduced on the TP group). The embedding is vocab-parallel (row-parallel
over the vocabulary), the LM head column-parallel over the vocabulary with its
logits gathered. Model code is unchanged: it reshapes with the local head count
(`view(T, -1, head_dim)`).

Each vision block is split the same way: attn.q/k/v and mlp gate/up
column-parallel, attn.proj and mlp down_proj row-parallel (the model keeps q,
k and v as three Linears for this; the loader splits the hub's fused qkv). The
patch merger's MLP is column- then row-parallel too: its first matrix,
(hidden * merge^2)^2, is the largest of the tower, and the split costs one
all-reduce over the merged tokens, a quarter of the patches. The patch
embedding stays replicated: it is small, and every rank's first block needs
its whole output. When the TP size does not divide the vision head count or
MLP width (the 3B and 7B towers' width 3420 at tp=8), the tower stays
replicated, as small next to the decoder, and the language model is still split.
With tied embeddings the embedding stays replicated too, since the head reads
the same weight.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollplex.models.qwen2_5_vl.args import ModelArgs
from rollplex.models.qwen2_5_vl.model import Qwen2_5_VL


def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise before any work starts when the model cannot be split `tp` ways."""
    t = args.text
    for name, value in (("num_attention_heads", t.num_attention_heads), ("num_key_value_heads",
                        t.num_key_value_heads), ("intermediate_size", t.intermediate_size),
                        ("vocab_size", t.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {name} ({value})")


def vision_splits(args: ModelArgs, tp: int) -> bool:
    """Whether the vision tower can be split `tp` ways (else it stays replicated)."""
    v = args.vision
    return v.num_heads % tp == 0 and v.intermediate_size % tp == 0


def apply_tp(model: Qwen2_5_VL, tp_mesh: DeviceMesh) -> Qwen2_5_VL:
    """Shard the language model and, when it divides, the vision tower (but its
    patch embedding) over `tp_mesh` in place (parameters become DTensors)."""
    check_tp(model.args, tp_mesh.size())
    vision_block_plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if vision_splits(model.args, tp_mesh.size()):
        for block in model.visual.blocks:
            parallelize_module(block, tp_mesh, vision_block_plan)
        parallelize_module(model.visual.merger, tp_mesh, {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.language_model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    if model.lm_head is not None:
        parallelize_module(model.language_model, tp_mesh,
                           {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def repeated_blocks(model: Qwen2_5_VL) -> list[nn.ModuleList]:
    """The vision blocks and the decoder layers: each block is an FSDP unit of its own
    and what activation checkpointing recomputes (rollplex.train.parallelize)."""
    return [model.visual.blocks, model.language_model.layers]


def vision_tower(model: Qwen2_5_VL) -> nn.Module:
    """What model.freeze_vision freezes: the tower and its merger."""
    return model.visual
