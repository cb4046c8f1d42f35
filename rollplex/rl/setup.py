"""A run's set-up before any weights load: the checkpoint (the tiny model, built
when model.path is empty), the prompts, and the memory plan that sizes the run."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from rollplex.config import Config, DataConfig
from rollplex.dist import ParallelDims, all_reduce_values
from rollplex.device import free_memory
from rollplex.models.loader import read_hf_config
from rollplex.models.qwen2_5_vl.hf import args_from_hf_config
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from rollplex.ops.attention import resolve_backend
from rollplex.rl.memory import BatchShape, MemoryOptions, MemoryPlan, ParallelLayout, plan_memory


def model_path(cfg: Config, out: Path, rank: int, world: int) -> Path:
    """model.path, or the tiny model (model.tiny), which rank 0 writes into `out` once."""
    if cfg.model.path:
        return Path(cfg.model.path)
    path = out / "tiny_model"
    if rank == 0 and not (path / "config.json").exists():
        make_tiny_checkpoint(path, TinySpec.from_config(cfg.model.tiny), seed=cfg.model.tiny.seed)
    if world > 1:
        dist.barrier()
    return path


class PromptSource:
    """A run's prompts: training batches (resumable by step) and validation
    examples, from files (data.train_files) or from the built-in synthetic task."""

    def __init__(self, d: DataConfig, processor):
        from rollplex.data.datasets import PromptDataset
        from rollplex.data.tasks import make_task, validation_examples

        self.config, self.processor = d, processor
        self.train_data, self.task = None, None
        if d.train_files:
            def dataset(files: list[str]) -> PromptDataset:
                return PromptDataset(files, processor=processor, max_prompt_length=d.max_prompt_length,
                                     format=d.format, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                     image_key=d.image_key, video_key=d.video_key, video_fps=d.video_fps)

            self.train_data = dataset(d.train_files)
            self.val_examples = list(dataset(d.val_files)) if d.val_files else []
        else:
            options = {"color": dict(image_size=d.image_size),
                       "direction": dict(num_frames=d.num_frames, frame_size=d.image_size)}.get(d.task, {})
            self.task = make_task(d.task, **options)
            self.val_examples = validation_examples(self.task, processor, d.val_size, d.seed)

    def batches(self, start_step: int) -> Iterator[list]:
        """The training batches from step `start_step` on (data.batch_size prompts each)."""
        d = self.config
        if self.train_data is not None:
            return self.train_data.batches(d.batch_size, seed=d.seed, start_step=start_step)
        from rollplex.data.tasks import task_batches

        return task_batches(self.task, self.processor, d.batch_size, d.seed, start_step)

    @property
    def skipped(self) -> float:
        """Rows of the training files skipped so far (too long, unreadable)."""
        return float(sum(self.train_data.skipped.values())) if self.train_data is not None else 0.0


def plan_run_memory(cfg: Config, path: Path, examples: list, dims: ParallelDims, device: torch.device,
                    compute_dtype: torch.dtype) -> MemoryPlan:
    """The memory plan (rollplex.rl.memory) of this run's model, layout and
    options, for the shapes of its first batch (`examples`): it decides the sizes
    the config leaves to it (the KV pool, the prefix budget, the micro-batch) within
    trainer.device_memory or the device's own (the least of any rank's, so that
    every rank sizes alike), and gives each phase's peak. disagg is planned as
    if colocated, which over-counts each side."""
    args = args_from_hf_config(read_hf_config(path), str(path))
    vision = sum(int((e.prompt.input_ids == t).sum()) for e in examples
                 for t in (args.image_token_id, args.video_token_id)) // len(examples)
    lengths = [len(e.prompt.input_ids) for e in examples]
    # Files bound their prompts by data.max_prompt_length; the built-in tasks' prompts are alike.
    longest = cfg.data.max_prompt_length if cfg.data.train_files else max(lengths)
    batch = BatchShape(cfg.data.batch_size, cfg.rollout.n, max(1, sum(lengths) // len(lengths) - vision),
                       cfg.rollout.max_tokens, vision, longest_prompt=longest)
    memory = int(cfg.trainer.device_memory) or device_memory(device)
    options = MemoryOptions.from_config(cfg, compute_dtype, memory, resolve_backend(cfg.model.attn_backend, device))
    engine_tp = cfg.rollout.tp if dims.world_size % cfg.rollout.tp == 0 else dims.tp
    layout = ParallelLayout(dims.dp_shard, dims.tp, engine_tp, 1, dims.world_size)
    return plan_memory(args, layout, batch, options)


def device_memory(device: torch.device) -> int:
    """Bytes of memory of this rank's device (CUDA: its total; CPU: the available RAM), the least of any rank's."""
    own = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else free_memory(device)
    return int(all_reduce_values([own], dist.ReduceOp.MIN)[0]) if dist.get_world_size() > 1 else own
