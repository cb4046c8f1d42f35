"""The synchronous on-policy GRPO loop, colocated: every rank rolls out and trains.

One step (`RLTrainer._train_step`), its phases in order, each filling what the
step's state (rollplex.rl.step.StepState) still lacks:

    rollout   -> the engine samples n responses per prompt on the trainer's own weights;
                 the schedule places the prompt work around its decode (rollplex.rl.schedules)
    prefix    -> serial-prefix only: that prompt work as a phase of its own
    reward    -> score each response against the prompt's answer
    advantage -> group-normalised (GRPO) or mean-centred (Dr.GRPO)
    logprobs  -> old policy (when recomputed), reference model (when kl_coef > 0)
    update    -> `updates_per_batch` optimizer steps on mini-batches of the groups

The schedules rearrange where the prompt work runs, not these phases; with
schedule.stream_groups some phases run early for the groups that finish first,
and the phase after decode does the rest. disagg, rollout and training on
separate ranks, is its own trainer (rollplex.rl.disagg), built by `build_trainer`.

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
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rollplex.config import Config, config_to_dict, save_config
from rollplex.data.prefetch import Prefetcher
from rollplex.data.reward_scoring import LARGE_REWARD, RewardScorer, RewardScores
from rollplex.dist import (ParallelDims, all_gather_objects, all_reduce_values, build_ep_mesh, build_mesh,
                           init_distributed)
from rollplex.metrics import CONFIG_FILE, GpuMonitor, MetricsLogger, Timer, start_run_files
from rollplex.models import Prompt, VisionEmbeds, from_pretrained
from rollplex.models.protocol import VisionLanguageModel
from rollplex.rl.memory import GiB, MemoryPlan
from rollplex.rl.prompt_work import PromptWorkPlanner, update_chunks
from rollplex.rl.reports import (slow_cpu_compute_note, startup_summary, training_records, validation_metrics,
                                 validation_records)
from rollplex.agent.episodes import Agent, episode_metrics
from rollplex.rl.rollout import Rollout, RolloutRunner, balanced_share, build_engine
from rollplex.rl.schedules.prompt_items import PromptKind
from rollplex.rl.schedules.registry import build_schedule
from rollplex.rl.setup import PromptSource, load_run_processor, model_path, plan_run_memory, resume_point, run_tools
from rollplex.rl.step import StepState, norm_by_std, score_groups
from rollplex.rl.step_metrics import (PhaseMeter, combine_updates, gather_metrics, memory_metrics, speed_metrics,
                                      stop_if_every_reward_failed)
from rollplex.rl.weights import SharedWeights
from rollplex.run_lock import RunLock, claim_run_folder
from rollplex.stop_signals import Terminated, finishing_steps
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, TooManySkippedSteps
from rollplex.train.checkpoint import (export_hf, latest_checkpoint, load_checkpoint, remove_unfinished_saves,
                                       save_checkpoint)
from rollplex.train.lora import base_model_view
from rollplex.train.lora_export import export_peft_adapter
from rollplex.train.loss import group_advantages
from rollplex.train.optim import lr_schedule
from rollplex.train.routes import routes_of
from rollplex.train.parallelize import parallelize

def _global_range(values: list[float], group: dist.ProcessGroup | None) -> tuple[float, float]:
    """The least and greatest of every dp rank's `values` (each rank has some)."""
    greatest, negated_least = all_reduce_values([max(values), -min(values)], dist.ReduceOp.MAX, group)
    return -negated_least, greatest


def _kill_if_asked(step: int, rank: int) -> None:
    """Fault injection for the restart tests: ROLLPLEX_KILL_AT_STEP="STEP:RANK" makes
    that rank SIGKILL itself as it starts that step (its peers are then inside the
    step's collectives), in torchrun's first attempt only, so the restarted group
    runs through."""
    target = os.environ.get("ROLLPLEX_KILL_AT_STEP")
    if target and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and target == f"{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


