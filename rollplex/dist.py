"""Process group and device mesh.

One process per device, started by torchrun (or plain `python` for one
process). NCCL on CUDA, gloo on CPU, chosen from the device. The mesh has two
dimensions, ("dp_shard", "tp"): FSDP shards over the first, tensor parallelism
splits over the second (adjacent ranks, so TP stays inside a node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_shard: int
    tp: int

    @classmethod
    def resolve(cls, world_size: int, dp_shard: int, tp: int) -> "ParallelDims":
        """dp_shard = -1 takes the rest of the world; the product must equal the world size."""
        if tp < 1 or world_size % tp:
            raise ValueError(f"tp={tp} does not divide the world size {world_size}")
        if dp_shard == -1:
            dp_shard = world_size // tp
        if dp_shard < 1 or dp_shard * tp != world_size:
            raise ValueError(f"dp_shard={dp_shard} x tp={tp} = {dp_shard * tp} != world size {world_size}")
        return cls(world_size, dp_shard, tp)


def init_distributed(device: str = "auto") -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up (if any). `device`: auto (CUDA when
    available), cpu, cuda (this process's LOCAL_RANK GPU) or cuda:N. Returns
    (rank, world size, device)."""
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
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    return rank, world, device


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    return init_device_mesh(device_type, (dims.dp_shard, dims.tp), mesh_dim_names=("dp_shard", "tp"))
