"""The engine runs on the trainer's own parameters: no second copy of the weights.

At rollout start every FSDP2 unit of the trainer's model is unsharded (its
parameters gathered over the dp_shard dimension). After rollout the units
reshard, freeing the gathered memory before the training passes.

The engine runs on `engine_model`: a second model of the family built on the meta
device (no weight memory), split by `apply_tp` over an engine TP mesh of its own
when rollout.tp > 1, and free of FSDP's hooks. That is what lets decode be
captured in CUDA graphs: FSDP's pre-forward hook makes its all-gather streams
wait on the current stream, and inside a capture nothing would join them again.
Its own TP process groups also keep decode's collectives off the communicator
that the trainer's prompt forwards use on the side stream (rollplex.rl.prompt_work).
Each of its parameters gets its data from the trainer's gathered parameter,
chosen by comparing which block of the global tensor each side holds on this
rank:
- shared: the same block; the engine's local tensor is the trainer's (every
  parameter, when rollout.tp equals parallel.tp). Where the trainer's own
  parameter is already whole on this rank and in the rollout's dtype (dp_shard
  1 without a mixed-precision cast), the engine reads that parameter in place,
  not FSDP's gathered copy of it: the optimizer updates it in place, so its
  address, which the decode CUDA graphs read, holds for the run. FSDP's
  gathered tensors are new memory at each rollout, so graphs on them are
  captured again each step (rollplex.engine.runner).
- viewed: a sub-block; the engine's local tensor is a slice of the trainer's
  (a strided view for a column shard), same storage.
- rebuilt: data another rank holds; a buffer of the engine's local shape,
  refilled by an all-gather on the trainer's TP group at each rollout start.
  Like the gathered parameters, the buffers hold memory during rollout only,
  except LoRA adapters' (rollplex.train.lora): a few MB, rebuilt into buffers kept
  for the run, so that the decode graphs read them at one address.
Expert parallelism (parallel.ep > 1, rollplex.models.expert_parallel): the
trainer's gathered experts are this rank's share of every MoE layer's (a DTensor
Shard(0) over the ep group), the engine's skeleton holds every expert and never
dispatches tokens (decode issues no collective). Its experts are rebuilt: one
buffer of the whole layer's shape per weight, filled at each rollout start by an
all-gather over the ep group straight into it (no whole copy besides), and freed
after the rollout like the others: the rollout holds the experts whole on every
rank, once, and no copy outlives it. `SharingReport.bytes_rebuilt_experts` counts
them (within bytes_rebuilt).
With LoRA the frozen base is outside FSDP (rollplex.train.parallelize), whole on
every dp rank in the rollout dtype: the engine reads it in place, never gathered
nor rebuilt, and it stays put, so the graphs are captured once for the run.
During rollout the units are told not to reshard after forward: the vision
encode and the prompt work run through the trainer's model (and its hooks)
while the engine reads the same gathered tensors.

A model without FSDP units (a disagg rollout rank's own copy) is the engine's
model itself.

Engine TP groups are `engine_tp` adjacent ranks, like the trainer's (so they
stay inside a node). With trainer_tp=1 every engine shard lies inside the
gathered parameter: TP-sharded weights are views, nothing is rebuilt. With
trainer_tp > 1 and a different engine_tp, some rank's engine shard lies outside
its trainer shard, and those weights are rebuilt on every rank. (A group ordered
by trainer TP rank first would make engine_tp = k * trainer_tp all views, but
DTensor cannot use it: its collectives follow the process group's ascending
rank order, its shard offsets the mesh order.)

Build the Engine inside `for_rollout()`: it reads the KV head count and dtype
off the parameters, which only there have their rollout layout (outside, FSDP's
dp shard of k_proj holds a fraction of the heads, and under mixed precision the
sharded parameters are fp32).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rollplex.dist import all_gather_into, all_reduce_values, full_tensor, local_tensor
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.registry import family_of
from rollplex.train.lora import is_adapter, mirror_adapters
from rollplex.train.parallelize import apply_tp, fsdp_units, hold_gathered, release_gathered


@dataclass
class SharingReport:
    bytes_shared: int = 0  # engine reads the trainer's tensor itself
    bytes_viewed: int = 0  # engine reads a slice / stride view of it
    bytes_rebuilt: int = 0  # engine holds its own buffer, refilled after each update
    bytes_rebuilt_experts: int = 0  # of bytes_rebuilt: experts split by expert parallelism, gathered whole
    seconds: float = 0.0  # time to make the weights ready for the engine (gather, rebuild)

    def as_metrics(self) -> dict[str, float]:  # byte counts stay ints: exact in metrics.jsonl
        out = {"weights/bytes_shared": self.bytes_shared, "weights/bytes_viewed": self.bytes_viewed,
               "weights/bytes_rebuilt": self.bytes_rebuilt, "timing_s/update_weights": self.seconds}
        if self.bytes_rebuilt_experts:
            out["weights/bytes_rebuilt_experts"] = self.bytes_rebuilt_experts
        return out


@dataclass
class _Binding:
    """Where one engine parameter takes its data from."""

    trainer_module: nn.Module  # holds the trainer's parameter (FSDP swaps it there at unshard)
    engine_module: nn.Module
    name: str
    layout: torch.Tensor  # the engine's meta parameter: its mesh, placements, global shape
    kind: str  # "shared" | "viewed" | "rebuilt"
    block: tuple[slice, ...]  # viewed: in the trainer's local tensor; rebuilt: in the global tensor
    buffer: torch.Tensor | None = None  # rebuilt only
    persistent: bool = False  # rebuilt into a buffer kept between rollouts (adapters)
    # shared, where the trainer's own parameter is whole on this rank and in the rollout's dtype (dp_shard 1,
    # no mixed-precision cast): its local tensor, which the engine reads in place, at one address for the run.
    master: torch.Tensor | None = None


class SharedWeights:
    def __init__(self, model: VisionLanguageModel, trainer_tp: int = 1, engine_tp: int = 1):
        self.model = model
        self.units = fsdp_units(model)
        self.report = SharingReport()
        self.bindings: list[_Binding] = []
        self._engine_model = None
        self.engine_tp_group: dist.ProcessGroup | None = None  # the engine's own TP group, when rollout.tp > 1
        if self.units:
            self._engine_model, self.engine_tp_group = _engine_skeleton(model, engine_tp)
            masters = dict(model.named_parameters())  # FSDP's sharded parameters: outside a gather
            with torch.no_grad():
                self._gather()
                try:
                    self._plan(masters)
                    self._bind()
                finally:
                    self._release()

    @property
    def engine_model(self) -> VisionLanguageModel:
        """The model to build the Engine on (inside `for_rollout`). It has no FSDP hooks."""
        return self.model if self._engine_model is None else self._engine_model

    @contextmanager
    def for_rollout(self):
        """Within this block the engine model's parameters hold the trainer's
        current weights; the engine may run any number of steps on them."""
        start = time.perf_counter()
        try:
            with torch.no_grad():
                self._gather()
                if self._engine_model is None:
                    self.report.bytes_shared = sum(_local_bytes(p) for p in self.model.parameters())
                else:
                    self._bind()
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            self.report.seconds = time.perf_counter() - start
            yield self.engine_model
        finally:
            self._release()

    # ------------------------------------------------------------------ trainer side

    def _gather(self) -> None:
        # The vision encode, the prompt work and the streamed finished groups' passes (forward and backward)
        # go through the FSDP hooks while the engine reads the gathered tensors: no unit may reshard before
        # the rollout ends.
        hold_gathered(self.units, through_backward=True)

    def _release(self) -> None:
        for b in self.bindings:
            if b.buffer is not None and not b.persistent:
                b.buffer.untyped_storage().resize_(0)
        release_gathered(self.units, through_backward=True)

    # ------------------------------------------------------------------ engine side

    def _plan(self, masters: dict[str, torch.Tensor]) -> None:
        """Decide, per parameter, how the engine gets it (trainer parameters gathered;
        `masters`: the sharded ones, by name)."""
        found = []
        for path, trainer_param in self.model.named_parameters():
            module_path, _, name = path.rpartition(".")
            engine_module = self._engine_model.get_submodule(module_path.replace(_CHECKPOINT_PREFIX, ""))
            layout = getattr(engine_module, name)
            found.append((self.model.get_submodule(module_path), engine_module, name, layout,
                          _block_within(trainer_param, layout), masters[path]))
        # A rebuild all-gathers on the trainer's TP group, so every rank must rebuild the same
        # parameters; with uneven layouts one rank may hold its block while another does not.
        needs_rebuild = all_reduce_values([block is None for *_, block, _ in found], dist.ReduceOp.MAX)
        for (trainer_module, engine_module, name, layout, block, sharded), rebuild in zip(found, needs_rebuild):
            trainer_local = local_tensor(trainer_module._parameters[name])
            kind = "shared" if not rebuild and _local_shape(layout) == tuple(trainer_local.shape) else "viewed"
            master = local_tensor(sharded)
            # FSDP's gather of a whole, uncast parameter is a copy in new memory at each rollout, which
            # would cost the decode graphs a capture per step: the engine reads the parameter itself.
            in_place = (not rebuild and kind == "shared" and tuple(master.shape) == tuple(sharded.shape)
                        and master.dtype == trainer_local.dtype)
            # An adapter not read in place is copied into a buffer of the engine's own, kept for the run: the
            # same price as a view per rollout (its bytes are few), and the graphs keep their addresses.
            persistent = not in_place and is_adapter(name)
            if rebuild or persistent:
                b = _Binding(trainer_module, engine_module, name, layout, "rebuilt", _global_block(layout),
                             torch.empty(_local_shape(layout), dtype=trainer_local.dtype, device=trainer_local.device),
                             persistent=persistent)
                _set_param(engine_module, name, b.buffer, layout)
            else:
                b = _Binding(trainer_module, engine_module, name, layout, kind, block,
                             master=master if in_place else None)
                if in_place:
                    _set_param(engine_module, name, master, layout)
            self.bindings.append(b)
            field = f"bytes_{b.kind}"
            nbytes = math.prod(_local_shape(layout)) * trainer_local.element_size()
            setattr(self.report, field, getattr(self.report, field) + nbytes)
            if b.kind == "rebuilt" and getattr(trainer_module, "dispatcher", None) is not None:
                self.report.bytes_rebuilt_experts += nbytes

    def _bind(self) -> None:
        """Point shared and viewed parameters at the trainer's gathered tensors, refill rebuilt ones.
        Views are made anew at each rollout: cheap, and correct even if FSDP gathered into new tensors
        (it does; then the decode graphs are captured again). Parameters read in place stay bound."""
        for b in self.bindings:
            trainer_param = b.trainer_module._parameters[b.name]
            if b.master is not None:
                continue
            if b.kind == "rebuilt":
                if b.buffer.untyped_storage().size() == 0:
                    b.buffer.untyped_storage().resize_(b.buffer.numel() * b.buffer.element_size())
                _rebuild(b.buffer, trainer_param, b.block)
            else:
                _set_param(b.engine_module, b.name, local_tensor(trainer_param)[b.block], b.layout)
        # Copied each rollout, so a backend chosen on the trainer's model later still applies.
        self._engine_model.set_attn_backend(self.model.attn_backend)


def _engine_skeleton(model: VisionLanguageModel, engine_tp: int) -> tuple[VisionLanguageModel, dist.ProcessGroup | None]:
    """The engine's hook-free model on the meta device, split over an engine TP mesh
    of its own when engine_tp > 1, with adapters where the trainer's model has LoRA's
    (laid out on that split); with its TP group (None without TP)."""
    world = dist.get_world_size()
    if world % engine_tp:
        raise ValueError(f"rollout.tp={engine_tp} does not divide the world size {world}")
    with torch.device("meta"):
        skeleton = family_of(model).model_class(model.args).eval()
    group = None
    if engine_tp > 1:
        mesh = init_device_mesh(model.device.type, (world // engine_tp, engine_tp), mesh_dim_names=("replica", "tp"))
        skeleton, group = apply_tp(skeleton, mesh["tp"]), mesh["tp"].get_group()
    mirror_adapters(model, skeleton)
    return skeleton, group


def _rebuild(buffer: torch.Tensor, trainer_param: torch.Tensor, block: tuple[slice, ...]) -> None:
    """Fill `buffer` with `block` of the trainer's gathered parameter. A parameter split evenly along its first
    dimension over one mesh dimension, wanted whole (expert parallelism's experts; a column-parallel weight read
    by an engine at tp 1), is all-gathered straight into the buffer; otherwise the whole parameter is made and its
    block copied, which holds it whole while it is copied (one parameter at a time)."""
    if (isinstance(trainer_param, DTensor) and trainer_param.device_mesh.ndim == 1
            and tuple(trainer_param.placements) == (Shard(0),) and tuple(buffer.shape) == tuple(trainer_param.shape)
            and buffer.shape[0] % trainer_param.device_mesh.size() == 0):
        all_gather_into(buffer, trainer_param.to_local().contiguous(), trainer_param.device_mesh.get_group())
    else:
        buffer.copy_(full_tensor(trainer_param)[block])


def _block_within(trainer_param: torch.Tensor, layout: torch.Tensor) -> tuple[slice, ...] | None:
    """Where the engine's local block lies in this rank's local trainer tensor; None when it does not."""
    if not (_is_block(trainer_param) and _is_block(layout)):
        return None
    starts = [e - t for e, t in zip(_global_offset(layout), _global_offset(trainer_param))]
    lengths, trainer_lengths = _local_shape(layout), _local_shape(trainer_param)
    if all(0 <= s and s + n <= tn for s, n, tn in zip(starts, lengths, trainer_lengths)):
        return tuple(slice(s, s + n) for s, n in zip(starts, lengths))
    return None


def _is_block(t: torch.Tensor) -> bool:
    """The local tensor is one dense block of the global tensor (not strided shards, not partial sums)."""
    return not isinstance(t, DTensor) or all(type(p) in (Shard, Replicate) for p in t.placements)


def _local_shape(t: torch.Tensor) -> tuple[int, ...]:
    if isinstance(t, DTensor):
        return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[0])
    return tuple(t.shape)


def _global_offset(t: torch.Tensor) -> tuple[int, ...]:
    if isinstance(t, DTensor):
        return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])
    return (0,) * t.ndim


def _global_block(t: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(_global_offset(t), _local_shape(t)))


def _set_param(module: nn.Module, name: str, local: torch.Tensor, layout: torch.Tensor) -> None:
    """Make `local` (no copy) the engine's parameter, as a DTensor when the engine's layout is one."""
    if isinstance(layout, DTensor):
        local = DTensor.from_local(local, layout.device_mesh, layout.placements, run_check=False,
                                   shape=layout.shape, stride=layout.stride())
    setattr(module, name, nn.Parameter(local, requires_grad=False))


def _local_bytes(p: torch.Tensor) -> int:
    return local_tensor(p).numel() * p.element_size()
