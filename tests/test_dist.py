"""Process groups: small host-side reductions (micro-batch counts, metrics, KV
block counts) go through one helper that puts them on the device the group's
backend takes (NCCL takes only CUDA tensors; gloo, which the other tests run
on, takes CPU ones and would hide a CPU tensor sent to NCCL), and a single
process trains in a group of one."""

import torch
import torch.distributed as dist

from rollplex.dist import all_reduce_values, collective_device, init_distributed


def test_collectives_take_tensors_on_the_backends_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # this process's GPU, as set_device chose it
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")


def test_one_process_reduces_in_a_group_of_one():
    init_distributed("cpu")
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert init_distributed("cpu")[:2] == (0, 1)  # joining again keeps the group
    assert all_reduce_values([3, 2.5, True], dist.ReduceOp.MAX) == [3.0, 2.5, 1.0]
