"""Parallelism applied to the model from outside (as torchtitan does).

`parallelize(model, mesh, ...)` applies, in this order: tensor parallelism on
the "tp" mesh dimension, activation checkpointing, FSDP2 on "dp_shard". Every
trainer goes through it, a single process too (on a mesh of one): the
parameters FSDP shards are the fp32 master weights, and each unit gathers them
in the compute dtype (MixedPrecisionPolicy.param_dtype) for its forward and
backward, reducing gradients in fp32.

The tensor-parallel plan is the model family's (rollplex.models.qwen2_5_vl.tp_plan);
`parallelize` applies it.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from rollplex.models.qwen2_5_vl import Qwen2_5_VL
from rollplex.models.qwen2_5_vl.tp_plan import apply_tp

# Each FSDP unit's reshard_after_forward, as apply_fsdp set it: FSDP2 can set it at runtime but has no public getter.
_RESHARD_AFTER_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


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


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def hold_gathered(units: list[FSDPModule], through_backward: bool = False) -> None:
    """Gather the units' parameters (a collective: every dp rank alike) and keep them
    gathered until `release_gathered`: no reshard after a forward, nor after a backward
    with `through_backward`. Passes on them meanwhile run without collectives, so a rank
    may run them in an order of its own."""
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
        if through_backward:
            unit.set_reshard_after_backward(False, recurse=False)


def release_gathered(units: list[FSDPModule], through_backward: bool = False) -> None:
    """Free what `hold_gathered` held and give each unit its own setting back (the root
    stays gathered from its forward to its backward, the others do not)."""
    for unit in units:
        unit.reshard()
        unit.set_reshard_after_forward(reshard_after_forward(unit), recurse=False)
        if through_backward:
            unit.set_reshard_after_backward(True, recurse=False)  # FSDP's default, which apply_fsdp keeps


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
