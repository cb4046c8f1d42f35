"""Expert parallelism (parallel.ep): each MoE layer's experts split over a group of
ranks, and each token sent to the rank that holds its experts.

What is split. Within an ep group of `ep` ranks, rank r holds experts
[r E/ep, (r+1) E/ep) of every MoE layer: `Experts.gate_up_proj` and `down_proj`
become DTensors Shard(0) on the "ep" dimension of the experts' mesh
(rollplex.dist.build_ep_mesh), each rank's local tensor its own experts. FSDP then
shards those local experts over the mesh's "efsdp" dimension, the dp ranks that
hold the same experts (rollplex.train.parallelize), as torchtitan composes EP with
FSDP; the rest of the model is FSDP-sharded over every dp rank as without EP. So
the parameters stay DTensors whose `full_tensor()` is the whole layer (what the
checkpoints, the hub export and the gradient norm read).

How tokens move (`TokenDispatcher`, the `Experts.dispatcher` hook). `Experts.forward`
sorts its token-expert pairs by global expert, so the rows bound for rank r are
one contiguous run. The dispatcher
1. exchanges the per-expert row counts (an all-to-all of E integers) and reads the
   split sizes on the host (one device-to-host read per MoE layer and forward: the
   all-to-all needs them);
2. sends the rows (an autograd-aware all-to-all: its backward is the reverse
   all-to-all of the gradients). What a rank receives is ordered by source rank, then
   local expert; a permutation, computed on the device, regroups it by local expert;
3. runs `Experts.swiglu` on the rows with the local experts' cumulative counts (it
   reads the weights' local tensors), undoes the permutation and sends each result
   back to the rank its token came from, in its original place.

Every rank of an ep group must therefore run its MoE forwards (and backwards, and
an activation-checkpoint recompute) in the same order: the all-to-alls are
collectives. Training passes already run in step on every dp rank (FSDP's own
collectives need that too); passes that each rank runs in its own order (the
decode window's streamed finished-group passes) do not stream under EP
(rollplex.rl.schedules.overlap_stream). The engine never dispatches: its model is a
skeleton of its own with every expert whole, refilled by an all-gather over the ep
group at each rollout start (rollplex.rl.weights, "rebuilt").

Gradients: the expert gradients on a rank already sum every ep rank's tokens (the
all-to-all's backward brings them), so FSDP divides their reduction over "efsdp" by
the whole dp size, as it divides the dense ones (`set_gradient_divide_factor`).

Tested on CPU with gloo only (tests/test_expert_parallel.py); NCCL, bf16 and the
grouped GEMM backend under EP wait for a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rollplex.models.moe import Experts

__all__ = ["TokenDispatcher", "all_to_all", "apply_ep", "check_ep", "experts_of"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def experts_of(model: nn.Module) -> list[Experts]:
    """Every MoE layer's `Experts` in `model`."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def check_ep(model: nn.Module, ep: int) -> list[Experts]:
    """Raise unless `model` can be split `ep` ways by expert: it has MoE layers, and ep divides each one's
    experts. Returns its `Experts` modules."""
    experts = experts_of(model)
    if ep == 1:
        return experts
    if not experts:
        raise ValueError(f"parallel.ep={ep}: the model ({type(model).__name__}) has no MoE layers to split by "
                         "expert; use parallel.ep 1")
    for counts in sorted({e.num_experts for e in experts}):
        if counts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the MoE layers' {counts} experts: each "
                             "expert-parallel rank holds as many experts")
    return experts


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[Experts]:
    """Split every MoE layer's experts over `ep_mesh["ep"]` (rank r keeps experts [r E/ep, (r+1) E/ep) as the
    local tensor of a DTensor Shard(0); the whole weights are freed) and give each a `TokenDispatcher` on its
    group. In place, before FSDP (rollplex.train.parallelize). Returns the split `Experts`."""
    mesh = ep_mesh["ep"]
    ep, r = mesh.size(), mesh.get_local_rank()
    experts = check_ep(model, ep)
    dispatcher = TokenDispatcher(mesh.get_group())
    for module in experts:
        share = module.num_experts // ep
        for name in EXPERT_WEIGHTS:
            whole = getattr(module, name)
            if isinstance(whole, DTensor):
                raise ValueError(f"{name} of an Experts module is already a DTensor: split the experts once, "
                                 "before FSDP")
            local = whole.detach()[r * share:(r + 1) * share].clone()
            split = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                       stride=whole.stride())
            setattr(module, name, nn.Parameter(split, requires_grad=whole.requires_grad))
        module.dispatcher = dispatcher
    return experts


class TokenDispatcher:
    """`Experts.dispatcher` under expert parallelism (see the module docstring): rows sorted by global expert,
    with every expert's cumulative row count `ends` -> each row through its expert, computed on the rank that
    holds it."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)

    def __call__(self, experts: Experts, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ep, num_experts = self.size, experts.num_experts
        share = num_experts // ep
        counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())  # rows per global expert
        # received[s, l]: the rows source rank s sends to this rank's l-th expert
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, share)
        splits = torch.cat([counts.view(ep, share).sum(1), received.sum(1)]).tolist()  # the one host read
        send, recv = splits[:ep], splits[ep:]
        arrived = all_to_all(rows, recv, send, self.group)  # by source rank, then local expert
        order = _by_local_expert(received, sum(recv))
        out = experts.swiglu(arrived[order], received.sum(0).cumsum(0).to(torch.int32))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all(out[back], send, recv, self.group)


def _by_local_expert(received: torch.Tensor, total: int) -> torch.Tensor:
    """received (sources, local experts) row counts, the arrived rows laid out source-major -> the permutation
    (total,) that lays them out expert-major (each expert's rows by source rank), on the device, no host read."""
    starts = (received.flatten().cumsum(0) - received.flatten()).view_as(received)  # each (s, l) run's first row
    counts, firsts = received.t().flatten(), starts.t().flatten()  # in (l, s) order
    placed = counts.cumsum(0) - counts  # where each (l, s) run starts in the regrouped rows
    shift = torch.repeat_interleave(firsts - placed, counts, output_size=total)
    return torch.arange(total, device=received.device) + shift


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """x's rows, in runs of `in_splits` rows, the i-th run to the group's i-th rank -> the rows received, in runs
    of `out_splits` from each rank in order. Differentiable: the gradient goes back by the reverse exchange."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None
