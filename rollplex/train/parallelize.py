"""Parallelism applied to the model from outside (as torchtitan does).

`parallelize(model, mesh, ...)` applies, in this order: tensor parallelism on
the "tp" mesh dimension, activation checkpointing, FSDP2 on "dp_shard". Every
trainer goes through it, a single process too (on a mesh of one): the
parameters FSDP shards are the fp32 master weights, and each unit gathers them
in the compute dtype (MixedPrecisionPolicy.param_dtype) for its forward and
backward, reducing gradients in fp32.

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

import weakref

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollplex.models.qwen2_5_vl import Qwen2_5_VL

# Each FSDP unit's reshard_after_forward, as apply_fsdp set it: FSDP2 can set it at runtime but has no public getter.
_RESHARD_AFTER_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def check_tp(model: Qwen2_5_VL, tp: int) -> None:
    """Raise before any work starts when the model cannot be split `tp` ways."""
    t = model.args.text
    for name, value in (("num_attention_heads", t.num_attention_heads), ("num_key_value_heads",
                        t.num_key_value_heads), ("intermediate_size", t.intermediate_size),
                        ("vocab_size", t.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {name} ({value})")


def vision_splits(model: Qwen2_5_VL, tp: int) -> bool:
    """Whether the vision tower can be split `tp` ways (else it stays replicated)."""
    v = model.args.vision
    return v.num_heads % tp == 0 and v.intermediate_size % tp == 0


def apply_tp(model: Qwen2_5_VL, tp_mesh: DeviceMesh) -> Qwen2_5_VL:
    """Shard the language model and, when it divides, the vision tower (but its
    patch embedding) over `tp_mesh` in place (parameters become DTensors)."""
    check_tp(model, tp_mesh.size())
    vision_block_plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if vision_splits(model, tp_mesh.size()):
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


def apply_fsdp(model: Qwen2_5_VL, dp_mesh: DeviceMesh, compute_dtype: torch.dtype) -> Qwen2_5_VL:
    """FSDP2: every vision block and decoder layer is its own shard unit (gathered
    just before it runs, freed after), the rest of the model the root unit (kept
    gathered from its forward to its backward, which needs it first: FSDP2's
    root default, stated here so that `reshard_after_forward` can report it).
    Parameters are gathered in `compute_dtype`, gradients reduced in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for unit in (*model.visual.blocks, *model.language_model.layers):
        _fully_shard(unit, dp_mesh, mp, reshard_after_forward=True)
    _fully_shard(model, dp_mesh, mp, reshard_after_forward=False)
    # The model is also entered through these methods; each must gather the root's parameters. Only methods
    # that call no other entry: when entries nest, the outer one's end reshards the root (the inner one left
    # FSDP's state idle). forward_packed, hf_forward and encode_vision reach the parameters through the
    # entries they call.
    for method in ("forward_generated", "encode_prepared", "embed_prompts", "logits"):
        register_fsdp_forward_method(model, method)
    return model


def _fully_shard(module: torch.nn.Module, dp_mesh: DeviceMesh, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool) -> None:
    fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    _RESHARD_AFTER_FORWARD[module] = reshard_after_forward


def reshard_after_forward(unit: FSDPModule) -> bool:
    """Whether `unit` (sharded by `apply_fsdp`) frees its gathered parameters after its forward."""
    return _RESHARD_AFTER_FORWARD[unit]


def apply_activation_checkpointing(model: Qwen2_5_VL) -> None:
    """Recompute each decoder layer's and vision block's activations in backward."""
    for blocks in (model.language_model.layers, model.visual.blocks):
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)


def parallelize(model: Qwen2_5_VL, mesh: DeviceMesh, activation_checkpointing: bool = False,
                freeze_vision: bool = False, compute_dtype: torch.dtype = torch.float32) -> Qwen2_5_VL:
    """TP over mesh["tp"] (when > 1), activation checkpointing, then FSDP2 over
    mesh["dp_shard"], computing in `compute_dtype` (the model holds the master weights)."""
    if freeze_vision:
        model.visual.requires_grad_(False)
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return apply_fsdp(model, mesh["dp_shard"], compute_dtype)
