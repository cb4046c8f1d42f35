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
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rollplex.config import Config, config_to_dict, save_config
from rollplex.data.prefetch import Prefetcher
from rollplex.data.reward_scoring import RewardScorer, RewardScores
from rollplex.dist import ParallelDims, all_gather_objects, build_mesh, init_distributed
from rollplex.metrics import CONFIG_FILE, GpuMonitor, MetricsLogger, Timer, start_run_files
from rollplex.models import Prompt, VisionEmbeds, from_pretrained
from rollplex.rl.disagg import DisaggExchange, DisaggLayout, WeightBroadcast
from rollplex.rl.memory import GiB, PrefixKind
from rollplex.rl.prefix import PrefixPlanner, PrefixScheduler, PrefixWork, update_chunks
from rollplex.rl.reports import startup_summary, training_records, validation_records
from rollplex.rl.rollout import Rollout, RolloutRunner, balanced_share, build_engine
from rollplex.rl.stream import GroupStream, StreamPlan, StreamReport, norm_by_std, score_groups
from rollplex.rl.setup import PromptSource, load_run_processor, model_path, plan_run_memory, resume_point
from rollplex.rl.step_metrics import (PhaseMeter, combine_updates, gather_metrics, memory_metrics, prefix_metrics,
                                      speed_metrics, stop_if_every_reward_failed, summed_over_ranks)
