"""Parallelism applied to the model from outside (as torchtitan does).

`parallelize(model, mesh, ...)` applies, in this order: tensor parallelism on
the "tp" mesh dimension, expert parallelism on the experts' mesh when given
(rollplex.models.expert_parallel: each MoE layer's experts split over "ep"),
activation checkpointing, FSDP2 on "dp_shard" (the split experts on "efsdp", each
layer's experts their own unit). Every
trainer goes through it, a single process too (on a mesh of one): the
parameters FSDP shards are the fp32 master weights, and each unit gathers them
in the compute dtype (MixedPrecisionPolicy.param_dtype) for its forward and
backward, reducing gradients in fp32.

What is sharded, split and recomputed is the model family's to say
(rollplex.models.family: its TP plan, its repeated blocks, its vision tower);
the methods FSDP2 must gather the root for are the model's `fsdp_entry` ones.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from rollplex.models.expert_parallel import apply_ep
from rollplex.models.moe import Experts
from rollplex.models.protocol import VisionLanguageModel, fsdp_entry_methods
from rollplex.config.sections import LoRAConfig
from rollplex.models.registry import family_of
from rollplex.train.lora import add_lora

# Each FSDP unit's reshard_after_forward, as apply_fsdp set it: FSDP2 can set it at runtime but has no public getter.
_RESHARD_AFTER_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def apply_tp(model: VisionLanguageModel, tp_mesh: DeviceMesh) -> VisionLanguageModel:
    """The family's tensor-parallel plan over `tp_mesh`, in place (parameters become DTensors)."""
    return family_of(model).apply_tp(model, tp_mesh)


def apply_fsdp(model: VisionLanguageModel, dp_mesh: DeviceMesh, compute_dtype: torch.dtype,
               frozen: set[torch.nn.Parameter] | None = None, ep_mesh: DeviceMesh | None = None) -> VisionLanguageModel:
    """FSDP2: every vision block and decoder layer (the family's repeated blocks) is its own shard unit (gathered
    just before it runs, freed after), the rest of the model the root unit (kept
    gathered from its forward to its backward, which needs it first: FSDP2's
    root default, stated here so that `reshard_after_forward` can report it).
    Parameters are gathered in `compute_dtype`, gradients reduced in fp32. `frozen` parameters
    (LoRA's base) FSDP leaves alone: whole on every dp rank, never gathered.
    Experts split by expert parallelism (`ep_mesh`) are units of their own (`apply_experts_fsdp`)."""
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if ep_mesh is not None:
        apply_experts_fsdp(model, ep_mesh, dp_mesh.size(), mp, frozen)
    for blocks in family_of(model).repeated_blocks(model):
        for unit in blocks:
            _fully_shard(unit, dp_mesh, mp, reshard_after_forward=True, frozen=frozen)
    _fully_shard(model, dp_mesh, mp, reshard_after_forward=False, frozen=frozen)
    # The model is also entered through the methods its class marks as entries (rollplex.models.protocol
    # .fsdp_entry); each must gather the root's parameters.
    for method in fsdp_entry_methods(type(model)):
        register_fsdp_forward_method(model, method)
    return model


def apply_experts_fsdp(model: torch.nn.Module, ep_mesh: DeviceMesh, dp_size: int, mp: MixedPrecisionPolicy,
                       frozen: set[torch.nn.Parameter] | None = None) -> None:
    """FSDP2 for the experts expert parallelism split (rollplex.models.expert_parallel.apply_ep): each MoE
    layer's `Experts` its own unit (inside its layer's, gathered when the experts run, freed after), sharded
    over ep_mesh["efsdp"], the dp ranks holding the same experts. Their gradient reduction is divided by the
    whole dp size `dp_size`, as the dense parameters' is: a rank's expert gradients already sum its ep
    group's tokens, brought by the dispatcher's all-to-all."""
    for experts in model.modules():
        if isinstance(experts, Experts) and experts.dispatcher is not None:
            _fully_shard(experts, ep_mesh["efsdp"], mp, reshard_after_forward=True, frozen=frozen)
            experts.set_gradient_divide_factor(float(dp_size))
            if ep_mesh["efsdp"].size() > 1:
                # A sum, then the division: a divide factor of its own is otherwise NCCL's PreMulSum, which gloo
                # lacks. (Not over one rank: FSDP would then divide twice.)
                experts.set_force_sum_reduction_for_comms(True)


def _fully_shard(module: torch.nn.Module, dp_mesh: DeviceMesh, mp: MixedPrecisionPolicy,
                 reshard_after_forward: bool, frozen: set[torch.nn.Parameter] | None) -> None:
    fully_shard(module, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                ignored_params=frozen or None)
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


def apply_activation_checkpointing(model: VisionLanguageModel) -> None:
    """Recompute each decoder layer's and vision block's activations in backward."""
    for blocks in family_of(model).repeated_blocks(model):
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)


def parallelize(model: VisionLanguageModel, mesh: DeviceMesh, activation_checkpointing: bool = False,
                freeze_vision: bool = False, compute_dtype: torch.dtype = torch.float32,
                lora: LoRAConfig | None = None, seed: int = 0,
                ep_mesh: DeviceMesh | None = None) -> VisionLanguageModel:
    """TP over mesh["tp"] (when > 1), expert parallelism over `ep_mesh` (rollplex.dist.build_ep_mesh; None: ep 1),
    LoRA adapters (lora.rank > 0: on the TP layout, seeded by
    `seed`, none in a vision tower `freeze_vision` freezes), activation checkpointing, then FSDP2 over mesh["dp_shard"], computing in
    `compute_dtype` (the model holds the master weights; with LoRA, of the adapters only)."""
    if freeze_vision:
        family_of(model).vision_tower(model).requires_grad_(False)
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    if ep_mesh is not None:
        if lora is not None and lora.rank > 0:
            raise ValueError("expert parallelism with LoRA is not built: LoRA's frozen base stays whole on every "
                             "rank, outside FSDP")
        apply_ep(model, ep_mesh)
    frozen = add_lora(model, lora, compute_dtype, seed, freeze_vision) if lora is not None and lora.rank > 0 else None
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    return apply_fsdp(model, mesh["dp_shard"], compute_dtype, frozen, ep_mesh)
