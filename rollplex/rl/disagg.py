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
`DisaggExchange` runs a step's side of this, and the validation score, behind
the loop's rollout and evaluate.
This is the baseline Rollplex's schedules are compared with (the published
design measured it 1.57-2.24x slower than overlap): correct and simple, not
tuned (one broadcast per parameter, samples exchanged as Python objects).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from rollplex.dist import all_gather_objects, full_tensor
from rollplex.models.inputs import Group
from rollplex.rl.rollout import Rollout, balanced_share


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
            whole = full_tensor(p.detach())
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


class DisaggExchange:
    """One rank's side of each step: weights to the rollout ranks, their samples to
    every rank. `rollout` gives the trainers their share of the samples as the
    colocated path does (None on a rollout rank), `evaluate` every rank the validation records."""

    def __init__(self, layout: DisaggLayout, rank: int, broadcast: WeightBroadcast, model: torch.nn.Module,
                 tokenizer, train_dp_shard: int, train_dp_rank: int):
        """`model`: the trainers' (the sender's), or a rollout rank's own copy (the receiver's)."""
        self.layout, self.rank, self.broadcast, self.model, self.tokenizer = layout, rank, broadcast, model, tokenizer
        self.generates = layout.is_rollout(rank)
        self.train_dp_shard, self.train_dp_rank = train_dp_shard, train_dp_rank

    def send_weights(self) -> float:
        """The trainers' current weights to the rollout ranks. Returns the seconds
        a rollout rank waited (for the trainers' previous phase and the transfer)."""
        if not self.generates:
            self.broadcast.send(self.model)
            return 0.0
        start = time.perf_counter()
        self.broadcast.receive(self.model)
        return time.perf_counter() - start

    def rollout(self, examples: list, step: int,
                sample: Callable[[list, int], Rollout]) -> tuple[Rollout | None, dict[str, float]]:
        """The step's exchange; the rollout ranks `sample` their replica's share.
        Returns the trainers' share as a Rollout (None on a rollout rank) and the
        step's generation, transfer and idle times (trainers)."""
        start = time.perf_counter()
        idle = self.send_weights()
        weights_s = time.perf_counter() - start
        report = None
        if self.generates:
            start = time.perf_counter()
            rollout = sample(balanced_share(examples, self.layout.replicas, self.layout.replica(self.rank)), step)
            gen = time.perf_counter() - start
            if self.layout.leads_replica(self.rank):  # its TP peers hold the same samples
                # The samples only: every trainer holds the prompts already.
                samples = {e.index: g.samples for e, g in zip(rollout.examples, rollout.groups)}
                report = (samples, gen, idle)
        start = time.perf_counter()
        reports = [r for r in all_gather_objects(report) if r is not None]
        if self.generates:
            return None, {}
        samples = {index: group for r in reports for index, group in r[0].items()}
        metrics = {"timing_s/gen": max(r[1] for r in reports), "timing_s/update_weights": weights_s,
                   "timing_s/train_idle": time.perf_counter() - start,
                   "timing_s/rollout_idle": max(r[2] for r in reports)}
        mine = balanced_share(examples, self.train_dp_shard, self.train_dp_rank)
        return Rollout.of(mine, [Group(e.prompt, samples[e.index]) for e in mine], self.tokenizer), metrics

    @torch.no_grad()
    def evaluate(self, examples: list, generate: Callable[[list], list]) -> list:
        """The rollout replicas `generate` the validation records of their share of
        `examples` on the updated weights; every rank gets all of them."""
        self.send_weights()
        records = []
        if self.generates:  # every rank of a replica runs its engine; its first rank reports
            replica_records = generate(examples[self.layout.replica(self.rank)::self.layout.replicas])
            records = replica_records if self.layout.leads_replica(self.rank) else []
        return [r for rank_records in all_gather_objects(records) for r in rank_records]