from rollplex.rl.weights import SharedWeights
from rollplex.run_lock import RunLock, claim_run_folder
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch
from rollplex.train.checkpoint import export_hf, load_checkpoint, remove_unfinished_saves, save_checkpoint
from rollplex.train.loss import group_advantages
from rollplex.train.optim import lr_schedule
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
        self.run_lock: RunLock | None = None  # rank 0's, on trainer.output_dir (rollplex.run_lock)
        try:
            self._set_up(cfg)
        except BaseException:
            self._release_run_folder()  # a run that fails to start leaves its folder free for the next try
            raise

    def _set_up(self, cfg: Config) -> None:
        """The trainer's start-up: the run folder claimed, the resume point found, then the weights and engine."""
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.out = Path(cfg.trainer.output_dir)
        # Before anything reads or writes the folder: a second run started there stops here, naming the first.
        self.run_lock = claim_run_folder(self.out, self.rank, self.world)
        if self.run_lock is not None:  # rank 0, holding the folder: no live run is left to finish these saves
            for stale in remove_unfinished_saves(self.out / "checkpoints"):
                print(f"rollplex: removed {stale}, an earlier run's unfinished checkpoint save", flush=True)
        self.start = resume_point(cfg, self.out, self.rank, self.world)
        self.step = self.start.step
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
        self.model_dir = path  # the folder the run starts from (trainer.save_hf copies its tokenizer files)
        self.compute_dtype = getattr(torch, cfg.model.dtype)
        self.processor = load_run_processor(path, cfg.data)
        self.tokenizer = self.processor.tokenizer
        self.data = PromptSource(cfg.data, self.processor)
        self.skipped_rows = 0.0  # training rows skipped as of the batch being trained on (data/skipped_total)
        self.total_steps = self.data.run_steps(cfg.trainer)
        if self.complete:
            return  # no weights to load: fit() says the run is done
        resumed_step = self.start.step if self.start.checkpoint is not None else None
        if self.rank == 0:  # before the logger opens them: the metrics and samples files hold this run's steps
            if changed := start_run_files(self.out, resumed_step):
                print(f"rollplex: {changed}", flush=True)
        log = cfg.logging  # before any weights load: a tracker that is not installed stops the run here
        self.logger = MetricsLogger(self.out, rank=self.rank, console=log.console, jsonl=log.jsonl,
                                    tensorboard=log.tensorboard, total_steps=self.total_steps, wandb=log.wandb,
                                    swanlab=log.swanlab, project=log.project, run_name=log.run_name,
                                    run_config=config_to_dict(cfg), resumed_step=resumed_step)
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
                                                                    self.total_steps * cfg.algorithm.updates_per_batch))
        d = cfg.data
        self.reward_scorer = RewardScorer(d.reward, d.reward_workers, d.reward_timeout_s, d.reward_kind,
                                          d.reward_score_key, d.reward_keyword_arguments())
        self.gpu_monitor = GpuMonitor(device=self.device.index if self.device.type == "cuda" else None)

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
        self.engine, self.rollout_runner = None, None
        if self.generates:
            self.engine = build_engine(self.weights, cfg.rollout, self.memory.kv_pool_blocks,
                                       self.memory.batch.longest_sequence, self.engine_ranks)
            tp_group = self.weights.engine_tp_group if cfg.rollout.tp > cfg.parallel.tp else None
            self.rollout_runner = RolloutRunner(self.engine, self.weights, self.model, self.tokenizer, cfg.rollout,
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
        """The run in output_dir has reached its length (trainer.total_steps or total_epochs) already."""
        return self.start.checkpoint is not None and self.start.step >= self.total_steps

    def fit(self) -> None:
        """Train from the resume point to the run's length, then give the output folder up, however it ends."""
        try:
            self._fit()
        finally:
            self._release_run_folder()

    def _release_run_folder(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()

    def _fit(self) -> None:
        cfg = self.cfg
        if self.complete:
            if self.rank == 0:
                print(f"run already complete at step {self.step} in {self.out}: raise trainer.total_steps (or "
                      f"total_epochs) to train further, or set a new trainer.output_dir for another run")
            return
        parameters = sum(p.numel() for p in self.model.parameters())  # DTensors count their whole tensor
        self.logger.message(startup_summary(cfg, self.model_dir, parameters, self.data, self.total_steps, self.dims,
                                            self.world, self.start))
        self._resume()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out / CONFIG_FILE)
        if cfg.trainer.val_before_train and self.step == 0 and (before := self.evaluate()):
            self.logger.log(0, before)  # the starting point of the val/score curve
        try:
            self._train_steps()
            if cfg.trainer.save_hf:
                self._save_hf()
        finally:  # a run that stops on an error still flushes its trackers and stops its reward workers
            self.logger.close()
            self.reward_scorer.close()

    def _train_steps(self) -> None:
        batches = self._batches(self.step)
        # The next batch is prepared in the background while this step runs; the rows skipped so far go with it.
        with Prefetcher(lambda: (next(batches), self.data.skipped)) as upcoming:
            while self.step < self.total_steps:
                examples, self.skipped_rows = upcoming.next(ahead=self.step + 1 < self.total_steps)
                self.step += 1
                _kill_if_asked(self.step, self.rank)
                metrics = self.train_step(examples, data_s=upcoming.wait_s)
                self._after_step(metrics)

    def _after_step(self, metrics: dict[str, float]) -> None:
        """Evaluate, log and save as the step's number asks."""
        cfg, last = self.cfg, self.step == self.total_steps
        if cfg.trainer.eval_every and (self.step % cfg.trainer.eval_every == 0 or last):
            metrics.update(self.evaluate())
        saving = cfg.trainer.save_every and (self.step % cfg.trainer.save_every == 0 or last)
        if saving or self.device.type == "cuda":
            metrics["perf/live_memory_gb"] = self.phases.live_bytes() / GiB
        if self.step % cfg.logging.log_every == 0 or last or "val/score" in metrics:
            self.logger.log(self.step, metrics)
        if saving:
            self._save()

    def train_step(self, examples: list, data_s: float = 0.0) -> dict[str, float]:
        """One step on the global batch `examples`; `data_s`: how long the step waited for them (timing_s/data,
        counted in timing_s/step)."""
        # GPU utilisation and memory over the step (no-op without an NVIDIA GPU), and each phase's peak memory
        with self.gpu_monitor, self.phases.step() as peaks:
            metrics = self._train_step(examples, data_s)
        metrics.update(self.gpu_monitor.as_metrics())
        metrics.update(memory_metrics(peaks, self.memory if self.disagg is None else None))
        return metrics

    def _train_step(self, examples: list, data_s: float) -> dict[str, float]:
        cfg, timer, phase = self.cfg, Timer(), self.phases.phase
        start = time.perf_counter() - data_s
        rollout, rollout_metrics = self._rollout_phase(examples, timer)
        if rollout is None:
            return {}  # a disagg rollout rank: the trainers report the step
        prefix = rollout.prefix
        if prefix is not None and cfg.schedule.kind == "serial":
            with phase(timer, "prefix"), self.weights.for_rollout():
                prefix.drain()
        stream = rollout.stream
        with phase(timer, "reward"):
            rewards = self._rewards(rollout)
            stop_if_every_reward_failed(rewards, cfg.data.reward, self.dp_group)
        group_index = torch.arange(len(rollout.examples)).repeat_interleave(cfg.rollout.n)
        advantages = group_advantages(torch.tensor(rewards.scores), group_index,
                                      norm_by_std=norm_by_std(cfg))
        if cfg.trainer.log_samples_every and self.step % cfg.trainer.log_samples_every == 0:
            self.logger.log_samples(self.step, training_records(rollout, rewards, advantages.tolist(),
                                                                cfg.trainer.log_samples))
        old = rollout.logprobs
        if cfg.algorithm.recompute_old_logprobs:
            with phase(timer, "old_log_prob"):
                old = self._chunked_logprobs(self.model, rollout, (PrefixKind.ACTOR, PrefixKind.OLD),
                                             stream.old if stream else {})
        ref = None
        if self.ref_model is not None:
            with phase(timer, "ref"):
                ref = self._chunked_logprobs(self.ref_model, rollout, (PrefixKind.REF,), stream.ref if stream else {})
                # FSDP2 keeps a root unit gathered from its forward to its backward, which a frozen model never
                # runs: without this its embedding and head would stay gathered for the rest of the run.
                self.ref_model.reshard()
        with phase(timer, "update_actor"):
            actor_metrics, first_update_s = self.update(rollout, advantages.tolist(), old, ref)
        metrics = gather_metrics(rollout, rewards, actor_metrics, self.skipped_rows, self.dp_group)
        metrics["timing_s/data"] = data_s
        metrics.update(timer.as_metrics())
        metrics.update(rollout_metrics)
        if self.disagg is None:
            metrics.update(self.weights.report.as_metrics())
        if prefix is not None:
            metrics.update(prefix_metrics(prefix))
            # The finished groups' work left after decode: what streaming them (schedule.stream_groups) could hide.
            report = stream.report if stream else StreamReport()
            metrics["timing_s/decode_slowdown"] += report.decode_delay  # the decode window's host time: both parts
            report.exposed = sum(metrics.get(f"timing_s/{p}", 0.0) for p in ("reward", "old_log_prob", "ref")) + \
                first_update_s
            metrics.update(summed_over_ranks(report.as_metrics(), "stream/", self.dp_group))
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
        # Decode graphs captured in this rollout: each bucket's at its first use in the run, and again where the
        # engine's weights (the trainer's, gathered) landed elsewhere since.
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
        with self.rollout_runner.session():
            vision = [self._encode(p) for p in prompts] if prefix_work else [None] * len(prompts)
            requests = self.rollout_runner.requests(examples, step, vision)
            if prefix_work:
                prefix = self.prefix_planner.scheduler(self._prefix_work(prompts, vision),
                                                       self.engine.cache.pool_bytes())
            overlap = prefix is not None and self.cfg.schedule.kind == "overlap"
            stream = self._group_stream(examples, prefix) if overlap and self.cfg.schedule.stream_groups else None
            window = self._decode_window(prefix, stream) if overlap else None
            outputs = self.rollout_runner.generate(requests, between_steps=window,
                                                   on_finished=stream.on_finished if stream else None)
            if overlap:
                prefix.drain()  # what the decode window did not hide, while the weights are still gathered
            if stream is not None:
                stream.join()
        return Rollout.of(examples, outputs, self.tokenizer, prefix, stream)

    def _group_stream(self, examples: list, prefix: PrefixScheduler) -> GroupStream:
        """The step's finished-group work in the decode window (rollplex.rl.stream)."""
        plan = StreamPlan.of(self.cfg, self.dims.dp_shard, prefix, self.memory.streamed_update_bytes(),
                             self.memory.gathered_ref_bytes())
        return GroupStream(self.cfg, examples, self.tokenizer, self.reward_scorer, self.actor, self.ref_model, prefix,
                           plan)

    @staticmethod
    def _decode_window(prefix: PrefixScheduler, stream: GroupStream | None) -> Callable[[int], None]:
        """What runs between decode steps: the prompt work's slices, then the finished groups' passes."""
        def between_steps(running: int) -> None:
            prefix.between_steps(running)
            if stream is not None:
                stream.between_steps(running)
        return between_steps

    @torch.no_grad()
    def _encode(self, prompt: Prompt) -> VisionEmbeds | None:
        if not prompt.has_vision:
            return None
        return self.model.encode_vision(prompt.pixel_values, prompt.image_grid_thw, prompt.pixel_values_videos,
                                        prompt.video_grid_thw)

    def _prefix_work(self, prompts: list[Prompt], vision: list[VisionEmbeds | None]) -> list[PrefixWork]:
        """The step's prompt work (the items the memory plan counts), with the plan's estimates."""
        return self.prefix_planner.work(prompts, vision)

    def _rewards(self, rollout: Rollout) -> RewardScores:
        """Every sample's reward, in group order: the decode window's for the groups it scored, the
        others' now (in one call when there was no window's)."""
        done, groups = rollout.stream.scores if rollout.stream else {}, range(len(rollout.groups))

        def score(gs) -> RewardScores:
            texts = [t for g in gs for t in rollout.texts[rollout.responses_of(slice(g, g + 1))]]
            return score_groups(self.reward_scorer, [rollout.examples[g] for g in gs], [rollout.groups[g] for g in gs],
                                texts, warn=False)

        rewards = RewardScores.concat([done.get(g) or score([g]) for g in groups]) if done else score(groups)
        self.reward_scorer.warn_failures(rewards)
        return rewards

    def _chunked_logprobs(self, model, rollout: Rollout, kinds: tuple[PrefixKind, ...],
                          done: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        """Logprobs of every response, chunk by chunk: those of the groups in `done` (the decode
        window's), the others' by suffix-only passes where a prefix item of one of `kinds` kept
        the chunk's prompts, by full passes otherwise."""
        out = []
        for c, chunk in enumerate(update_chunks(len(rollout.groups), self.cfg.algorithm.updates_per_batch)):
            kept = None
            if rollout.prefix is not None:
                kept = next((k for k in (rollout.prefix.result(kind, c) for kind in kinds) if k is not None), None)
            indices = range(chunk.start, chunk.stop)
            computed = self.actor.logprobs(model, rollout.groups[chunk], kept,
                                           skip=frozenset(p for p, g in enumerate(indices) if g in done))
            streamed = iter([lp for g in indices if g in done for lp in done[g]])  # the skipped ones', in order
            out += [lp if lp is not None else next(streamed) for lp in computed]
        return out

    def update(self, rollout: Rollout, advantages: list[float], old: list[torch.Tensor],
               ref: list[torch.Tensor] | None) -> tuple[dict[str, float], float]:
        """`updates_per_batch` optimizer steps, each on a chunk of the groups; the
        first reads the actor's kept prompt forward when prefix work made one (and
        goes on from its passes in the decode window, when finished groups streamed),
        and alone measures the engine/trainer mismatch: it runs on the rollout's
        weights. Returns the metrics and the first step's seconds."""
        updates, first_s = [], 0.0
        started = rollout.stream.update if rollout.stream else None
        for i, chunk in enumerate(update_chunks(len(rollout.groups), self.cfg.algorithm.updates_per_batch)):
            start = time.perf_counter()
            at = rollout.responses_of(chunk)
            kept = rollout.prefix.result(PrefixKind.ACTOR, i) if rollout.prefix is not None else None
            updates.append(self.actor.update(PolicyBatch(rollout.groups[chunk], advantages[at], old[at],
                                                         ref[at] if ref else None, rollout.logprobs[at], kept,
                                                         rollout_weights=i == 0), started if i == 0 else None))
            first_s = first_s or time.perf_counter() - start
        return combine_updates(updates), first_s

    # ------------------------------------------------------------------ evaluation, checkpoints

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy score on the validation prompts, split across dp ranks (disagg:
        across the rollout replicas); every generation goes to the step's samples file."""
        examples = self.data.val_examples
        if not examples:
            return {}
        start = time.perf_counter()
        if self.exchange is not None:
            records = self.exchange.evaluate(examples, self._greedy_records)
        else:
            mine = self._greedy_records(examples[self.dp_rank::self.dims.dp_shard])
            records = [r for rank_records in all_gather_objects(mine, self.dp_group) for r in rank_records]
        records.sort(key=lambda r: r["index"])  # the same order, and so the same sum, on any layout
        score = sum(r["score"] for r in records) / len(records)
        path = self.logger.log_samples(self.step, records)
        self.logger.message(f"step {self.step}: val/score {score:.4g} over {len(records)} prompts "
                            f"({time.perf_counter() - start:.1f} s), generations in {path}")
        return {"val/score": score}

    def _greedy_records(self, examples: list) -> list[dict]:
        """The samples-file records of `examples`' greedy responses on this rank's engine, with their scores."""
        samples = self.rollout_runner.greedy(examples)
        responses = [self.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        rewards = self.reward_scorer.score(responses, [e.answer for e in examples], [s.token_ids for s in samples],
                                           [e.columns for e in examples])
        return validation_records(examples, responses, rewards)

    def _save(self) -> None:
        if self.trains:
            start = time.perf_counter()
            path = save_checkpoint(self.out / "checkpoints", self.step, self.model, self.actor.optimizer,
                                   self.actor.lr_schedule, extra={"step": self.step},
                                   keep_last=self.cfg.trainer.keep_last, group=self.train_group)
            self.logger.message(f"step {self.step}: saved checkpoint {path} ({time.perf_counter() - start:.1f} s)")

    def _save_hf(self) -> None:
        """trainer.save_hf: the final weights as a Hugging Face folder, each trainer rank writing its own shards."""
        if self.trains:
            start = time.perf_counter()
            out = export_hf(self.model, self.cfg.trainer.hf_dir or self.out / "hf", self.model_dir, self.compute_dtype,
                            group=self.train_group)
            self.logger.message(f"step {self.step}: wrote the Hugging Face model {out} "
                                f"({time.perf_counter() - start:.1f} s)")

    def _resume(self) -> None:
        """Load the checkpoint `resume_point` chose (every rank knows its step: a disagg rollout rank too)."""
        path = self.start.checkpoint
        if path is not None and self.trains:
            load_checkpoint(path, self.model, self.actor.optimizer, self.actor.lr_schedule, group=self.train_group)
        if path is not None and self.rank == 0:
            print(f"resumed from {path} at step {self.step}")
