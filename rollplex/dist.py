"""Process group and device mesh.

One process per device, started by torchrun (or plain `python` for one
process). NCCL on CUDA, gloo on CPU, chosen from the device. A single process
joins a group of one, so that it trains through the same FSDP path as many
(fp32 master weights, compute in model.dtype). The mesh has two dimensions,
("dp_shard", "tp"): FSDP shards over the first, tensor parallelism splits over
the second (adjacent ranks, so TP stays inside a node).

Expert parallelism (parallel.ep > 1, MoE models, tp 1) has a mesh of its own over
the same ranks, ("efsdp", "ep") (`build_ep_mesh`, as torchtitan's sparse mesh):
each group of ep adjacent dp ranks splits the experts over "ep", and FSDP shards
each rank's experts over "efsdp", the dp ranks that hold the same experts
(dp_shard / ep of them). The rest of the model is FSDP-sharded over all of
"dp_shard" as without EP.

Small host-side reductions (counts, metrics) go through `all_reduce_values`,
which puts them on the device the group's backend takes: NCCL takes only CUDA
tensors, gloo CPU ones. Python objects (requests, samples) go through
`all_gather_objects`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor


def rank() -> int:
    """This process's global rank; 0 outside a process group."""
    return dist.get_rank() if dist.is_initialized() else 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local tensor; a plain tensor is its own."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor gathered over its mesh (collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_shard: int
    tp: int
    ep: int = 1  # expert parallelism: a divisor of dp_shard (its groups are ep adjacent dp ranks)

    @classmethod
    def resolve(cls, world_size: int, dp_shard: int, tp: int, ep: int = 1) -> "ParallelDims":
        """dp_shard = -1 takes the rest of the world; the product must equal the world size; ep must divide
        dp_shard, at tp 1."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world_size}")
        if dp_shard == -1:
            dp_shard = world_size // tp
        if dp_shard < 1 or dp_shard * tp != world_size:
            raise ValueError(f"dp_shard={dp_shard} x tp={tp} = {dp_shard * tp} != world size {world_size}")
        if ep < 1 or dp_shard % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the data-parallel size dp_shard={dp_shard} (world "
                             f"size {world_size} / tp {tp}): each expert-parallel group is ep of the dp ranks")
        if ep > 1 and tp > 1:
            raise ValueError(f"parallel.ep={ep} with tp={tp}: MoE experts are not split by TP, so expert "
                             "parallelism runs at tp 1")
        return cls(world_size, dp_shard, tp, ep)


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up, or form a group of one without
    torchrun (an existing group is kept). `device`: auto (CUDA when available),
    cpu, cuda (this process's LOCAL_RANK GPU) or cuda:N. A collective that waits
    more than `timeout_s` for a peer raises (gloo) or is aborted by NCCL's watchdog,
    which takes the process down, so torchrun can restart the group: a hung or
    dead peer becomes an error, not a hang. Returns (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"unknown device {device!r}: expected auto, cpu, cuda or cuda:N")
    if device != "cpu" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for, but torch sees no CUDA device")
    device = torch.device("cpu") if device == "cpu" else torch.device("cuda", int(device[5:] or local_rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if world > 1:
            dist.init_process_group(backend, store=_attempt_store(timeout), rank=rank, world_size=world,
                                    timeout=timeout)
        else:  # torchrun's rendezvous variables are absent: an in-process store serves a group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world, device


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's rendezvous store, under a prefix of its own for this restart attempt.

    torchrun (static rendezvous) keeps one store across the restarts of a group,
    where each rank of the first attempt published its address. Without the
    prefix, a restarted rank can read a dead rank's address before the new one
    overwrites it, and gloo's mesh fails with "Connection refused"."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"rollplex/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def collective_device(backend: str) -> torch.device:
    """The device a collective of `backend` takes its tensors on: NCCL only CUDA
    tensors (this process's current GPU), the others (gloo) CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == dist.Backend.NCCL else torch.device("cpu")


def all_reduce_values(values: Sequence[float], op: dist.ReduceOp = dist.ReduceOp.SUM,
                      group: dist.ProcessGroup | None = None) -> list[float]:
    """Reduce a few host numbers (float64: integers up to 2**53 stay exact) over
    `group` (None: every rank); every rank of it passes as many values."""
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(dist.get_backend(group)))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank of `group` (None: every rank)."""
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Every rank's `local`, in rank order along dim 0, written into `output` (one collective, no staging copy):
    torch 2.13's all_gather_single, all_gather_into_tensor before it (2.13 deprecates that name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (dims.dp_shard, dims.tp), mesh_dim_names=("dp_shard", "tp"))


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    """The experts' mesh, ("efsdp", "ep") = (dp_shard / ep, ep), over the same ranks as `build_mesh`'s (tp is 1):
    rank efsdp * ep + e holds the e-th ep share of the experts, FSDP-sharded over the efsdp ranks that hold the
    same share. None at ep 1. Collective: every rank builds it."""
    if dims.ep == 1:
        return None
    return init_device_mesh(device_type, (dims.dp_shard // dims.ep, dims.ep), mesh_dim_names=("efsdp", "ep"))


class CollectiveInLocalWork(RuntimeError):
    """A collective was issued where this rank's peers would not issue it alike."""


# The collectives, by module: torch.distributed's (FSDP's gathers and reductions, rollplex's own reductions;
# callers reach them through either module), and the functional ones DTensor redistributes with. By name,
# so that the check covers each torch version's own set.
_COLLECTIVE_NAME = re.compile(r"(all_|reduce|broadcast|barrier|monitored_barrier|gather|scatter|send|recv|isend|"
                              r"irecv|batch_isend_irecv|permute_tensor)")


def _collectives(module) -> list[str]:
    # type(), not isinstance: the latter reads a deprecated alias's __class__, which warns
    return [name for name, value in vars(module).items() if _COLLECTIVE_NAME.match(name)
            and type(value) is types.FunctionType and not name.endswith(("_backward", "_setup_context"))]


@contextlib.contextmanager
def no_collectives(what: str) -> Iterator[None]:
    """Raise `CollectiveInLocalWork` at any collective issued inside: for work each rank
    runs in its own order (the decode window's finished-group passes), where a collective
    would wait for peers that issue theirs at other times, or never. It checks by
    replacing the collectives for the duration: only for work on the calling thread."""
    originals = [(module, name, getattr(module, name)) for module in (dist, c10d, funcol)
                 for name in _collectives(module)]

    def refused(name: str):
        def collective(*args, **kwargs):
            raise CollectiveInLocalWork(f"{name} issued inside {what}: each rank runs this work in its own "
                                        "order, so its peers would not issue the collective alike and the ranks "
                                        "would hang")
        return collective

    try:
        for module, name, _ in originals:
            setattr(module, name, refused(f"{module.__name__}.{name}"))
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
