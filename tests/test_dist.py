"""Process groups: small host-side reductions (micro-batch counts, metrics, KV
block counts) go through one helper that puts them on the device the group's
backend takes (NCCL takes only CUDA tensors; gloo, which the other tests run
on, takes CPU ones and would hide a CPU tensor sent to NCCL), a single
process trains in a group of one, and a peer that hangs turns into an error
after the collective timeout instead of a hang."""

import torch
import torch.distributed as dist

from rollplex.dist import CollectiveInLocalWork, all_reduce_values, collective_device, init_distributed, no_collectives


def test_collectives_take_tensors_on_the_backends_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # this process's GPU, as set_device chose it
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")


def test_one_process_reduces_in_a_group_of_one():
    init_distributed("cpu")
    assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    assert init_distributed("cpu")[:2] == (0, 1)  # joining again keeps the group
    assert all_reduce_values([3, 2.5, True], dist.ReduceOp.MAX) == [3.0, 2.5, 1.0]


def test_no_collectives_refuses_every_kind_of_collective_and_restores_them():
    """Work each rank runs in its own order may issue no collective: torch.distributed's,
    reached through either module, and the functional ones DTensor redistributes with."""
    import pytest
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    init_distributed("cpu")
    calls = {"all_reduce_values": lambda: all_reduce_values([1.0]), "barrier": lambda: dist.barrier(),
             "c10d.all_gather_into_tensor": lambda: c10d.all_gather_into_tensor(torch.empty(1), torch.ones(1)),
             "funcol.all_reduce": lambda: funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD)}
    for name, call in calls.items():
        with pytest.raises(CollectiveInLocalWork, match="inside the test's pass"), no_collectives("the test's pass"):
            call()
    assert all_reduce_values([2.0]) == [2.0]  # outside, the collectives are back
    with no_collectives("the test's pass"):
        torch.ones(2).sum()  # local work runs


def _join_then(rank: int, port: int, timeout_s: float, results) -> None:
    """Rank 1 joins and then hangs; rank 0 joins and waits for it in a collective."""
    import os
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    init_distributed("cpu", timeout_s=timeout_s)
    if rank == 1:
        time.sleep(60)  # hung: the test kills this process
        return
    start = time.perf_counter()
    try:
        all_reduce_values([1.0])
        results.put(("returned", time.perf_counter() - start))
    except RuntimeError as e:
        results.put((str(e), time.perf_counter() - start))


def test_a_hung_peer_becomes_an_error_after_the_collective_timeout():
    from distributed import _free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.SimpleQueue(), _free_port()
    ranks = [ctx.Process(target=_join_then, args=(rank, port, 2.0, results)) for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        ranks[0].join(timeout=60)
        assert not results.empty(), "rank 0 neither returned nor raised"
        message, waited = results.get()
    finally:
        for p in ranks:
            p.kill()
    assert "timed out" in message.lower(), message
    assert 2.0 <= waited < 10.0
