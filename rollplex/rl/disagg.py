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
`DisaggExchange` runs a step's side of this, and the validation score;
`DisaggTrainer` is the colocated trainer (rollplex.rl.loop) with its rollout
and evaluate behind the exchange, each rank holding only its side's state.
This is the baseline Rollplex's schedules are compared with (the published
design measured it 1.57-2.24x slower than overlap): correct and simple, not
tuned (one broadcast per parameter, samples exchanged as Python objects).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from rollplex.dist import ParallelDims, all_gather_objects, full_tensor
from rollplex.metrics import Timer
from rollplex.models import from_pretrained
from rollplex.models.inputs import Group
from rollplex.rl.loop import RLTrainer
from rollplex.rl.memory import MemoryPlan
from rollplex.rl.rollout import Rollout, balanced_share
from rollplex.rl.step import StepState
from rollplex.rl.weights import SharedWeights
from rollplex.train.parallelize import apply_tp


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


class DisaggTrainer(RLTrainer):
    """The trainer of schedule.kind disagg: a training rank holds the actor (and the
    reference model), a rollout rank only its engine's copy of the weights in
    model.dtype, refilled by the broadcast each step."""

    separate_ranks = True

    def _parallel_dims(self) -> ParallelDims:
        cfg = self.cfg
        self.layout = DisaggLayout(self.world, cfg.schedule.rollout_ranks, cfg.rollout.tp)
        self.generates = self.layout.is_rollout(self.rank)
        return ParallelDims.resolve(self.layout.train_ranks, cfg.parallel.dp_shard, cfg.parallel.tp)

    def _layout_summary(self) -> str:
        d, rollout_ranks = self.dims, self.layout.rollout_ranks
        return (f"{self.layout.train_ranks} training ranks (dp_shard {d.dp_shard} x tp {d.tp}) + {rollout_ranks} "
                f"rollout ranks (engine tp {self.cfg.rollout.tp}); schedule disagg")

    def _load_models(self, path: Path) -> None:
        if not self.generates:
            super()._load_models(path)
            return
        self.model = from_pretrained(path, dtype=self.compute_dtype, device=self.device,
                                     attn_backend=self.cfg.model.attn_backend)
        self.ref_model = None

    def _parallelize(self) -> None:
        """The trainers: FSDP2 (+ TP) over their own mesh; the rollout ranks: only the engine's
        TP over their replica. Every rank builds both meshes and every group (collectively)."""
        cfg = self.cfg
        mesh, rollout_mesh = self.layout.meshes(self.dims.dp_shard, self.dims.tp, self.device.type)
        broadcast = WeightBroadcast(self.layout, self.rank, self.compute_dtype)
        self.checkpoint_group = dist.new_group(list(range(self.layout.train_ranks)))  # trainers only
        self.engine_ranks = dist.new_group(list(range(self.layout.train_ranks, self.world)))
        self.dp_rank, self.dp_group = 0, None
        if self.generates:
            if cfg.rollout.tp > 1:
                apply_tp(self.model, rollout_mesh["tp"])
            self.weights = SharedWeights(self.model, cfg.rollout.tp, cfg.rollout.tp)
        else:
            self._shard_models(mesh)
        self.exchange = DisaggExchange(self.layout, self.rank, broadcast, self.model, self.tokenizer,
                                       self.dims.dp_shard, self.dp_rank)

    def _build_rollout(self) -> None:
        self.engine = self.rollout_runner = None
        if self.generates:
            super()._build_rollout(self.engine_ranks)

    def _build_actor(self) -> None:
        self.actor = None
        if not self.generates:
            super()._build_actor()

    def _train_step(self, examples: list, data_s: float) -> dict[str, float]:
        if self.generates:  # generate the replica's share; the trainers report the step
            self.exchange.rollout(examples, self.step, self._sample)
            return {}
        return super()._train_step(examples, data_s)

    def _sample(self, examples: list, step: int) -> Rollout:
        return self.rollout(examples, step).rollout

    def _rollout_phase(self, examples: list, timer: Timer) -> StepState:
        """A trainer's share of the samples, from the exchange (its timings: the rollout's metrics)."""
        with self.progress.phase("gen"):  # the rollout ranks generate: rank 0's console shows the wait as theirs
            rollout, metrics = self.exchange.rollout(examples, self.step, self._sample)
        return StepState(self.step, rollout.examples, rollout=rollout, metrics=metrics)

    def _planned_memory(self) -> MemoryPlan | None:
        return None  # planned as if colocated: no plan of either side's phases to set the peaks beside

    def _weights_metrics(self) -> dict[str, float]:
        return {}  # no shared weights: the broadcast's time is timing_s/update_weights

    def _validation_records(self, examples: list) -> list[dict]:
        return self.exchange.evaluate(examples, self._generation_records)

    def _save(self) -> None:
        if not self.generates:
            super()._save()

    def _save_hf(self) -> tuple[str, Path] | None:
        return None if self.generates else super()._save_hf()

    def _resume(self) -> None:
        """Every rank knows the resume step (a rollout rank too); the trainers load the checkpoint."""
        if not self.generates:
            super()._resume()
