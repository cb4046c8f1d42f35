"""The synchronous on-policy GRPO loop.

One step, with each phase a named method (the schedules rearrange them, they
do not rewrite them):

    rollout  -> the engine samples n responses per prompt on the trainer's own weights
                (overlap: prompt work runs in its decode window, rollplex.rl.prefix)
    prefix   -> serial with share_prefix: the same prompt work, after rollout
    reward   -> score each response against the prompt's answer
    advantage-> group-normalised (GRPO) or mean-centred (Dr.GRPO)
    logprobs -> reference model (when kl_coef > 0), old policy (when recomputed)
    update   -> `updates_per_batch` optimizer steps on mini-batches of the groups

Three schedules, the same samples and updates: serial with share_prefix false
(every pass recomputes the vision tower and the whole sequence per sample, as
a plain colocated trainer does), serial with share_prefix (prompt work once
per prompt, then suffix-only passes), overlap (that prompt work hidden in the
decode window). A fourth, disagg, runs rollout and training on separate ranks
(rollplex.rl.disagg): the baseline the others are measured against.

Every dp rank rolls out and trains on its own share of the prompts; all n samples
of a prompt stay on one rank, so advantages need no communication. Sampling
seeds come from the prompt's global index, so a prompt gets the same samples
whatever rank or world size handles it.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from rollplex.config import Config, save_config
from rollplex.data.processing import load_processor
from rollplex.data.reward_scoring import RewardScorer, RewardScores
from rollplex.dist import ParallelDims, all_reduce_values, build_mesh, init_distributed
from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.engine.engine import free_memory, mix_seed
from rollplex.metrics import GpuSampler, MetricsLogger, Timer
from rollplex.models import SequenceInputs, from_pretrained
from rollplex.models.loader import args_from_hf_config, read_hf_config
from rollplex.models.packing import GroupInputs
from rollplex.models.qwen2_5_vl import VisionEmbeds
from rollplex.models.tiny import TinySpec, default_mrope_section, make_tiny_checkpoint
from rollplex.rl.disagg import DisaggLayout, WeightBroadcast
from rollplex.ops.attention import resolve_backend
from rollplex.rl.memory import (GiB, PHASE_MARK, BatchShape, CpuPhasePeaks, MemoryOptions, MemoryPlan, ParallelLayout,
                                PrefixKind, live_tensor_bytes, loop_phase_bytes, plan_memory, prefix_items,
                                prefix_state)
from rollplex.rl.prefix import PrefixScheduler, PrefixWork
from rollplex.rl.weights import SharedWeights
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, lr_schedule
from rollplex.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rollplex.train.flops import peak_flops
from rollplex.train.loss import group_advantages
from rollplex.train.parallelize import apply_tp, parallelize

GLOBAL_ACTOR_METRICS = ("actor/grad_norm", "actor/lr", "actor/skipped_steps", "training/nonfinite_logprobs")
COUNTED_ACTOR_METRICS = ("training/nonfinite_logprobs",)  # summed over the step's updates, not averaged


def _kill_if_asked(step: int, rank: int) -> None:
    """Fault injection for the restart tests: ROLLPLEX_KILL_AT_STEP="STEP:RANK" makes
    that rank SIGKILL itself as it starts that step (its peers are then inside the
    step's collectives), in torchrun's first attempt only, so the restarted group
    runs through."""
    target = os.environ.get("ROLLPLEX_KILL_AT_STEP")
    if target and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and target == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Rollout:
    """One step's samples on this rank, responses in group order."""

    examples: list  # rollplex.data Example per prompt
    groups: list[GroupInputs]
    texts: list[str]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    prefix: PrefixScheduler | None = None  # the step's prompt work (all schedules but serial without share_prefix)


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.out = Path(cfg.trainer.output_dir)
        # disagg: the last schedule.rollout_ranks ranks only generate (rollplex/rl/disagg.py); the rest train.
        self.disagg = DisaggLayout(self.world, cfg.schedule.rollout_ranks, cfg.rollout.tp) \
            if cfg.schedule.kind == "disagg" else None
        self.generates = self.disagg is None or self.disagg.is_rollout(self.rank)
        self.trains = self.disagg is None or not self.disagg.is_rollout(self.rank)
        train_world = self.disagg.train_ranks if self.disagg else self.world
        self.dims = ParallelDims.resolve(train_world, cfg.parallel.dp_shard, cfg.parallel.tp)
        fewest = cfg.data.batch_size // self.dims.dp_shard
        if fewest < cfg.algorithm.updates_per_batch:
            # Every optimizer step needs groups on every dp rank (its FSDP collectives run on all of them).
            raise ValueError(f"data.batch_size {cfg.data.batch_size} over {self.dims.dp_shard} dp rank(s) leaves a rank "
                             f"{fewest} prompt(s), fewer than algorithm.updates_per_batch "
                             f"{cfg.algorithm.updates_per_batch}: raise the batch size or lower updates_per_batch")
        path = self._model_path()
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        self.processor = load_processor(path)
        self.tokenizer = self.processor.tokenizer
        self._load_data()
        # Before any weights load: a run whose shapes cannot fit fails here, naming what does not fit.
        self.memory = self._plan_memory(path)
        # On CPU, trainer.device_memory stands for a GPU's: each phase's peak live tensor bytes are measured too.
        self.cpu_peaks = CpuPhasePeaks() if self.device.type == "cpu" and cfg.trainer.device_memory else None
        # A trainer holds fp32 master weights and computes in model.dtype (FSDP gathers them in it, one process
        # too). The frozen reference model, and a disagg rollout rank's engine copy, hold model.dtype only.
        self.model = from_pretrained(path, dtype=torch.float32 if self.trains else self.compute_dtype,
                                     device=self.device, attn_backend=cfg.model.attn_backend)
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0 and self.trains:
            self.ref_model = from_pretrained(path, dtype=self.compute_dtype, device=self.device,
                                             attn_backend=cfg.model.attn_backend).requires_grad_(False)
        self._parallelize()
        r, a, t = cfg.rollout, cfg.algorithm, cfg.trainer
        self.engine = self._build_engine() if self.generates else None
        # The prefix slices' side stream, one for the trainer's lifetime (see rollplex.rl.prefix), at priority 0,
        # CUDA's lowest: the engine's decode stream goes first.
        self.side_stream = torch.cuda.Stream(self.device, priority=0) if self.device.type == "cuda" else None
        self.actor = None
        if self.trains:
            self.actor = Actor(self.model, ActorConfig(
                lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                max_tokens_per_micro_batch=self.memory.sizes.micro_batch_tokens,
                share_prefix=cfg.schedule.share_prefix,
                clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c, loss_agg_mode=a.loss_agg_mode,
                kl_coef=a.kl_coef, kl_kind=a.kl_kind, entropy_coef=a.entropy_coef, tis_cap=a.tis_cap,
                max_response_len=r.max_tokens, offload_optimizer=cfg.parallel.offload_optimizer), self.dp_group,
                lr_lambda=lr_schedule(t.lr_schedule, t.warmup_steps, t.total_steps * a.updates_per_batch))
        self.reward_scorer = RewardScorer(cfg.data.reward, cfg.data.reward_workers, cfg.data.reward_timeout_s)
        self.logger = MetricsLogger(self.out, rank=self.rank, console=cfg.logging.console, jsonl=cfg.logging.jsonl,
                                    tensorboard=cfg.logging.tensorboard, total_steps=t.total_steps)
        self.gpu_sampler = GpuSampler(device=self.device.index if self.device.type == "cuda" else None)
        self.step = 0

    # ------------------------------------------------------------------ set-up

    def _build_engine(self) -> Engine:
        """The engine on the rollout layout of the weights: built inside `for_rollout`,
        where it reads its KV head count and dtype off the parameters (outside, FSDP's
        dp shard of k_proj holds a fraction of the heads). Every rank gets the same KV
        pool size, the smallest any rank can hold, so that the ranks of a TP group
        schedule alike. Its pool's capacity is the memory plan's; the pool itself
        exists only while it generates."""
        r = self.cfg.rollout
        config = EngineConfig(block_size=r.block_size, num_blocks=self.memory.kv_pool_blocks,
                              max_num_seqs=r.max_num_seqs, enforce_eager=r.enforce_eager, progress=False)
        with self.weights.for_rollout() as engine_model:
            engine = Engine(engine_model, config)
            if self.world > 1:
                [blocks] = all_reduce_values([engine.cache.capacity], dist.ReduceOp.MIN, self.engine_ranks)
                if blocks != engine.cache.capacity:
                    config.num_blocks = int(blocks)
                    engine = Engine(engine_model, config)
        engine.release_kv()
        return engine

    def _generate(self, requests: list[Request], params: SamplingParams, between_steps=None) -> list:
        """Generate on this rank's engine. When the engine's TP group spans several dp
        ranks (rollout.tp > parallel.tp), the group generates all its ranks' requests
        together and each rank keeps its own outputs (seeds come from the prompts, so
        the samples do not depend on the grouping)."""
        group = self.weights.engine_tp_group if self.cfg.rollout.tp > self.cfg.parallel.tp else None
        if group is None:
            return self.engine.generate(requests, params, between_steps)
        # Vision features are left out: a peer's engine encodes its own (they are device tensors).
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, [replace(q, vision=None) for q in requests], group=group)
        outputs = self.engine.generate([q for qs in everyone for q in qs], params, between_steps)
        first = sum(len(qs) for qs in everyone[:dist.get_rank(group)])
        return outputs[first:first + len(requests)]

    def _parallelize(self) -> None:
        """Trainers: FSDP2 (+ TP) over their mesh, a single trainer too (a mesh of
        one: the same mixed precision as many), the reference model alike.
        disagg rollout ranks: only the engine's TP over their replica."""
        cfg = self.cfg
        self.dp_rank, self.dp_group, self.train_group, self.engine_ranks = 0, None, None, None
        if self.disagg is not None:
            mesh, rollout_mesh = self.disagg.meshes(self.dims.dp_shard, self.dims.tp, self.device.type)
            self.weight_broadcast = WeightBroadcast(self.disagg, self.rank, self.compute_dtype)
            self.train_group = dist.new_group(list(range(self.disagg.train_ranks)))  # checkpoints: trainers only
            self.engine_ranks = dist.new_group(list(range(self.disagg.train_ranks, self.world)))
            if self.generates:  # the engine's own copy, refilled by WeightBroadcast
                if cfg.rollout.tp > 1:
                    apply_tp(self.model, rollout_mesh["tp"])
                self.weights = SharedWeights(self.model, cfg.rollout.tp, cfg.rollout.tp)
                return
        else:
            mesh = build_mesh(self.dims, self.device.type)
        self.dp_rank, self.dp_group = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].get_group()
        parallelize(self.model, mesh, cfg.parallel.activation_checkpointing, cfg.parallel.freeze_vision,
                    self.compute_dtype)
        if self.ref_model is not None:
            parallelize(self.ref_model, mesh, compute_dtype=self.compute_dtype)
        if self.disagg is None:
            self.weights = SharedWeights(self.model, cfg.parallel.tp, cfg.rollout.tp)

    def _model_path(self) -> Path:
        if self.cfg.model.path:
            return Path(self.cfg.model.path)
        out = self.out / "tiny_model"
        if self.rank == 0 and not (out / "config.json").exists():
            t = self.cfg.model.tiny
            make_tiny_checkpoint(out, TinySpec(
                hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size,
                vision_hidden_size=t.vision_hidden_size, vision_depth=t.vision_depth,
                vision_num_heads=t.vision_num_heads,
                vision_intermediate_size=t.vision_intermediate_size or 2 * t.vision_hidden_size,
                vocab=t.vocab, vocab_size=t.vocab_size or None, tie_word_embeddings=t.tie_word_embeddings,
                mrope_section=default_mrope_section(t.hidden_size // t.num_heads)), seed=t.seed)
        if self.world > 1:
            dist.barrier()
        return out

    def _load_data(self) -> None:
        """Training batches (resumable by step) and validation examples: from files,
        or from the built-in synthetic task."""
        from rollplex.data.datasets import PromptDataset
        from rollplex.data.tasks import make_task, validation_examples

        d = self.cfg.data
        if d.train_files:
            kw = dict(processor=self.processor, max_prompt_length=d.max_prompt_length, format=d.format,
                      prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key,
                      video_key=d.video_key, video_fps=d.video_fps)
            self.train_data = PromptDataset(d.train_files, **kw)
            self.val_examples = list(PromptDataset(d.val_files, **kw)) if d.val_files else []
        else:
            options = {"color": dict(image_size=d.image_size),
                       "direction": dict(num_frames=d.num_frames, frame_size=d.image_size)}.get(d.task, {})
            self.task = make_task(d.task, **options)
            self.train_data = None
            self.val_examples = validation_examples(self.task, self.processor, d.val_size, d.seed)

    def _batches(self, start_step: int):
        d = self.cfg.data
        if self.train_data is not None:
            return self.train_data.batches(d.batch_size, seed=d.seed, start_step=start_step)
        from rollplex.data.tasks import task_batches

        return task_batches(self.task, self.processor, d.batch_size, d.seed, start_step)

    def _skipped(self) -> float:
        return float(sum(self.train_data.skipped.values())) if self.train_data is not None else 0.0

    # ------------------------------------------------------------------ the loop

    def fit(self) -> None:
        cfg = self.cfg
        self._resume()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out / "config.yaml")
        batches = self._batches(self.step)
        while self.step < cfg.trainer.total_steps:
            examples = next(batches)
            self.step += 1
            _kill_if_asked(self.step, self.rank)
            metrics = self.train_step(examples)
            last = self.step == cfg.trainer.total_steps
            if cfg.trainer.eval_every and (self.step % cfg.trainer.eval_every == 0 or last):
                metrics.update(self.evaluate())
            saving = cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or last)
            if saving or self.device.type == "cuda":
                metrics["perf/live_memory_gb"] = self._live_bytes() / GiB
            if self.step % cfg.logging.log_every == 0 or last or "val/score" in metrics:
                self.logger.log(self.step, metrics)
            if saving:
                self._save()
        self.logger.close()
        self.reward_scorer.close()

    def _live_bytes(self) -> int:
        """Tensor bytes this rank holds between steps, the step's temporaries freed: what a
        leak grows. On CPU it is counted from the tensors Python references (about 0.3 s,
        so only on the steps that save a checkpoint)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return live_tensor_bytes()

    def train_step(self, examples: list) -> dict[str, float]:
        # GPU utilisation and memory over the step (no-op without an NVIDIA GPU), and each phase's peak memory
        with self.gpu_sampler, self._measure_phases() as peaks:
            metrics = self._train_step(examples)
        metrics.update(self.gpu_sampler.as_metrics())
        metrics.update(self._memory_metrics(peaks))
        return metrics

    @contextmanager
    def _measure_phases(self):
        """Yields a dict that holds each phase's peak allocated bytes once the step is
        done: the CUDA allocator's (recorded by `_phase`), or on CPU, where
        trainer.device_memory asks for it, the live tensor bytes (CpuPhasePeaks)."""
        if self.cpu_peaks is not None:
            with self.cpu_peaks.step() as peaks:
                yield peaks
        else:
            self.phase_peaks: dict[str, int] = {}
            yield self.phase_peaks

    def _train_step(self, examples: list) -> dict[str, float]:
        cfg, timer = self.cfg, Timer()
        start = time.perf_counter()
        rollout_metrics: dict[str, float] = {}
        if self.disagg is not None:
            rollout = self._disagg_rollout(examples, rollout_metrics)
            if rollout is None:
                return {}  # a rollout rank: the trainers report the step
            mine = rollout.examples
        else:
            mine = balanced_share(examples, self.dims.dp_shard, self.dp_rank)
            with self._phase(timer, "gen"):
                rollout = self.rollout(mine, self.step, prefix_work=self.uses_prefix_work)
            # Decode graphs are recaptured whenever the rollout's KV pool lands at another address or size.
            rollout_metrics = {"perf/cuda_graph_captures": self.engine.stats["graph_captures"],
                               "timing_s/cuda_graph_capture": self.engine.stats["graph_capture_s"]}
        prefix = rollout.prefix
        if prefix is not None and cfg.schedule.kind == "serial":
            with self._phase(timer, "prefix"), self.weights.for_rollout():
                prefix.drain()
        with self._phase(timer, "reward"):
            rewards = self.reward_scorer.score(rollout.texts,
                                               [e.answer for e in rollout.examples for _ in range(cfg.rollout.n)])
        group_index = torch.arange(len(mine)).repeat_interleave(cfg.rollout.n)
        advantages = group_advantages(torch.tensor(rewards.scores), group_index,
                                      norm_by_std=cfg.algorithm.adv_estimator == "grpo"
                                      and cfg.algorithm.norm_adv_by_std)
        old = rollout.logprobs
        if cfg.algorithm.recompute_old_logprobs:
            with self._phase(timer, "old_log_prob"):
                old = self._chunked_logprobs(self.model, rollout, (PrefixKind.ACTOR, PrefixKind.OLD))
        ref = None
        if self.ref_model is not None:
            with self._phase(timer, "ref"):
                ref = self._chunked_logprobs(self.ref_model, rollout, (PrefixKind.REF,))
                # FSDP2 keeps a root unit gathered from its forward to its backward, which a frozen model never
                # runs: without this its embedding and head would stay gathered for the rest of the run.
                self.ref_model.reshard()
        with self._phase(timer, "update_actor"):
            actor_metrics = self.update(rollout, advantages.tolist(), old, ref)
        metrics = self._gather_metrics(rollout, rewards, actor_metrics)
        metrics.update(timer.as_metrics())
        metrics.update(rollout_metrics)
        if self.disagg is None:
            metrics.update(self.weights.report.as_metrics())
        if prefix is not None:
            metrics.update(prefix.timing.as_metrics())
            metrics["prefix/deferred_items"] = len(prefix.deferred)
            metrics["prefix/dropped_for_memory"] = prefix.dropped_for_memory
            metrics["prefix/planned_bytes"] = prefix.planned_bytes
        metrics["timing_s/step"] = time.perf_counter() - start
        tokens = self._sum([sum(len(g.prompt.input_ids) * len(g.responses) + sum(map(len, g.responses))
                                for g in rollout.groups)])[0]
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / self.world
        if self.device.type == "cuda":
            peak = peak_flops(torch.cuda.get_device_name(self.device))
            if peak:  # model FLOPs of the update over its time, per GPU (see rollplex/train/flops.py)
                metrics["perf/mfu/actor"] = metrics["perf/actor_flops"] / (
                    metrics["timing_s/update_actor"] * peak * self.world)
        return metrics

    def _plan_memory(self, path: Path) -> MemoryPlan:
        """The memory plan (rollplex.rl.memory) of this run's model, layout and
        options, for the shapes of its first batch: it decides the sizes the config
        leaves to it (the KV pool, the prefix budget, the micro-batch) within
        trainer.device_memory or the device's own (the least of any rank's, so that
        every rank sizes alike), and gives each phase's peak. disagg is planned as
        if colocated, which over-counts each side."""
        cfg = self.cfg
        args = args_from_hf_config(read_hf_config(path), str(path))
        examples = next(self._batches(0))
        vision = sum(int((e.prompt.input_ids == t).sum()) for e in examples
                     for t in (args.image_token_id, args.video_token_id)) // len(examples)
        lengths = [len(e.prompt.input_ids) for e in examples]
        # Files bound their prompts by data.max_prompt_length; the built-in tasks' prompts are alike.
        longest = cfg.data.max_prompt_length if cfg.data.train_files else max(lengths)
        batch = BatchShape(cfg.data.batch_size, cfg.rollout.n, max(1, sum(lengths) // len(lengths) - vision),
                           cfg.rollout.max_tokens, vision, longest_prompt=longest)
        device_memory = int(cfg.trainer.device_memory) or self._device_memory()
        options = MemoryOptions.from_config(cfg, self.compute_dtype, device_memory,
                                            resolve_backend(cfg.model.attn_backend, self.device))
        engine_tp = cfg.rollout.tp if self.dims.world_size % cfg.rollout.tp == 0 else self.dims.tp
        layout = ParallelLayout(self.dims.dp_shard, self.dims.tp, engine_tp, 1, self.dims.world_size)
        return plan_memory(args, layout, batch, options)

    def _device_memory(self) -> int:
        """Bytes of memory of this rank's device (CUDA: its total; CPU: the available RAM), the least of any rank's."""
        if self.device.type == "cuda":
            own = torch.cuda.get_device_properties(self.device).total_memory
        else:
            own = free_memory(self.device)
        return int(all_reduce_values([own], dist.ReduceOp.MIN)[0]) if self.world > 1 else own

    def _memory_metrics(self, peaks: dict[str, int]) -> dict[str, float]:
        """Each phase's measured peak, its planned peak (colocated schedules) and the plan's error."""
        metrics = {f"perf/max_memory_allocated_gb/{phase}": b / GiB for phase, b in peaks.items()}
        if peaks:
            metrics["perf/max_memory_allocated_gb"] = max(peaks.values()) / GiB
        if self.disagg is not None:
            return metrics
        planned = loop_phase_bytes(self.memory)
        metrics.update({f"perf/planned_memory_gb/{phase}": b / GiB for phase, b in planned.items()})
        for phase in planned.keys() & peaks.keys():
            metrics[f"perf/memory_plan_error/{phase}"] = peaks[phase] / planned[phase] - 1
        return metrics

    @property
    def uses_prefix_work(self) -> bool:
        s = self.cfg.schedule
        return s.kind == "overlap" or (s.kind == "serial" and s.share_prefix)

    def chunks(self, n_groups: int) -> list[slice]:
        """The groups of each optimizer step of the batch (contiguous, as even as possible)."""
        k = self.cfg.algorithm.updates_per_batch
        return [slice(i * n_groups // k, (i + 1) * n_groups // k) for i in range(k)]

    def _chunked_logprobs(self, model, rollout: Rollout, kinds: tuple[PrefixKind, ...]) -> list[torch.Tensor]:
        """Logprobs of every response, chunk by chunk: suffix-only passes where a
        prefix item of one of `kinds` kept the chunk's prompts, full passes otherwise."""
        out = []
        for c, chunk in enumerate(self.chunks(len(rollout.groups))):
            kept = None
            if rollout.prefix is not None:
                kept = next((k for k in (rollout.prefix.result(kind, c) for kind in kinds) if k is not None), None)
            out += self.actor.logprobs(model, rollout.groups[chunk], kept)
        return out

    @contextmanager
    def _phase(self, timer: Timer, name: str):
        """Time a phase and mark it for its peak memory: on CUDA the allocator's
        peak, on CPU the profiler's range that CpuPhasePeaks reads."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with timer(name), record_function(PHASE_MARK + name):
            yield
        if cuda:
            self.phase_peaks[name] = torch.cuda.max_memory_allocated(self.device)

    def rollout(self, examples: list, step: int, prefix_work: bool = False) -> Rollout:
        """Sample n responses per prompt. With `prefix_work`, the vision tower
        runs once per prompt first (the engine's prefill reads it) and the step's
        prompt work is planned; the overlap schedule runs it between decode steps."""
        cfg = self.cfg
        prompts = [_prompt_inputs(e) for e in examples]
        r = cfg.rollout
        params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                                ignore_eos=r.ignore_eos)
        seeds = [mix_seed(cfg.trainer.seed, step, e.index) for e in examples]
        # With min_tokens, each prompt's own limit, drawn from its seed (the same on any rank and schedule).
        limits = [r.min_tokens + s % (r.max_tokens - r.min_tokens + 1) if r.min_tokens else None for s in seeds]
        self.model.eval()
        prefix = None
        with self.weights.for_rollout():
            vision = [self._encode(p) for p in prompts] if prefix_work else [None] * len(prompts)
            requests = [Request(e.prompt.input_ids.tolist(), e.prompt.pixel_values, e.prompt.image_grid_thw,
                                e.prompt.pixel_values_videos, e.prompt.video_grid_thw, e.prompt.second_per_grid_ts,
                                n=r.n, seed=seed, vision=v, max_tokens=limit)
                       for e, v, seed, limit in zip(examples, vision, seeds, limits)]
            if prefix_work:
                pool = self.engine.cache.pool_bytes(self.engine.blocks_for(requests, params))
                items = self._prefix_work(prompts, vision)
                prefix = PrefixScheduler(items, self._prefix_budget(items, pool), self.side_stream)
            overlap = prefix is not None and cfg.schedule.kind == "overlap"
            outputs = self._generate(requests, params, prefix.between_steps if overlap else None)
            if overlap:
                prefix.drain()  # what the decode window did not hide, while the weights are still gathered
        self.engine.release_kv()  # the KV pool lives only during rollout
        groups, texts, logprobs, reasons = [], [], [], []
        for prompt, out in zip(prompts, outputs):
            groups.append(GroupInputs(prompt, [s.token_ids for s in out.samples]))
            for s in out.samples:
                texts.append(self.tokenizer.decode(s.token_ids, skip_special_tokens=True))
                logprobs.append(torch.tensor(s.logprobs))
                reasons.append(s.finish_reason)
        return Rollout(examples, groups, texts, logprobs, reasons, prefix)

    def _disagg_rollout(self, examples: list, metrics: dict[str, float]) -> Rollout | None:
        """disagg: weights to the rollout ranks, their samples to every rank.
        Returns the trainers' share as a Rollout (None on a rollout rank) and
        fills `metrics` with the step's generation, transfer and idle times."""
        start = time.perf_counter()
        idle = self._send_weights()
        weights_s = time.perf_counter() - start
        report = []
        if self.generates:
            replica = self.disagg.replica(self.rank)
            start = time.perf_counter()
            rollout = self.rollout(balanced_share(examples, self.disagg.replicas, replica), self.step)
            gen = time.perf_counter() - start
            if self.disagg.leads_replica(self.rank):
                first = 0
                for e, g in zip(rollout.examples, rollout.groups):
                    n = len(g.responses)
                    report.append((e.index, g.responses, [lp.tolist() for lp in rollout.logprobs[first:first + n]],
                                   rollout.finish_reasons[first:first + n]))
                    first += n
                report.append(("times", gen, idle))
        start = time.perf_counter()
        reports = [None] * self.world
        dist.all_gather_object(reports, report)
        if self.generates:
            return None
        samples, gen_times, idle_times = {}, [], []
        for item in (x for r in reports for x in r):
            if item[0] == "times":
                gen_times.append(item[1])
                idle_times.append(item[2])
            else:
                samples[item[0]] = item[1:]
        metrics.update({"timing_s/gen": max(gen_times), "timing_s/update_weights": weights_s,
                        "timing_s/train_idle": time.perf_counter() - start,
                        "timing_s/rollout_idle": max(idle_times)})
        mine = balanced_share(examples, self.dims.dp_shard, self.dp_rank)
        groups, texts, logprobs, reasons = [], [], [], []
        for e in mine:
            responses, lps, finish = samples[e.index]
            groups.append(GroupInputs(_prompt_inputs(e), responses))
            texts += [self.tokenizer.decode(r, skip_special_tokens=True) for r in responses]
            logprobs += [torch.tensor(lp) for lp in lps]
            reasons += finish
        return Rollout(mine, groups, texts, logprobs, reasons)

    def _send_weights(self) -> float:
        """disagg: the trainers' current weights to the rollout ranks. Returns the
        seconds a rollout rank waited (for the trainers' previous phase and the transfer)."""
        if self.trains:
            self.weight_broadcast.send(self.model)
            return 0.0
        start = time.perf_counter()
        self.weight_broadcast.receive(self.model)
        return time.perf_counter() - start

    @torch.no_grad()
    def _encode(self, prompt: SequenceInputs) -> VisionEmbeds | None:
        if prompt.pixel_values is None and prompt.pixel_values_videos is None:
            return None
        return self.model.encode_vision(prompt.pixel_values, prompt.image_grid_thw, prompt.pixel_values_videos,
                                        prompt.video_grid_thw)

    def _prefix_work(self, prompts: list[SequenceInputs], vision: list[VisionEmbeds | None]) -> list[PrefixWork]:
        """The step's prompt work (rollplex.rl.memory.prefix_items: the memory plan
        counts the same items), each with the plan's estimate of the state it keeps."""
        tp, options = self.cfg.parallel.tp, self.memory.options
        chunks = self.chunks(len(prompts))
        items = []
        for spec in prefix_items(options):
            chunk = chunks[spec.chunk]
            if chunk.start == chunk.stop:
                continue
            ps = prompts[chunk]
            patches = sum(t.shape[0] for p in ps for t in (p.pixel_values, p.pixel_values_videos) if t is not None)
            estimate = prefix_state(self.model.args, spec, len(ps), sum(len(p.input_ids) for p in ps), patches,
                                    options, tp).total
            # Collectives in the forward: TP all-reduces, or the sharded reference model's FSDP gathers.
            alone = tp == 1 and not (spec.kind == PrefixKind.REF and self.dims.dp_shard > 1)
            model = self.ref_model if spec.kind == PrefixKind.REF else self.model
            items.append(PrefixWork(spec.kind, spec.chunk, model, ps,
                                    VisionEmbeds.concat(vision[chunk]) if spec.reuses_vision else None,
                                    spec.keep_graph, estimate, may_drop_alone=alone))
        return items

    def _prefix_budget(self, items: list[PrefixWork], pool_bytes: int) -> int:
        """The step's prefix budget: the memory plan's beside this rank's KV pool.
        Every dp rank must admit the same items, or their collectives (the reference
        model's FSDP gathers) would not line up: the items take the largest estimate
        of any rank, and the budget is the smallest."""
        budget = self.memory.sizes.prefix_budget_for(pool_bytes)
        if self.dims.dp_shard == 1:
            return budget
        *estimates, least_budget = self._max([w.estimate for w in items] + [-budget])  # one collective: min = -max(-x)
        for item, estimate in zip(items, estimates):
            item.estimate = int(estimate)
        return int(-least_budget)

    def update(self, rollout: Rollout, advantages: list[float], old: list[torch.Tensor],
               ref: list[torch.Tensor] | None) -> dict[str, float]:
        """`updates_per_batch` optimizer steps, each on a chunk of the groups; the
        first reads the actor's kept prompt forward when prefix work made one.
        Metrics are averaged over the steps, counts summed."""
        k = self.cfg.algorithm.updates_per_batch
        sums: dict[str, float] = {}
        first = 0
        for i, chunk in enumerate(self.chunks(len(rollout.groups))):
            count = sum(len(g.responses) for g in rollout.groups[chunk])
            sl = slice(first, first + count)
            first += count
            kept = rollout.prefix.result(PrefixKind.ACTOR, i) if rollout.prefix is not None else None
            metrics = self.actor.update(PolicyBatch(rollout.groups[chunk], advantages[sl], old[sl],
                                                    ref[sl] if ref else None, rollout.logprobs[sl], kept))
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + (value if key in COUNTED_ACTOR_METRICS else value / k)
        return sums

    # ------------------------------------------------------------------ evaluation, metrics, checkpoints

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy score on the validation prompts, split across dp ranks (disagg:
        across the rollout replicas)."""
        if not self.val_examples:
            return {}
        if self.disagg is not None:
            return self._disagg_evaluate()
        total, count = self._sum(list(self._greedy_score(self.val_examples[self.dp_rank::self.dims.dp_shard])))
        return {"val/score": total / max(count, 1)}

    def _greedy_score(self, examples: list) -> tuple[float, int]:
        """(sum of greedy scores, count) of `examples` on this rank's engine."""
        requests = [Request(e.prompt.input_ids.tolist(), e.prompt.pixel_values, e.prompt.image_grid_thw,
                            e.prompt.pixel_values_videos, e.prompt.video_grid_thw, e.prompt.second_per_grid_ts)
                    for e in examples]
        self.model.eval()
        with self.weights.for_rollout():
            outputs = self._generate(requests, SamplingParams(temperature=0.0, max_tokens=self.cfg.rollout.max_tokens))
        self.engine.release_kv()
        texts = [self.tokenizer.decode(o.samples[0].token_ids, skip_special_tokens=True) for o in outputs]
        scores = self.reward_scorer.score(texts, [e.answer for e in examples]).scores
        return sum(scores), len(scores)

    @torch.no_grad()
    def _disagg_evaluate(self) -> dict[str, float]:
        """The rollout replicas score their share on the updated weights; every rank gets the result."""
        self._send_weights()
        result = (0.0, 0)
        if self.generates:  # every rank of a replica runs its engine; its first rank reports
            score = self._greedy_score(self.val_examples[self.disagg.replica(self.rank)::self.disagg.replicas])
            result = score if self.disagg.leads_replica(self.rank) else result
        results = [None] * self.world
        dist.all_gather_object(results, result)
        return {"val/score": sum(r[0] for r in results) / max(sum(r[1] for r in results), 1)}

    def _gather_metrics(self, rollout: Rollout, rewards: RewardScores,
                        actor: dict[str, float]) -> dict[str, float]:
        lengths = [len(r) for g in rollout.groups for r in g.responses]
        clipped = sum(reason == "length" for reason in rollout.finish_reasons)
        scores = rewards.scores
        total, count, length_sum, clip_sum, error_sum, timeout_sum = self._sum(
            [sum(scores), len(scores), sum(lengths), clipped, rewards.errors, rewards.timeouts])
        hi, lo = self._max([max(scores), -min(scores)])
        metrics = {"critic/score/mean": total / count, "critic/score/max": hi, "critic/score/min": -lo,
                   "response_length/mean": length_sum / count, "response_length/clip_ratio": clip_sum / count,
                   "reward/errors": error_sum, "reward/timeouts": timeout_sum, "data/skipped": self._skipped()}
        # See Actor.update: most actor metrics are per-rank shares of a global sum.
        shares = sorted(k for k in actor if k not in GLOBAL_ACTOR_METRICS and not k.endswith("_max"))
        metrics.update(zip(shares, self._sum([actor[k] for k in shares])))
        maxima = sorted(k for k in actor if k.endswith("_max"))
        metrics.update(zip(maxima, self._max([actor[k] for k in maxima])))
        metrics.update({k: actor[k] for k in GLOBAL_ACTOR_METRICS})
        return metrics

    def _sum(self, values: list[float]) -> list[float]:
        return all_reduce_values(values, dist.ReduceOp.SUM, self.dp_group)

    def _max(self, values: list[float]) -> list[float]:
        return all_reduce_values(values, dist.ReduceOp.MAX, self.dp_group)

    def _save(self) -> None:
        if self.trains:
            save_checkpoint(self.out / "checkpoints", self.step, self.model, self.actor.optimizer,
                            self.actor.scheduler, extra={"step": self.step}, keep_last=self.cfg.trainer.keep_last,
                            group=self.train_group)

    def _resume(self) -> None:
        if not self.cfg.trainer.resume:
            return
        path = latest_checkpoint(self.out / "checkpoints")
        if path is not None and self.trains:
            state = load_checkpoint(path, self.model, self.actor.optimizer, self.actor.scheduler,
                                    group=self.train_group)
            self.step = state.step
            if self.rank == 0:
                print(f"resumed from {path} at step {self.step}")
        if self.disagg is not None:  # the rollout ranks follow trainer rank 0's step
            step = [self.step]
            dist.broadcast_object_list(step, src=0)
            self.step = step[0]


def _prompt_inputs(example) -> SequenceInputs:
    p = example.prompt
    return SequenceInputs(p.input_ids, None, p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw,
                          p.second_per_grid_ts)


def balanced_share(examples: list, ranks: int, rank: int) -> list:
    """This rank's prompts: as many per rank as possible, prompt tokens balanced
    (longest first, each to the rank with the fewest tokens and room left), kept
    in batch order. Every rank computes the same assignment."""
    cap = -(-len(examples) // ranks)
    load, count, owner = [0] * ranks, [0] * ranks, {}
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i].prompt.input_ids)):
        r = min((r for r in range(ranks) if count[r] < cap), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += len(examples[i].prompt.input_ids)
        count[r] += 1
    return [e for i, e in enumerate(examples) if owner[i] == rank]