class RLTrainer:
    """The colocated trainer: on every rank, the engine and the actor share one copy of the weights."""

    separate_ranks = False  # its schedules' kind (Schedule.separate_ranks): rollplex.rl.trainer picks the trainer

    def __init__(self, cfg: Config):
        self.run_lock: RunLock | None = None  # rank 0's, on trainer.output_dir (rollplex.run_lock)
        self.agent: Agent | None = None  # multi-turn rollouts' tools or environment (rollplex.agent)
        try:
            self._set_up(cfg)
        except BaseException:
            self._release_run_folder()  # a run that fails to start leaves its folder free for the next try
            raise

    def _set_up(self, cfg: Config) -> None:
        """The trainer's start-up: the run folder claimed, the resume point found, then the weights and engine."""
        self.cfg = cfg
        self.schedule = build_schedule(cfg)
        if self.schedule.separate_ranks != self.separate_ranks:
            raise ValueError(f"schedule {self.schedule.name} runs on another trainer than {type(self).__name__}: "
                             "build it with rollplex.rl.trainer.build_trainer(cfg)")
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
        self.dims = self._parallel_dims()
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
        self.data = PromptSource(cfg.data, self.processor, cfg.rollout.tools)
        self.skipped_rows = 0.0  # training rows skipped as of the batch being trained on (data/skipped_total)
        self.save_due = False  # a checkpoint is due, waiting for a step whose optimizer step was not skipped
        self.total_steps = self.data.run_steps(cfg.trainer)
        if self.complete:
            return  # no weights to load: fit() says the run is done
        self._open_logger()
        # Before any weights load: a run whose shapes cannot fit fails here, naming what does not fit.
        self.memory = plan_run_memory(cfg, path, next(self._batches(0)), self.dims, self.device, self.compute_dtype,
                                      self.schedule.memory_layout)
        # On CPU, trainer.device_memory stands for a GPU's: each phase's peak live tensor bytes are measured too.
        self.phases = PhaseMeter(self.device, measure_cpu=self.device.type == "cpu" and bool(cfg.trainer.device_memory))
        self._load_models(path)
        self._parallelize()
        self._build_rollout()
        self._build_actor()
        d = cfg.data
        self.reward_scorer = RewardScorer(d.reward, d.reward_workers, d.reward_timeout_s, d.reward_kind,
                                          d.reward_score_key, d.reward_keyword_arguments(), clip=d.reward_clip)
        self.gpu_monitor = GpuMonitor(device=self.device.index if self.device.type == "cuda" else None)

    def _parallel_dims(self) -> ParallelDims:
        """The training mesh's sizes: every rank trains."""
        return ParallelDims.resolve(self.world, self.cfg.parallel.dp_shard, self.cfg.parallel.tp, self.cfg.parallel.ep)

    def _open_logger(self) -> None:
        cfg, log = self.cfg, self.cfg.logging
        resumed_step = self.start.step if self.start.checkpoint is not None else None
        if self.rank == 0:  # before the logger opens them: the metrics and samples files hold this run's steps
            if changed := start_run_files(self.out, resumed_step):
                print(f"rollplex: {changed}", flush=True)
        # Before any weights load: a tracker that is not installed stops the run here.
        self.logger = MetricsLogger(self.out, rank=self.rank, console=log.console, jsonl=log.jsonl,
                                    tensorboard=log.tensorboard, total_steps=self.total_steps, wandb=log.wandb,
                                    swanlab=log.swanlab, project=log.project, run_name=log.run_name,
                                    run_config=config_to_dict(cfg), resumed_step=resumed_step,
                                    progress=log.progress, progress_every_s=log.progress_every_s)
        self.progress = self.logger.progress  # rank 0's: the step in progress (rollplex.progress)

    def _load_models(self, path: Path) -> None:
        """fp32 master weights, computed in model.dtype (FSDP gathers them in it, one process too);
        with LoRA the frozen base in model.dtype only (unless the vision tower trains in full: the
        adapters are fp32 whatever it loads in); the frozen reference model in model.dtype only."""
        cfg = self.cfg
        self.model = from_pretrained(path, dtype=self.compute_dtype if cfg.lora.adapters_only else torch.float32,
                                     device=self.device, attn_backend=cfg.model.attn_backend)
        self.ref_model = None
        # With LoRA on a wholly frozen base the reference model is that base, on the same tensors (_shard_models).
        if cfg.algorithm.kl_coef > 0 and not cfg.lora.adapters_only:
            self.ref_model = self._frozen_reference(path)

    def _frozen_reference(self, path: Path) -> VisionLanguageModel:
        return from_pretrained(path, dtype=self.compute_dtype, device=self.device,
                               attn_backend=self.cfg.model.attn_backend).requires_grad_(False)

    def _parallelize(self) -> None:
        """FSDP2 (+ TP) over the mesh, a single trainer too (a mesh of one: the same mixed
        precision as many), the reference model alike; the engine reads the same weights."""
        cfg = self.cfg
        mesh = build_mesh(self.dims, self.device.type)
        self._shard_models(mesh, build_ep_mesh(self.dims, self.device.type))
        self.weights = SharedWeights(self.model, cfg.parallel.tp, cfg.rollout.tp)
        self.checkpoint_group = None  # every rank writes its shards

    def _shard_models(self, mesh, ep_mesh=None) -> None:
        cfg = self.cfg
        self.dp_rank, self.dp_group = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].get_group()
        parallelize(self.model, mesh, cfg.parallel.activation_checkpointing, cfg.parallel.freeze_vision,
                    self.compute_dtype, cfg.lora, cfg.trainer.seed, ep_mesh=ep_mesh)
        if self.ref_model is not None:
            parallelize(self.ref_model, mesh, compute_dtype=self.compute_dtype, ep_mesh=ep_mesh)
        elif cfg.algorithm.kl_coef > 0:
            self.ref_model = base_model_view(self.model, mesh["tp"])

    def _build_rollout(self, engine_group: dist.ProcessGroup | None = None) -> None:
        """The engine on the rollout layout of the weights, and the prompt work's planner."""
        cfg = self.cfg
        self.engine = build_engine(self.weights, cfg.rollout, self.memory.kv_pool_blocks,
                                   self.memory.batch.longest_sequence, engine_group,
                                   record_routes=cfg.algorithm.routing_replay == "rollout")
        self.engine.progress = self.progress
        tp_group = self.weights.engine_tp_group if cfg.rollout.tp > cfg.parallel.tp else None
        # Multi-turn rollouts' tools or environment, in worker processes kept for the run.
        self.agent = Agent(cfg.rollout, self.processor, self.model.args.rope_spec, run_tools(cfg)) \
            if cfg.multi_turn else None
        self.rollout_runner = RolloutRunner(self.engine, self.weights, self.model, self.tokenizer, cfg.rollout,
                                            cfg.trainer.seed, tp_group, self.agent)
        # The prompt-work slices' side stream, one for the trainer's lifetime (see rollplex.rl.prompt_work), at priority 0,
        # CUDA's lowest: the engine's decode stream goes first.
        self.side_stream = torch.cuda.Stream(self.device, priority=0) if self.device.type == "cuda" else None
        self.prompt_planner = PromptWorkPlanner(self.memory, self.model, self.ref_model, cfg.parallel.tp,
                                            self.dims.dp_shard, self.dp_group, self.side_stream, cfg.parallel.ep)

    def _build_actor(self) -> None:
        cfg, t = self.cfg, self.cfg.trainer
        self.actor = Actor(self.model, ActorConfig.from_config(cfg, self.memory.sizes.micro_batch_tokens),
                           self.dp_group, lr_lambda=lr_schedule(t.lr_schedule, t.warmup_steps,
                                                                self.total_steps * cfg.algorithm.updates_per_batch))
        self.actor.on_micro_batch = self.progress.micro_batches

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

    def _layout_summary(self) -> str:
        d = self.dims
        return (f"{self.world} rank(s): dp_shard {d.dp_shard} x tp {d.tp}, engine tp {self.cfg.rollout.tp}; "
                f"schedule {self.schedule.name}")

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
        # DTensors count their whole tensor.
        parameters = (sum(p.numel() for p in self.model.parameters()),
                      sum(p.numel() for p in self.model.parameters() if p.requires_grad))
        self.logger.message(startup_summary(cfg, self.model_dir, parameters, self.data, self.total_steps,
                                            self._layout_summary(), self.start))
        if note := slow_cpu_compute_note(cfg.model.dtype, self.device.type):
            self.logger.message(note)
        self._resume()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out / CONFIG_FILE)
        first_step = self.step
        try:
            if cfg.trainer.val_before_train and self.step == 0:
                self._evaluate_before_training()
            self._train_steps()
            exported = self._save_hf() if cfg.trainer.save_hf else None
            self.logger.summarize_run(self.step, self.step - first_step,
                                      latest_checkpoint(self.out / "checkpoints"), exported)
        finally:  # a run that stops on an error still flushes its trackers and stops its reward and tool workers
            self.logger.close()
            self.reward_scorer.close()
            if self.agent is not None:
                self.agent.close()

    def _evaluate_before_training(self) -> None:
        """trainer.val_before_train: the starting point of the val/score curve, logged as step 0."""
        self.progress.start_step(0)
        with self.progress.phase("val"):
            before = self.evaluate()
        if before:
            self.logger.log(0, before)

    def _train_steps(self) -> None:
        batches = self._batches(self.step)
        # The next batch is prepared in the background while this step runs; the rows skipped so far go with it.
        # A SIGTERM during a step lets it finish and be saved (trainer.save_on_term: rollplex.stop_signals).
        with Prefetcher(lambda: (next(batches), self.data.skipped)) as upcoming, \
                finishing_steps(lambda: self.step, self.total_steps, announce=self.rank == 0,
                                save_on_term=self.cfg.trainer.save_on_term) as boundary:
            while self.step < self.total_steps:
                self.step += 1  # first: a SIGTERM while the batch is awaited is one during this step
                examples, self.skipped_rows = upcoming.next(ahead=self.step < self.total_steps)
                _kill_if_asked(self.step, self.rank)
                metrics = self.train_step(examples, data_s=upcoming.wait_s)
                saved = self._after_step(metrics)
                if self.step < self.total_steps and boundary.requested():  # the last step ends the run anyway
                    self._stop_for_sigterm(saved)

    def _stop_for_sigterm(self, saved: bool) -> None:
        """Stop after this step, which a SIGTERM let finish: keep it (unless its checkpoint was just saved)."""
        if not saved:
            self._save()
        raise Terminated(saved_step=self.step)

    def _after_step(self, metrics: dict[str, float]) -> bool:
        """Evaluate, log and save as the step's number asks; whether it saved a checkpoint of the step."""
        cfg, last = self.cfg, self.step == self.total_steps
        if cfg.trainer.eval_every and (self.step % cfg.trainer.eval_every == 0 or last):
            with self.progress.phase("val"):
                metrics.update(self.evaluate())
        self.save_due |= bool(cfg.trainer.save_every) and (self.step % cfg.trainer.save_every == 0 or last)
        # A step whose last optimizer step was skipped (non-finite values) is not saved but by the run's end: its save
        # waits for the next step that trains, so that a run stopped by trainer.max_skipped_steps keeps a good one.
        skipped = self.actor is not None and self.actor.skipped_in_a_row > 0  # None: a disagg rollout rank
        saving = self.save_due and (last or not skipped)
        self.save_due &= not saving
        if saving or self.device.type == "cuda":
            metrics["perf/live_memory_gb"] = self.phases.live_bytes() / GiB
        if self.step % cfg.logging.log_every == 0 or last or "val/score" in metrics:
            self.logger.log(self.step, metrics)
        if saving:
            with self.progress.phase("save"):
                self._save()
        return bool(saving)

    def train_step(self, examples: list, data_s: float = 0.0) -> dict[str, float]:
        """One step on the global batch `examples`; `data_s`: how long the step waited for them (timing_s/data,
        counted in timing_s/step)."""
        self.progress.start_step(self.step)
        # GPU utilisation and memory over the step (no-op without an NVIDIA GPU), and each phase's peak memory
        with self.gpu_monitor, self.phases.step() as peaks:
            metrics = self._train_step(examples, data_s)
        metrics.update(self.gpu_monitor.as_metrics())
        metrics.update(memory_metrics(peaks, self._planned_memory()))
        return metrics

    def _planned_memory(self) -> MemoryPlan | None:
        """The plan the step's measured peaks are set beside."""
        return self.memory

    def _train_step(self, examples: list, data_s: float) -> dict[str, float]:
        """The step's phases in order (the module docstring); each fills what `state` lacks."""
        cfg, timer, phase = self.cfg, Timer(), self._phase
        start = time.perf_counter() - data_s
        state = self._rollout_phase(examples, timer)
        if self.schedule.prompt_work_phase:
            with phase(timer, "prefix"):
                self.schedule.after_rollout(self, state)
        with phase(timer, "reward"):
            self._rewards(state)
        self._advantages(state)
        if cfg.algorithm.recompute_old_logprobs:
            with phase(timer, "old_log_prob"):
                self._logprobs(self.model, state, (PromptKind.ACTOR, PromptKind.OLD), state.old, "old")
        if self.ref_model is not None:
            with phase(timer, "ref"):
                self._logprobs(self.ref_model, state, (PromptKind.REF,), state.ref, "ref")
                # FSDP2 keeps a root unit gathered from its forward to its backward, which a frozen model never
                # runs: without this its embedding and head would stay gathered for the rest of the run.
                if isinstance(self.ref_model, FSDPModule):  # not LoRA's base view: FSDP leaves the base alone
                    self.ref_model.reshard()
        with phase(timer, "update_actor"):
            actor_metrics = self._update(state)
        return self._step_metrics(state, actor_metrics, timer, data_s, time.perf_counter() - start)

    @contextmanager
    def _phase(self, timer: Timer, name: str) -> Iterator[None]:
        """A phase of the step: timed, marked for its peak memory, and shown as the step's progress."""
        with self.progress.phase(name), self.phases.phase(timer, name):
            yield

    def _rollout_phase(self, examples: list, timer: Timer) -> StepState:
        """This rank's share of the step's prompts, rolled out (the gen phase)."""
        mine = balanced_share(examples, self.dims.dp_shard, self.dp_rank)
        with self._phase(timer, "gen"):
            state = self.rollout(mine, self.step)
        # Decode graphs captured in this rollout: each bucket's at its first use in the run, and again where the
        # engine's weights (the trainer's, gathered) landed elsewhere since.
        state.metrics.update({"perf/cuda_graph_captures": self.engine.stats["graph_captures"],
                              "perf/cuda_graph_capture_failures": self.engine.stats["graph_capture_failures"],
                              "timing_s/cuda_graph_capture": self.engine.stats["graph_capture_s"]})
        return state

    def rollout(self, examples: list, step: int) -> StepState:
        """Sample n responses per prompt of `examples` (this rank's) on this rank's engine, the
        schedule placing the step's prompt work around the decode."""
        state = StepState(step, examples)
        self.schedule.rollout(self, state)
        return state

    @torch.no_grad()
    def encode(self, prompt: Prompt) -> VisionEmbeds | None:
        """A prompt's vision features on the rollout's weights (None without images or video)."""
        if not prompt.has_vision:
            return None
        return self.model.encode_vision(prompt.pixel_values, prompt.image_grid_thw, prompt.pixel_values_videos,
                                        prompt.video_grid_thw)

    # ------------------------------------------------------------------ the phases after rollout

    def _rewards(self, state: StepState) -> None:
        """Every sample's reward, in group order: the decode window's for the groups it scored, the
        others' now (in one call when there was no window's)."""
        rollout = state.rollout

        def score(gs) -> RewardScores:
            texts = [t for g in gs for t in rollout.texts[rollout.responses_of(slice(g, g + 1))]]
            return score_groups(self.reward_scorer, [rollout.examples[g] for g in gs], [rollout.groups[g] for g in gs],
                                texts, warn=False)

        groups = range(len(rollout.groups))
        state.rewards = RewardScores.concat([state.scores.get(g) or score([g]) for g in groups]) if state.scores \
            else score(groups)
        self.reward_scorer.warn_failures(state.rewards)
        stop_if_every_reward_failed(state.rewards, self.cfg.data.reward, self.dp_group)

    def _advantages(self, state: StepState) -> None:
        cfg = self.cfg
        group_index = torch.arange(len(state.examples)).repeat_interleave(cfg.rollout.n)
        state.advantages = group_advantages(torch.tensor(state.rewards.scores), group_index,
                                            norm_by_std=norm_by_std(cfg)).tolist()
        if cfg.trainer.log_samples_every and self.step % cfg.trainer.log_samples_every == 0:
            self.logger.log_samples(self.step, training_records(state.rollout, state.rewards, state.advantages,
                                                                cfg.trainer.log_samples))

    def _logprobs(self, model: VisionLanguageModel, state: StepState, kinds: tuple[PromptKind, ...],
                  by_group: dict[int, list[torch.Tensor]], pass_kind: str) -> None:
        """Fill `by_group` with the logprobs under `model` of every group it lacks, chunk by chunk:
        suffix-only passes where a prompt item of one of `kinds` kept the chunk's prompts, full
        passes otherwise; an MoE model's routed as algorithm.routing_replay says for `pass_kind`
        ("old" or "ref", rollplex.train.routes.routes_of)."""
        routes = routes_of(self.cfg.algorithm.routing_replay, pass_kind)
        groups = state.rollout.groups
        for c, chunk in enumerate(update_chunks(len(groups), self.cfg.algorithm.updates_per_batch)):
            indices = range(chunk.start, chunk.stop)
            done = frozenset(p for p, g in enumerate(indices) if g in by_group)
            computed = iter(self.actor.logprobs(model, groups[chunk], state.kept(kinds, c), skip=done,
                                                routes=routes))
            for p, g in enumerate(indices):
                responses = [next(computed) for _ in groups[g].samples]
                if p not in done:
                    by_group[g] = responses

    def _update(self, state: StepState) -> dict[str, float]:
        """`updates_per_batch` optimizer steps, each on a chunk of the groups; the first reads the
        actor's kept prompt forward when prompt work made one (and finishes the step the decode
        window started, when finished groups streamed), and alone measures the engine/trainer
        mismatch: it runs on the rollout's weights."""
        rollout, updates = state.rollout, []
        old = state.per_sample(state.old) if self.cfg.algorithm.recompute_old_logprobs else rollout.logprobs
        ref = state.per_sample(state.ref) if self.ref_model is not None else None
        chunks = update_chunks(len(rollout.groups), self.cfg.algorithm.updates_per_batch)
        for i, chunk in enumerate(chunks):
            start = time.perf_counter()
            at = rollout.responses_of(chunk)
            batch = PolicyBatch(rollout.groups[chunk], state.advantages[at], old[at], ref[at] if ref else None,
                                rollout.logprobs[at], state.kept((PromptKind.ACTOR,), i), rollout_weights=i == 0)
            early = state.update if i == 0 else None
            updates.append(early.finish(batch) if early is not None else self.actor.update(batch))
            if self.actor.skip_cause:
                self._report_skipped_update(state, f"{i + 1} of {len(chunks)}")
            if i == 0:
                state.first_update_s = time.perf_counter() - start
        return combine_updates(updates)

    def _report_skipped_update(self, state: StepState, which: str) -> None:
        """Say why the step's optimizer step `which` was skipped, with the step's reward and advantage
        ranges; once trainer.max_skipped_steps were skipped in a row, stop the run (before `_after_step`
        saves the step). Every rank gets here alike: the skip and its count are global."""
        limit, in_a_row, cause = self.cfg.trainer.max_skipped_steps, self.actor.skipped_in_a_row, self.actor.skip_cause
        (reward_lo, reward_hi), advantages = (_global_range(values, self.dp_group)
                                              for values in (state.rewards.scores, state.advantages))
        ranges = (f"the step's rewards lie in [{reward_lo:.3g}, {reward_hi:.3g}], its advantages in "
                  f"[{advantages[0]:.3g}, {advantages[1]:.3g}]")
        stops = f"; trainer.max_skipped_steps {limit} stops the run" if limit else ""
        self.logger.message(f"step {self.step}: optimizer step {which} skipped ({in_a_row} in a row{stops}): "
                            f"{cause}; {ranges}")
        if not limit or in_a_row < limit:
            return
        tries = ["data.reward_clip (every reward into [-c, c]) or a bounded reward function",
                 "algorithm.adv_estimator grpo (each group's advantages divided by their std)", "a lower trainer.lr"]
        if max(abs(reward_lo), abs(reward_hi)) <= LARGE_REWARD:  # rewards of a sane size: the step size first
            tries.reverse()
        raise TooManySkippedSteps(
            f"{in_a_row} optimizer steps in a row were skipped for non-finite values (trainer.max_skipped_steps "
            f"{limit}; 0 never stops), the last at step {self.step}: {cause}; {ranges}. Try {'; or '.join(tries)}. "
            f"The run stopped before saving this step")

    def _step_metrics(self, state: StepState, actor_metrics: dict[str, float], timer: Timer, data_s: float,
                      seconds: float) -> dict[str, float]:
        metrics = gather_metrics(state, actor_metrics, self.skipped_rows, self.dp_group)
        if self.agent is not None:
            metrics.update(episode_metrics(state.rollout.samples, self.rollout_runner.tool_wait_s, self.dp_group))
        metrics["timing_s/data"] = data_s
        metrics.update(timer.as_metrics())
        metrics.update(state.metrics)
        metrics.update(self._weights_metrics())
        self.schedule.report(self, state, metrics)
        metrics.update(speed_metrics(state.rollout, seconds, metrics["perf/actor_flops"],
                                     metrics["timing_s/update_actor"], self.world, self.device, self.dp_group))
        return metrics

    def _weights_metrics(self) -> dict[str, float]:
        """How the engine's layout of the shared weights was made this step (rollplex.rl.weights)."""
        return self.weights.report.as_metrics()

    # ------------------------------------------------------------------ evaluation, checkpoints

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The score on the validation prompts (trainer.val_n responses each, greedy by default),
        split across dp ranks, and per data_source where the rows have one; every generation goes
        to the step's samples file."""
        examples = self.data.val_examples
        if not examples:
            return {}
        start = time.perf_counter()
        records = self._validation_records(examples)
        # A stable sort: the same order (a prompt's responses as drawn), and so the same sums, on any layout.
        records.sort(key=lambda r: r["index"])
        metrics = validation_metrics(records)
        path = self.logger.log_samples(self.step, records)
        n = self.cfg.trainer.val_n
        responses = f" x {n} responses" if n > 1 else ""
        self.logger.message(f"step {self.step}: val/score {metrics['val/score']:.4g} over {len(examples)} prompts"
                            f"{responses} ({time.perf_counter() - start:.1f} s), generations in {path}")
        return metrics

    def _validation_records(self, examples: list) -> list[dict]:
        """Every rank's records of `examples`, each rank generating its share."""
        mine = self._generation_records(examples[self.dp_rank::self.dims.dp_shard])
        return [r for rank_records in all_gather_objects(mine, self.dp_group) for r in rank_records]

    def _generation_records(self, examples: list) -> list[dict]:
        """The samples-file records of the validation responses to `examples` on this rank's engine
        (trainer.val_n each, at trainer.val_temperature and val_top_p), with their scores."""
        t = self.cfg.trainer
        groups = self.rollout_runner.validate(examples, t.val_n, t.val_temperature, t.val_top_p)
        rollout = Rollout.of(examples, groups, self.tokenizer)
        return validation_records(rollout, score_groups(self.reward_scorer, examples, groups, rollout.texts))

    def _save(self) -> None:
        start = time.perf_counter()
        path = save_checkpoint(self.out / "checkpoints", self.step, self.model, self.actor.optimizer,
                               self.actor.lr_schedule, extra={"step": self.step},
                               keep_last=self.cfg.trainer.keep_last, group=self.checkpoint_group)
        self.logger.message(f"step {self.step}: saved checkpoint {path} ({time.perf_counter() - start:.1f} s)")

    def _save_hf(self) -> tuple[str, Path] | None:
        """trainer.save_hf: the final weights as a Hugging Face folder, each rank writing its own shards;
        a LoRA run's adapters as a PEFT folder (the merged model when its vision tower trained in full).
        Returns what it wrote and where."""
        start, cfg = time.perf_counter(), self.cfg
        out_dir = cfg.trainer.hf_dir or self.out / "hf"
        if cfg.lora.adapters_only:
            out = export_peft_adapter(self.model, out_dir, cfg.lora, str(self.model_dir), group=self.checkpoint_group)
            what = "LoRA adapter"
        else:
            out = export_hf(self.model, out_dir, self.model_dir, self.compute_dtype, group=self.checkpoint_group)
            what = "Hugging Face model"
        self.logger.message(f"step {self.step}: wrote the {what} {out} ({time.perf_counter() - start:.1f} s)")
        return what, out

    def _resume(self) -> None:
        """Load the checkpoint `resume_point` chose."""
        path = self.start.checkpoint
        if path is not None:
            load_checkpoint(path, self.model, self.actor.optimizer, self.actor.lr_schedule,
                            group=self.checkpoint_group)
            if self.rank == 0:
                print(f"resumed from {path} at step {self.step}")
