"""Phase-aware memory on CPU: no tensor memory grows across steps, and layouts
that cannot work fail before any work starts, naming the numbers."""

import gc
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor

from rollplex.config import load_config
from rollplex.rl.loop import RLTrainer

FAST = ["--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4", "--trainer.eval_every", "0",
        "--trainer.save_every", "0", "--logging.no_console", "--algorithm.kl_coef", "0.01"]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the process still references."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on some of gc's objects trips torch's deprecation shims
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        # A DTensor (FSDP's sharded parameters) has no storage of its own; gc finds its local tensor.
        if t.device.type != "meta" and not isinstance(t, DTensor):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_memory_does_not_grow_over_50_steps(tmp_path):
    """The overlap schedule keeps the most state (KV pool, kept prompts and their
    graphs, vision features): after step 3 nothing of it may accumulate."""
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--schedule.kind", "overlap",
                                            "--trainer.total_steps", "50"]))
    batches = trainer._batches(0)
    sizes = []
    for step in range(1, 51):
        trainer.step = step
        trainer.train_step(next(batches))
        sizes.append(live_tensor_bytes())
    assert max(sizes[3:]) <= sizes[2], f"live tensor bytes after step 3: {sizes[2]}, later up to {max(sizes[3:])}"
    assert trainer.engine.cache.nbytes == 0  # the KV pool is gone between rollouts


@pytest.mark.parametrize("extra, message", [
    (["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1"], r"rollout_ranks < world size 1"),
    (["--parallel.tp", "3"], r"tp=3 does not divide the world size 1"),
    (["--data.batch_size", "1", "--algorithm.updates_per_batch", "2"],
     r"data.batch_size 1 over 1 dp rank\(s\) leaves a rank 1 prompt\(s\), fewer than algorithm.updates_per_batch 2"),
])
def test_impossible_layouts_fail_first(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), *extra]))
    assert not (tmp_path / "tiny_model").exists()  # raised before any work
