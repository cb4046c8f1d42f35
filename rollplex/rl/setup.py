"""A run's set-up before any weights load: where it resumes (trainer.resume,
checked against the run folder's config.yaml), the checkpoint (the tiny model,
built when model.path is empty), the prompts, and the memory plan that sizes the run."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rollplex.agent.tools import load_tools
from rollplex.config import Config, ConfigError, DataConfig, TrainerConfig, config_to_dict, load_config_file
from rollplex.dist import ParallelDims, all_reduce_values
from rollplex.device import free_memory
from rollplex.metrics import CONFIG_FILE
from rollplex.models.loader import read_model_args
from rollplex.models.registry import family_of
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from rollplex.ops.attention import resolve_backend
from rollplex.rl.memory import BatchShape, MemoryOptions, MemoryPlan, ParallelLayout, plan_memory
from rollplex.train.checkpoint import MARKER, latest_checkpoint


# Keys a resumed run may change: how long it runs, where and what it reports, how its processes are set up,
# and the memory and speed settings that leave the samples and the update's math as they were (the engine's
# tokens do not depend on its batch or pool size, nor on graphs; micro-batches only regroup a sum). After an
# out-of-memory error, these are what a user lowers before resuming. Every other key changes what the run
# computes (model, algorithm, data, rollout sampling, parallel layout, schedule, optimizer), so a saved
# config.yaml that differs in one stops an automatic resume.
RUN_LENGTH_AND_REPORTING_KEYS = frozenset({
    "trainer.total_steps", "trainer.total_epochs", "trainer.save_every", "trainer.keep_last", "trainer.eval_every",
    "trainer.val_before_train", "trainer.output_dir",
    "trainer.save_hf", "trainer.hf_dir",
    "trainer.num_threads", "trainer.resume", "trainer.collective_timeout_s",
    "logging.console", "logging.jsonl", "logging.tensorboard", "logging.log_every", "logging.wandb",
    "logging.swanlab", "logging.project", "logging.run_name", "trainer.log_samples_every", "trainer.log_samples",
    "rollout.max_num_seqs", "rollout.enforce_eager", "rollout.shared_prefix_decode", "rollout.kv_cache_memory",
    "trainer.device_memory",
    "trainer.max_tokens_per_micro_batch", "schedule.prefix_memory_budget", "parallel.activation_checkpointing",
    "data.reward_workers", "trainer.max_skipped_steps", "trainer.save_on_term", "trainer.val_n",
    "trainer.val_temperature", "trainer.val_top_p", "logging.progress", "logging.progress_every_s",
})  # fmt: skip
TINY_SPEC_FILE = "rollplex_tiny.json"  # the model.tiny section a run folder's tiny model was built from


class ResumeRefused(ConfigError):
    """The run folder holds a run this config must not continue (or overwrite) silently."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint it loads (None: from scratch) and that checkpoint's step."""

    checkpoint: Path | None = None
    step: int = 0


def resume_point(cfg: Config, out: Path, rank: int, world: int) -> ResumePoint:
    """Where this run starts (trainer.resume), before any weights load. Rank 0 reads the run folder and every
    rank gets its answer, or its error: all ranks decide alike and none waits on a peer that stopped."""
    answer: list[Any] = [None]
    if rank == 0:
        try:
            answer[0] = _decide_resume(cfg, out)
        except Exception as error:  # noqa: BLE001 - sent to the other ranks, raised on every one
            answer[0] = error
    if world > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], Exception):
        raise answer[0]
    return answer[0]


