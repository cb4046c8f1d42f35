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

Every dp rank rolls out and trains on its own share of the prompts
(rollplex.rl.rollout); all n samples of a prompt stay on one rank, so
advantages need no communication. The step's metrics are rollplex.rl.step_metrics,
the set-up before the weights load (checkpoint, prompts, memory plan)
rollplex.rl.setup.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from rollplex.config import Config, save_config
from rollplex.data.processing import load_processor
from rollplex.data.reward_scoring import RewardScorer
from rollplex.dist import ParallelDims, all_reduce_values, build_mesh, init_distributed
from rollplex.metrics import GpuSampler, MetricsLogger, Timer
from rollplex.models import Prompt, from_pretrained
from rollplex.models.qwen2_5_vl import VisionEmbeds
from rollplex.rl.disagg import DisaggExchange, DisaggLayout, WeightBroadcast
from rollplex.rl.memory import GiB, PrefixKind
from rollplex.rl.prefix import PrefixPlanner, PrefixWork, update_chunks
from rollplex.rl.rollout import Rollout, RolloutSampler, balanced_share, build_engine
from rollplex.rl.setup import PromptSource, model_path, plan_run_memory, resume_point
from rollplex.rl.step_metrics import (PhaseMeter, combine_updates, gather_metrics, memory_metrics, prefix_metrics,
                                      speed_metrics)
from rollplex.rl.weights import SharedWeights
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, lr_schedule
from rollplex.train.checkpoint import load_checkpoint, save_checkpoint
from rollplex.train.loss import group_advantages
from rollplex.train.parallelize import apply_tp, parallelize

def _kill_if_asked(step: int, rank: int) -> None:
    """Fault injection for the restart tests: ROLLPLEX_KILL_AT_STEP="STEP:RANK" makes
    that rank SIGKILL itself as it starts that step (its peers are then inside the
    step's collectives), in torchrun's first attempt only, so the restarted group
    runs through."""
    target = os.environ.get("ROLLPLEX_KILL_AT_STEP")
    if target and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and target == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


class RLTrainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.out = Path(cfg.trainer.output_dir)
        self.start = resume_point(cfg, self.out, self.rank, self.world)
        self.step = self.start.step
        if self.complete:
            return  # nothing to build: fit() says the run is done
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
        path = model_path(cfg, self.out, self.rank, self.world, self.start)
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        self.processor = load_processor(path)
        self.tokenizer = self.processor.tokenizer
        self.data = PromptSource(cfg.data, self.processor)
        # Before any weights load: a run whose shapes cannot fit fails here, naming what does not fit.
        self.memory = plan_run_memory(cfg, path, next(self._batches(0)), self.dims, self.device, self.compute_dtype)
        # On CPU, trainer.device_memory stands for a GPU's: each phase's peak live tensor bytes are measured too.
        self.phases = PhaseMeter(self.device, measure_cpu=self.device.type == "cpu" and bool(cfg.trainer.device_memory))
        self._load_models(path)
        self._parallelize()
        self._build_rollout()
        self.actor = None
        if self.trains:
            t = cfg.trainer
            self.actor = Actor(self.model, ActorConfig.from_config(cfg, self.memory.sizes.micro_batch_tokens),
                               self.dp_group, lr_lambda=lr_schedule(t.lr_schedule, t.warmup_steps,
                                                                    t.total_steps * cfg.algorithm.updates_per_batch))
        self.reward_scorer = RewardScorer(cfg.data.reward, cfg.data.reward_workers, cfg.data.reward_timeout_s)
        self.logger = MetricsLogger(self.out, rank=self.rank, console=cfg.logging.console, jsonl=cfg.logging.jsonl,
                                    tensorboard=cfg.logging.tensorboard, total_steps=cfg.trainer.total_steps)
        self.gpu_sampler = GpuSampler(device=self.device.index if self.device.type == "cuda" else None)

    def _load_models(self, path: Path) -> None:
        """A trainer holds fp32 master weights and computes in model.dtype (FSDP gathers them in it, one process
        too). The frozen reference model, and a disagg rollout rank's engine copy, hold model.dtype only."""
        cfg = self.cfg
        self.model = from_pretrained(path, dtype=torch.float32 if self.trains else self.compute_dtype,
                                     device=self.device, attn_backend=cfg.model.attn_backend)
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0 and self.trains:
            self.ref_model = from_pretrained(path, dtype=self.compute_dtype, device=self.device,
                                             attn_backend=cfg.model.attn_backend).requires_grad_(False)

    def _build_rollout(self) -> None:
        """The engine on the rollout layout of the weights (rollout ranks), and the prompt work's planner."""
        cfg = self.cfg
        self.engine, self.sampler = None, None
        if self.generates:
            self.engine = build_engine(self.weights, cfg.rollout, self.memory.kv_pool_blocks, self.engine_ranks)
            tp_group = self.weights.engine_tp_group if cfg.rollout.tp > cfg.parallel.tp else None
            self.sampler = RolloutSampler(self.engine, self.weights, self.model, self.tokenizer, cfg.rollout,
                                          cfg.trainer.seed, tp_group)
        # The prefix slices' side stream, one for the trainer's lifetime (see rollplex.rl.prefix), at priority 0,
        # CUDA's lowest: the engine's decode stream goes first.
        self.side_stream = torch.cuda.Stream(self.device, priority=0) if self.device.type == "cuda" else None
        self.prefix_planner = PrefixPlanner(self.memory, self.model, self.ref_model, cfg.parallel.tp,
                                            self.dims.dp_shard, self.dp_group, self.side_stream)

    def _parallelize(self) -> None:
        """Trainers: FSDP2 (+ TP) over their mesh, a single trainer too (a mesh of
        one: the same mixed precision as many), the reference model alike.
        disagg rollout ranks: only the engine's TP over their replica."""
        cfg = self.cfg
        self.dp_rank, self.dp_group, self.train_group, self.engine_ranks, self.exchange = 0, None, None, None, None
        if self.disagg is None:
            mesh = build_mesh(self.dims, self.device.type)
        else:
            mesh, rollout_mesh = self.disagg.meshes(self.dims.dp_shard, self.dims.tp, self.device.type)
            broadcast = WeightBroadcast(self.disagg, self.rank, self.compute_dtype)
            self.train_group = dist.new_group(list(range(self.disagg.train_ranks)))  # checkpoints: trainers only
            self.engine_ranks = dist.new_group(list(range(self.disagg.train_ranks, self.world)))
        if self.disagg is not None and self.generates:  # the engine's own copy, refilled by the broadcast
            if cfg.rollout.tp > 1:
                apply_tp(self.model, rollout_mesh["tp"])
            self.weights = SharedWeights(self.model, cfg.rollout.tp, cfg.rollout.tp)
        else:
            self.dp_rank, self.dp_group = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].get_group()
            parallelize(self.model, mesh, cfg.parallel.activation_checkpointing, cfg.parallel.freeze_vision,
                        self.compute_dtype)
            if self.ref_model is not None:
                parallelize(self.ref_model, mesh, compute_dtype=self.compute_dtype)
            if self.disagg is None:
                self.weights = SharedWeights(self.model, cfg.parallel.tp, cfg.rollout.tp)
        if self.disagg is not None:
            self.exchange = DisaggExchange(self.disagg, self.rank, broadcast, self.model, self.tokenizer,
                                           self.dims.dp_shard, self.dp_rank)

    def _batches(self, start_step: int) -> Iterator[list]:
        return self.data.batches(start_step)

    # ------------------------------------------------------------------ the loop

    @property
    def complete(self) -> bool:
        """The run in output_dir has reached trainer.total_steps already."""
        return self.start.checkpoint is not None and self.start.step >= self.cfg.trainer.total_steps

    def fit(self) -> None:
        cfg = self.cfg
        if self.complete:
            if self.rank == 0:
                print(f"run already complete at step {self.step} in {self.out}: raise trainer.total_steps to "
                      f"train further, or set a new trainer.output_dir for another run")
            return
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
                metrics["perf/live_memory_gb"] = self.phases.live_bytes() / GiB
            if self.step % cfg.logging.log_every == 0 or last or "val/score" in metrics:
                self.logger.log(self.step, metrics)
            if saving:
                self._save()
        self.logger.close()
        self.reward_scorer.close()

    def train_step(self, examples: list) -> dict[str, float]:
        # GPU utilisation and memory over the step (no-op without an NVIDIA GPU), and each phase's peak memory
        with self.gpu_sampler, self.phases.step() as peaks:
            metrics = self._train_step(examples)
        metrics.update(self.gpu_sampler.as_metrics())
        metrics.update(memory_metrics(peaks, self.memory if self.disagg is None else None))
        return metrics

    def _train_step(self, examples: list) -> dict[str, float]:
        cfg, timer, phase = self.cfg, Timer(), self.phases.phase
        start = time.perf_counter()
        rollout, rollout_metrics = self._rollout_phase(examples, timer)
        if rollout is None:
            return {}  # a disagg rollout rank: the trainers report the step
        prefix = rollout.prefix
        if prefix is not None and cfg.schedule.kind == "serial":
            with phase(timer, "prefix"), self.weights.for_rollout():
                prefix.drain()
        with phase(timer, "reward"):
            rewards = self.reward_scorer.score(rollout.texts,
                                               [e.answer for e in rollout.examples for _ in range(cfg.rollout.n)])
        group_index = torch.arange(len(rollout.examples)).repeat_interleave(cfg.rollout.n)
        advantages = group_advantages(torch.tensor(rewards.scores), group_index,
                                      norm_by_std=cfg.algorithm.adv_estimator == "grpo"
                                      and cfg.algorithm.norm_adv_by_std)
        old = rollout.logprobs
        if cfg.algorithm.recompute_old_logprobs:
            with phase(timer, "old_log_prob"):
                old = self._chunked_logprobs(self.model, rollout, (PrefixKind.ACTOR, PrefixKind.OLD))
        ref = None
        if self.ref_model is not None:
            with phase(timer, "ref"):
                ref = self._chunked_logprobs(self.ref_model, rollout, (PrefixKind.REF,))
                # FSDP2 keeps a root unit gathered from its forward to its backward, which a frozen model never
                # runs: without this its embedding and head would stay gathered for the rest of the run.
                self.ref_model.reshard()
        with phase(timer, "update_actor"):
            actor_metrics = self.update(rollout, advantages.tolist(), old, ref)
        metrics = gather_metrics(rollout, rewards, actor_metrics, self.data.skipped, self.dp_group)
        metrics.update(timer.as_metrics())
        metrics.update(rollout_metrics)
        if self.disagg is None:
            metrics.update(self.weights.report.as_metrics())
        if prefix is not None:
            metrics.update(prefix_metrics(prefix))
        metrics.update(speed_metrics(rollout, time.perf_counter() - start, metrics["perf/actor_flops"],
                                     metrics["timing_s/update_actor"], self.world, self.device, self.dp_group))
        return metrics

    def _rollout_phase(self, examples: list, timer: Timer) -> tuple[Rollout | None, dict[str, float]]:
        """This rank's share of the step's samples (None on a disagg rollout rank) and the rollout's metrics."""
        if self.exchange is not None:
            return self.exchange.rollout(examples, self.step, self.rollout)
        mine = balanced_share(examples, self.dims.dp_shard, self.dp_rank)
        with self.phases.phase(timer, "gen"):
            rollout = self.rollout(mine, self.step, prefix_work=self.uses_prefix_work)
        # Decode graphs are recaptured whenever the rollout's KV pool lands at another address or size.
        return rollout, {"perf/cuda_graph_captures": self.engine.stats["graph_captures"],
                         "timing_s/cuda_graph_capture": self.engine.stats["graph_capture_s"]}

    @property
    def uses_prefix_work(self) -> bool:
        s = self.cfg.schedule
        return s.kind == "overlap" or (s.kind == "serial" and s.share_prefix)

    def rollout(self, examples: list, step: int, prefix_work: bool = False) -> Rollout:
        """Sample n responses per prompt. With `prefix_work`, the vision tower
        runs once per prompt first (the engine's prefill reads it) and the step's
        prompt work is planned; the overlap schedule runs it between decode steps."""
        prompts = [e.prompt for e in examples]
        prefix = None
        with self.sampler.session():
            vision = [self._encode(p) for p in prompts] if prefix_work else [None] * len(prompts)
            requests = self.sampler.requests(examples, step, vision)
            if prefix_work:
                prefix = self.prefix_planner.scheduler(self._prefix_work(prompts, vision),
                                                       self.sampler.pool_bytes(requests))
            overlap = prefix is not None and self.cfg.schedule.kind == "overlap"
            outputs = self.sampler.generate(requests, between_steps=prefix.between_steps if overlap else None)
            if overlap:
                prefix.drain()  # what the decode window did not hide, while the weights are still gathered
        return Rollout.of(examples, outputs, self.tokenizer, prefix)

    @torch.no_grad()
    def _encode(self, prompt: Prompt) -> VisionEmbeds | None:
        if not prompt.has_vision:
            return None
        return self.model.encode_vision(prompt.pixel_values, prompt.image_grid_thw, prompt.pixel_values_videos,
                                        prompt.video_grid_thw)

    def _prefix_work(self, prompts: list[Prompt], vision: list[VisionEmbeds | None]) -> list[PrefixWork]:
        """The step's prompt work (the items the memory plan counts), with the plan's estimates."""
        return self.prefix_planner.work(prompts, vision)

    def _chunked_logprobs(self, model, rollout: Rollout, kinds: tuple[PrefixKind, ...]) -> list[torch.Tensor]:
        """Logprobs of every response, chunk by chunk: suffix-only passes where a
        prefix item of one of `kinds` kept the chunk's prompts, full passes otherwise."""
        out = []
        for c, chunk in enumerate(update_chunks(len(rollout.groups), self.cfg.algorithm.updates_per_batch)):
            kept = None
            if rollout.prefix is not None:
                kept = next((k for k in (rollout.prefix.result(kind, c) for kind in kinds) if k is not None), None)
            out += self.actor.logprobs(model, rollout.groups[chunk], kept)
        return out

    def update(self, rollout: Rollout, advantages: list[float], old: list[torch.Tensor],
               ref: list[torch.Tensor] | None) -> dict[str, float]:
        """`updates_per_batch` optimizer steps, each on a chunk of the groups; the
        first reads the actor's kept prompt forward when prefix work made one."""
        updates = []
        for i, chunk in enumerate(update_chunks(len(rollout.groups), self.cfg.algorithm.updates_per_batch)):
            at = rollout.responses_of(chunk)
            kept = rollout.prefix.result(PrefixKind.ACTOR, i) if rollout.prefix is not None else None
            updates.append(self.actor.update(PolicyBatch(rollout.groups[chunk], advantages[at], old[at],
                                                         ref[at] if ref else None, rollout.logprobs[at], kept)))
        return combine_updates(updates)

    # ------------------------------------------------------------------ evaluation, checkpoints

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy score on the validation prompts, split across dp ranks (disagg:
        across the rollout replicas)."""
        if not self.data.val_examples:
            return {}
        if self.exchange is not None:
            return self.exchange.evaluate(self.data.val_examples, self._greedy_score)
        total, count = all_reduce_values(self._greedy_score(self.data.val_examples[self.dp_rank::self.dims.dp_shard]),
                                         group=self.dp_group)
        return {"val/score": total / max(count, 1)}

    def _greedy_score(self, examples: list) -> tuple[float, int]:
        """(sum of greedy scores, count) of `examples` on this rank's engine."""
        scores = self.reward_scorer.score(self.sampler.greedy_texts(examples), [e.answer for e in examples]).scores
        return sum(scores), len(scores)

    def _save(self) -> None:
        if self.trains:
            save_checkpoint(self.out / "checkpoints", self.step, self.model, self.actor.optimizer,
                            self.actor.scheduler, extra={"step": self.step}, keep_last=self.cfg.trainer.keep_last,
                            group=self.train_group)

    def _resume(self) -> None:
        """Load the checkpoint `resume_point` chose (every rank knows its step: a disagg rollout rank too)."""
        path = self.start.checkpoint
        if path is not None and self.trains:
            load_checkpoint(path, self.model, self.actor.optimizer, self.actor.scheduler, group=self.train_group)
        if path is not None and self.rank == 0:
            print(f"resumed from {path} at step {self.step}")
