"""The disaggregated baseline: rollout ranks and training ranks take turns.

The world splits in two: the first `world - rollout_ranks` ranks train (their
own dp_shard x tp mesh), the last `rollout_ranks` run the engine, as replicas
of `rollout.tp` ranks each. Every step, strictly alternating as synchronous
on-policy training requires:

  1. the trainers make each parameter whole and trainer rank 0 broadcasts it
     to the rollout ranks, which copy their TP shard of it into the engine's
     weights (the layout conversion);
  2. the rollout replicas generate their share of the prompts, and every rank
     receives all samples;
  3. the trainers score, run the logprob passes and update, while the rollout
     ranks wait for the next weights.

Each side's waiting is reported (`timing_s/rollout_idle`, `timing_s/train_idle`).
This is the baseline Rollplex's schedules are compared with (the published
design measured it 1.57-2.24x slower than overlap): correct and simple, not
tuned (one broadcast per parameter, samples exchanged as Python objects).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class DisaggLayout:
    world: int
    rollout_ranks: int
    rollout_tp: int

    def __post_init__(self):
        if not 1 <= self.rollout_ranks < self.world:
            raise ValueError(f"schedule.kind disagg needs 1 <= schedule.rollout_ranks < world size {self.world}, "
                             f"got rollout_ranks={self.rollout_ranks}")
        if self.rollout_ranks % self.rollout_tp:
            raise ValueError(f"rollout.tp={self.rollout_tp} does not divide schedule.rollout_ranks="
                             f"{self.rollout_ranks}")

    @property
    def train_ranks(self) -> int:
        return self.world - self.rollout_ranks

    @property
    def replicas(self) -> int:
        return self.rollout_ranks // self.rollout_tp

    def is_rollout(self, rank: int) -> bool:
        return rank >= self.train_ranks

    def replica(self, rank: int) -> int:
        return (rank - self.train_ranks) // self.rollout_tp

    def leads_replica(self, rank: int) -> bool:
        """The replica's first rank reports its samples (its TP peers hold the same)."""
        return self.is_rollout(rank) and (rank - self.train_ranks) % self.rollout_tp == 0

    def meshes(self, train_dp: int, train_tp: int, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The trainers' (dp_shard, tp) mesh and the rollout ranks' (replica, tp)
        mesh. Every rank builds both (their process groups are created collectively)."""
        train = DeviceMesh(device_type, torch.arange(self.train_ranks).view(train_dp, train_tp),
                           mesh_dim_names=("dp_shard", "tp"))
        rollout = DeviceMesh(device_type, torch.arange(self.train_ranks, self.world).view(self.replicas,
                                                                                         self.rollout_tp),
                             mesh_dim_names=("replica", "tp"))
        return train, rollout


class WeightBroadcast:
    """Trainer rank 0 -> every rollout rank, one parameter at a time, in the
    models' shared parameter order, in `dtype` (the compute dtype the rollout
    ranks hold; the trainers' master weights are fp32)."""

    def __init__(self, layout: DisaggLayout, rank: int, dtype: torch.dtype):
        self.rank, self.layout, self.dtype = rank, layout, dtype
        # Collective: every rank creates the group, members or not.
        self.group = dist.new_group([0, *range(layout.train_ranks, layout.world)])

    @torch.no_grad()
    def send(self, model: torch.nn.Module) -> int:
        """Trainer side (every trainer rank: making a parameter whole is collective
        over the trainers' mesh). Returns the bytes sent."""
        sent = 0
        for p in model.parameters():
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if self.rank == 0:
                whole = whole.to(self.dtype).contiguous()
                dist.broadcast(whole, src=0, group=self.group)
                sent += whole.numel() * whole.element_size()
        return sent

    @torch.no_grad()
    def receive(self, model: torch.nn.Module) -> None:
        """Rollout side: each parameter whole, then this rank's shard of it."""
        for p in model.parameters():
            whole = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            dist.broadcast(whole, src=0, group=self.group)
            if isinstance(p, DTensor):
                # src_data_rank=None: every rank holds the whole tensor, so it takes its shard without communication.
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(whole)