def _decide_resume(cfg: Config, out: Path) -> ResumePoint:
    resume, checkpoints = cfg.trainer.resume, out / "checkpoints"
    if resume == "never":
        if found := sorted(p.name for p in checkpoints.glob("step_*")):
            raise ResumeRefused(f"trainer.resume is never, but {checkpoints} holds {', '.join(found)}: set "
                                f"trainer.resume auto (or a checkpoint folder) to continue that run, or a new "
                                f"trainer.output_dir to start another (nothing was deleted)")
        return ResumePoint()
    if resume == "auto":
        latest = latest_checkpoint(checkpoints)
        if latest is None:
            return ResumePoint()
        if (out / CONFIG_FILE).is_file():
            _require_same_run(load_config_file(out / CONFIG_FILE), cfg, out, latest)
    else:
        latest = Path(resume)
        if not (latest / MARKER).is_file():
            raise ResumeRefused(f"trainer.resume {resume}: not a complete checkpoint folder (no {MARKER}); "
                                f"give one such as {checkpoints / 'step_00000100'}, or auto or never")
    if not cfg.model.path:
        _require_same_tiny_model(cfg, out)
    return ResumePoint(latest, json.loads((latest / MARKER).read_text())["step"])


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def config_differences(saved: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """{key: (saved value, new value)} of the keys that change the run (not RUN_LENGTH_AND_REPORTING_KEYS)."""
    old, now = _flat(config_to_dict(saved)), _flat(config_to_dict(new))
    return {k: (old[k], now[k]) for k in old if k not in RUN_LENGTH_AND_REPORTING_KEYS and old[k] != now[k]}


def _require_same_run(saved: Config, cfg: Config, out: Path, checkpoint: Path) -> None:
    if differences := config_differences(saved, cfg):
        keys = "\n".join(f"  {k}: {old!r} -> {new!r}" for k, (old, new) in differences.items())
        raise ResumeRefused(f"{out} holds a run with another config; its checkpoint {checkpoint.name} was not "
                            f"loaded. Differing keys (saved -> now):\n{keys}\nTo start another run, set a new "
                            f"trainer.output_dir; to continue this one with the new values, set "
                            f"trainer.resume {checkpoint}")


def _require_same_tiny_model(cfg: Config, out: Path) -> None:
    """A resumed run's tiny model (its reference model, its processor) is the one its checkpoints came from."""
    built = _built_tiny_spec(out / "tiny_model")
    wanted = dataclasses.asdict(cfg.model.tiny)
    if built is not None and built != wanted:
        fields = ", ".join(f"model.tiny.{k}: {built.get(k)!r} -> {v!r}" for k, v in wanted.items()
                           if built.get(k) != v)
        raise ResumeRefused(f"{out / 'tiny_model'} was built with another model.tiny than its checkpoints are "
                            f"resumed with ({fields}): set a new trainer.output_dir, or the old values")


def _built_tiny_spec(path: Path) -> dict[str, Any] | None:
    spec = path / TINY_SPEC_FILE
    return json.loads(spec.read_text()) if spec.is_file() else None


def model_path(cfg: Config, out: Path, rank: int, world: int, start: ResumePoint) -> Path:
    """model.path, or the tiny model (model.tiny), which rank 0 writes into `out`: once, and again when a run
    that starts from scratch finds one built from another model.tiny (a resumed one was checked: see
    `resume_point`)."""
    if cfg.model.path:
        return Path(cfg.model.path)
    path = out / "tiny_model"
    wanted = dataclasses.asdict(cfg.model.tiny)
    if rank == 0 and not ((path / "config.json").exists()
                          and (start.checkpoint is not None or _built_tiny_spec(path) == wanted)):
        shutil.rmtree(path, ignore_errors=True)  # no file of another vocabulary stays behind
        make_tiny_checkpoint(path, TinySpec.from_config(cfg.model.tiny), seed=cfg.model.tiny.seed)
        (path / TINY_SPEC_FILE).write_text(json.dumps(wanted))  # last: a half-built model is built again
    if world > 1:
        dist.barrier()
    return path


def load_run_processor(path: Path, d: DataConfig):
    """The model folder's processor, within data.*'s pixel and frame budgets (0 = the folder's own)."""
    from rollplex.data.processor import load_processor

    return load_processor(path, min_pixels=d.min_pixels or None, max_pixels=d.max_pixels or None,
                          video_max_pixels=d.video_max_pixels or None, video_max_frames=d.video_max_frames or None)


def run_tools(cfg: Config) -> list[str]:
    """The run's tool specs: rollout.tools, else the built-in task's own (data.task look)."""
    if cfg.rollout.tools or cfg.data.train_files:
        return list(cfg.rollout.tools)
    from rollplex.data.tasks import make_task

    return list(make_task(cfg.data.task).tools)


class PromptSource:
    """A run's prompts: training batches (resumable by step) and validation
    examples, from files (data.train_files) or from the built-in synthetic task."""

    def __init__(self, d: DataConfig, processor, tools: list[str] = ()):
        """`tools`: a multi-turn run's tool specs (rollout.tools), whose schemas the files' prompts render."""
        from rollplex.data.datasets import PromptDataset
        from rollplex.data.tasks import make_task, validation_examples

        self.config, self.processor = d, processor
        self.train_data, self.task = None, None
        if d.train_files:
            schemas = [t.schema for t in load_tools(list(tools))] if tools else []

            def dataset(files: list[str]) -> PromptDataset:
                return PromptDataset(files, processor=processor, max_prompt_length=d.max_prompt_length,
                                     format=d.format, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                     image_key=d.image_key, video_key=d.video_key, video_fps=d.video_fps,
                                     format_prompt=d.format_prompt, system_prompt=d.system_prompt, tools=schemas)

            self.train_data = dataset(d.train_files)
            self.val_examples = list(dataset(d.val_files)) if d.val_files else []
        else:
            options = {"color": dict(image_size=d.image_size), "look": dict(image_size=d.image_size),
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

    def run_steps(self, t: TrainerConfig) -> int:
        """The run's length: trainer.total_steps, or with trainer.total_epochs the steps that take each row of the
        training files that many times, ceil(total_epochs x rows / data.batch_size) (a batch runs on from one epoch
        into the next; the rows after a skipped row fill its place)."""
        if not t.total_epochs:
            return t.total_steps
        if self.train_data is None:
            raise ConfigError(f"trainer.total_epochs counts passes over data.train_files; the built-in task "
                              f"{self.config.task!r} has no epochs: set trainer.total_steps instead")
        return math.ceil(t.total_epochs * len(self.train_data) / self.config.batch_size)


def plan_run_memory(cfg: Config, path: Path, examples: list, dims: ParallelDims, device: torch.device,
                    compute_dtype: torch.dtype, memory_layout: str) -> MemoryPlan:
    """The memory plan (rollplex.rl.memory) of this run's model, layout and
    options, for the shapes of its first batch (`examples`): it decides the sizes
    the config leaves to it (the KV pool, the prefix budget, the micro-batch) within
    trainer.device_memory or the device's own (the least of any rank's, so that
    every rank sizes alike), and gives each phase's peak. `memory_layout`: the
    schedule's (rollplex.rl.schedules.base.Schedule.memory_layout); disagg is planned
    as if colocated, which over-counts each side."""
    args = read_model_args(path)
    check_splits(args, cfg, path)
    vision = sum(int((e.prompt.input_ids == t).sum()) for e in examples
                 for t in (args.image_token_id, args.video_token_id)) // len(examples)
    lengths = [len(e.prompt.input_ids) for e in examples]
    # Files bound their prompts by data.max_prompt_length; the built-in tasks' prompts are alike.
    longest = cfg.data.max_prompt_length if cfg.data.train_files else max(lengths)
    batch = BatchShape(cfg.data.batch_size, cfg.rollout.n, max(1, sum(lengths) // len(lengths) - vision),
                       cfg.rollout.max_tokens, vision, longest_prompt=longest)
    if batch.longest_sequence > args.text.max_position_embeddings:
        raise ConfigError(f"a prompt of up to {longest} tokens (data.max_prompt_length) plus rollout.max_tokens "
                          f"{cfg.rollout.max_tokens} is {batch.longest_sequence} tokens, over the model's "
                          f"max_position_embeddings {args.text.max_position_embeddings} ({path}/config.json): "
                          "lower one of the two")
    memory = int(cfg.trainer.device_memory) or device_memory(device)
    options = MemoryOptions.from_config(cfg, memory_layout, compute_dtype, memory,
                                        resolve_backend(cfg.model.attn_backend, device))
    engine_tp = cfg.rollout.tp if dims.world_size % cfg.rollout.tp == 0 else dims.tp
    layout = ParallelLayout.of(dims, engine_tp)
    return plan_memory(args, layout, batch, options)


def check_splits(args, cfg: Config, path: Path) -> None:
    """Before any weights load: the trainer's and the engine's tensor-parallel sizes must split the model."""
    for key, tp in (("parallel.tp", cfg.parallel.tp), ("rollout.tp", cfg.rollout.tp)):
        try:
            family_of(args).check_tp(args, tp)
        except ValueError as e:
            raise ConfigError(f"{key} {tp}: {e} ({path}/config.json)") from e


def device_memory(device: torch.device) -> int:
    """Bytes of memory of this rank's device (CUDA: its total; CPU: the available RAM), the least of any rank's."""
    own = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else free_memory(device)
    return int(all_reduce_values([own], dist.ReduceOp.MIN)[0]) if dist.get_world_size() > 1 else own
