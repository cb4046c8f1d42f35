"""Run a test body on several CPU processes with gloo, as torchrun would."""

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAX_ERROR_CHARS = 8000  # per rank; two ranks' stay well within a pipe's 64 KiB


def _worker(rank: int, world: int, port: int, fn, args, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # No rank tears its groups down while another still talks on them.
        dist.barrier()
    except Exception:
        # The queue is read after every rank exits: a message larger than the pipe's buffer would block this
        # rank's exit for good, so only the traceback's end (where the error is) goes through.
        errors.put(f"rank {rank}:\n{traceback.format_exc()[-MAX_ERROR_CHARS:]}")
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args) -> None:
    """Call fn(rank, world, *args) in `world` processes; re-raise the first failure.
    `fn` must be a module-level function (it is pickled); results go through files."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), fn, args, errors), nprocs=world, join=True)
    if not errors.empty():
        raise AssertionError(errors.get())
