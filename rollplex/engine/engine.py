"""The decode engine: generate(requests) -> sampled tokens with their logprobs.

The loop, readable in one sitting: schedule a step (prefill or decode), run
the model for it, sample, then finish it (record the sampled tokens; finished
sequences record their samples and free their blocks), then hand the caller its
`between_steps`. The scheduler owns the sequences' lifecycle (rollplex.engine.scheduler).

The host runs one decode step ahead (`EngineConfig.run_ahead`): it schedules
and issues step N+1, whose inputs are step N's tokens still on the device,
before it reads step N's tokens back and finishes it. On a GPU the host's work
for a step (scheduling, inputs, stop checks, the caller's `between_steps`) then
overlaps the device's, instead of leaving the device idle in between. A sequence
that finishes at step N has run step N+1 too, whose token is dropped. The
scheduler does not run ahead where step N's tokens could change the next step
(a prefill, a preemption: `Scheduler.can_run_ahead`); on CPU, where the device
is the host, the same logic runs with nothing to overlap.

The running sequences' state (tokens, logprobs, lengths, finish reasons) has
one owner while they decode, a `DecodeBatch` of persistent arrays updated in
place: a decode step's inputs, its sampled tokens and its stop checks are a few
array operations for the whole batch, and Python touches a sequence only when
it needs a block, finishes or is preempted. The host waits
on the device once per step, to read the sampled tokens back for the stop checks,
and with run-ahead the next step is already queued then.

The engine runs on the model it is given and never copies its weights: in the
RL loop those weights belong to the trainer.

On CUDA, every step's device work (the decode batch's updates, KV block
copies, input copies, graph replay, sampling) runs on `decode_stream`, created
once per engine at the highest stream priority and ordered against the caller's
stream at each step's start and end; only a prefill's forward (its large
temporaries belong to the caller's memory) runs on the caller's stream. The GPU
schedules decode kernels ahead of those of lower-priority streams (the RL
loop's prompt work), which fill the rest of it. `between_steps` and
`on_finished` run on the caller's stream.

Multi-turn (agentic) rollouts: with `episodes` (rollplex.engine.episodes), a sample
whose turn ends pauses, holding its KV blocks but no decode row, while its tool runs;
the engine polls for observations between steps (blocking only when nothing else can
run), and each observation is prefilled onto the sample's K/V, never its history
again, before it decodes on (rollplex.engine.scheduler).

A step whose logits hold NaN or inf samples nothing: its sampled logprobs, read
back with its tokens, are then non-finite, and the engine raises a
`NonFiniteLogitsError` naming the step, the samples and the first layer whose
output is non-finite for them (rollplex.engine.nonfinite).
"""

from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NoReturn

import numpy as np
import torch

from rollplex.engine.block_manager import BlockManager
from rollplex.engine.decode_batch import Advanced, DecodeBatch
from rollplex.engine.episodes import Episodes
from rollplex.engine.kv_cache import KVCache
from rollplex.engine.nonfinite import NonFiniteLogitsError, first_nonfinite_stage
from rollplex.engine.recurrent_state import RecurrentStatePool
from rollplex.device import free_memory, to_device, to_host
from rollplex.dist import rank
from rollplex.engine.routes import RouteLog
from rollplex.engine.runner import ModelRunner
from rollplex.engine.sampler import SamplingParams, mix_seed, sample
from rollplex.engine.scheduler import Scheduler, Step
from rollplex.engine.sequence import PromptState, Request, Sequence
from rollplex.models.inputs import Group
from rollplex.models.moe import moe_args
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.rope import mrope_positions
from rollplex.progress import Progress

if TYPE_CHECKING:
    from rollplex.config import RolloutConfig


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_memory: float = 0.3  # <= 1: fraction of free device memory; > 1: bytes
    num_blocks: int | None = None  # set the pool size directly (overrides kv_cache_memory)
    max_num_seqs: int = 256  # sequences decoding at once (and the largest CUDA-graph batch)
    max_num_batched_tokens: int = 16384  # prefill tokens per step (a longer prompt runs alone)
    max_model_len: int = 8192  # prompt + generation, capped by the model's max_position_embeddings
    enforce_eager: bool = False  # no CUDA graphs
    progress: bool = True  # its own progress line on a terminal's stdout (rank 0), redrawn in place
    shared_prefix_decode: bool = False  # each group's shared prompt blocks read once per decode step (cascade)
    run_ahead: bool = True  # issue decode step N+1 before reading step N's tokens back (module docstring)
    # MoE models: record each token's experts into its Sample (rollplex.engine.routes), for routing replay
    record_routes: bool = False

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory must be > 0, got {self.kv_cache_memory}")

    @classmethod
    def from_config(cls, rollout: RolloutConfig, num_blocks: int, max_model_len: int) -> EngineConfig:
        """The RL loop's engine: the rollout section's blocks, batch and graphs, a pool
        of `num_blocks` (the memory plan's), sequences of up to `max_model_len` tokens (the
        run's longest prompt plus rollout.max_tokens: every prompt the data admits fits,
        with its whole response), no progress display of its own (the loop hands it the run's: Engine.progress)."""
        return cls(block_size=rollout.block_size, num_blocks=num_blocks, max_num_seqs=rollout.max_num_seqs,
                   max_model_len=max_model_len, enforce_eager=rollout.enforce_eager, progress=False,
                   shared_prefix_decode=rollout.shared_prefix_decode)


class Engine:
    def __init__(self, model: VisionLanguageModel, config: EngineConfig | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg, text = self.config, model.args.text
        self.max_model_len = min(cfg.max_model_len, text.max_position_embeddings)
        self.device = model.device
        self.dtype = model.dtype
        kv_heads, kv_layers = model.kv_heads_per_rank(), model.kv_layers()
        # Layers with a recurrent state (Qwen3.5's DeltaNet) keep one slot per decode row, allocated first: the KV
        # pool's budget is what is left.
        shapes = model.recurrent_state_shapes()
        self.states = None if shapes is None else RecurrentStatePool(shapes, cfg.max_num_seqs, self.dtype,
                                                                     self.device)
        self.cache = KVCache(len(kv_layers), self._num_blocks(kv_heads, len(kv_layers)), cfg.block_size, kv_heads,
                             text.head_dim, self.dtype, self.device, layers=kv_layers)
        self.runner = ModelRunner(model, self.cache, self.max_model_len, cfg.max_num_seqs,
                                  use_cuda_graphs=not cfg.enforce_eager,
                                  shared_prefix_decode=cfg.shared_prefix_decode, states=self.states)
        eos = model.args.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.stats: dict[str, float] = {}
        # Where generate reports samples finished and tokens made (rollplex.progress): its own display, or the RL
        # loop's, which shows them beside the step and phase.
        self.progress = Progress("live" if self.config.progress and rank() == 0 and sys.stdout.isatty() else "off")

    def _num_blocks(self, kv_heads: int, kv_layers: int) -> int:
        """The KV pool's blocks: as set, or what its budget holds (a fraction of the free memory,
        measured after the state pool is allocated, or bytes, of which the state pool takes its
        share first), never more than max_num_seqs sequences of max_model_len could use."""
        cfg, text = self.config, self.model.args.text
        per_block = KVCache.bytes_per_block(kv_layers, cfg.block_size, kv_heads, text.head_dim, self.dtype)
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)  # more could never be used
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory > 1:
            budget = cfg.kv_cache_memory - (0 if self.states is None else self.states.nbytes)
        else:
            budget = cfg.kv_cache_memory * free_memory(self.device)
        return max(1, min(useful, int(budget) // per_block))

    @property
    def decode_stream(self) -> torch.cuda.Stream | None:
        """The high-priority CUDA stream decode steps run on (None on CPU)."""
        return self.runner.decode_stream

    # ------------------------------------------------------------------ memory between phases

    def release_kv(self) -> None:
        """Free the KV pool and the recurrent state pool; `generate` allocates them again, at
        the same size (and, on a new address, with new graphs)."""
        self.cache.release()
        if self.states is not None:
            self.states.release()

    # ------------------------------------------------------------------ generate

    def generate(self, requests: list[Request], params: SamplingParams | None = None,
                 between_steps: Callable[[int], None] | None = None,
                 on_finished: Callable[[int, Group], None] | None = None,
                 episodes: Episodes | None = None) -> list[Group]:
        """Sample every request's n responses. `between_steps(running)`, when
        given, is called after each engine step's tokens are read back (with the
        next decode step, run ahead, already issued) with the number of sequences
        still decoding: the RL loop's prompt-work scheduler runs its work there.
        `on_finished(index, group)`, before it, with each request whose samples
        have all finished in that step (the RL loop streams their work).
        `episodes`: multi-turn samples, whose turns end and observations come from it."""
        params = params or SamplingParams()
        prompts = [self._prepare(i, r, params) for i, r in enumerate(requests)]
        scheduler = self._start(prompts, params, episodes)
        self.progress.generation(sum(r.n for r in requests))
        try:
            self._run_steps(scheduler, params, between_steps, on_finished)
        finally:  # a generation that raises takes its progress line away too
            self.progress.generation_done()
        self._end(scheduler)
        return [_group(p) for p in prompts]

    def _run_steps(self, scheduler: Scheduler, params: SamplingParams, between_steps: Callable[[int], None] | None,
                   on_finished: Callable[[int, Group], None] | None) -> None:
        """generate's steps, until every sample is finished."""
        in_flight: _Issued | None = None  # a step issued, its tokens not yet read back
        while scheduler.has_work():
            # Samples whose observations came back; when nothing can run, wait for one.
            ended = self._resume_episodes(scheduler, wait=in_flight is None and not scheduler.can_step())
            # Every device write of a step (the decode batch's rows and block tables, the step's inputs, the
            # model and the sampler) goes on the decode stream: on the caller's, it would queue behind the
            # prompt work's kernels, which the decode stream's priority exists to pass.
            with self.runner.on_decode_stream():
                issued = None
                if scheduler.can_step() and (in_flight is None or self._may_run_ahead(in_flight, scheduler)):
                    issued = self._issue(scheduler.schedule(), scheduler.batch, params)
                # A decode step issued before `in_flight` is finished fed the last tokens of the sequences it ends.
                ran_ahead = issued is not None and not issued.step.is_prefill
                finished = None if in_flight is None else self._finish(in_flight, scheduler, ran_ahead)
            in_flight = issued
            if ended:
                finished = (finished or []) + ended
            if finished is None:
                continue
            self.progress.samples(len(finished), self.stats["decode_tokens"])
            if on_finished is not None:
                for p in {s.prompt.index: s.prompt for s in finished}.values():
                    if all(sample is not None for sample in p.samples):
                        on_finished(p.index, _group(p))
            if between_steps is not None and scheduler.has_work():
                between_steps(len(scheduler.running))
        if in_flight is not None:  # run ahead of sequences that all stopped: its tokens are dropped
            with self.runner.on_decode_stream():
                self._finish(in_flight, scheduler)

    def _resume_episodes(self, scheduler: Scheduler, wait: bool) -> list[Sequence]:
        """Continue the paused samples whose observations are ready, their images encoded on the
        vision stream while decode goes on, and queue those whose images are (with `wait`, nothing
        else can run: after waiting for one); returns the samples whose episodes ended instead."""
        if scheduler.episodes is None:
            return []
        ended = []
        if scheduler.paused:
            ready = scheduler.episodes.poll(wait and not scheduler.preparing)
            if wait and not ready and not scheduler.preparing:
                raise RuntimeError(f"{len(scheduler.paused)} samples wait for observations, and waiting for one "
                                   "returned none")
            ended = [seq for key, outcome in ready
                     if (seq := scheduler.resume(key, outcome, self.runner.encode_aside)) is not None]
        scheduler.queue_prepared(wait and not ended)
        return ended

    def _may_run_ahead(self, in_flight: _Issued, scheduler: Scheduler) -> bool:
        """Whether the next step may be issued before `in_flight`'s tokens are read back:
        a decode step after a decode step, which those tokens cannot change."""
        return self.config.run_ahead and not in_flight.step.is_prefill and scheduler.can_run_ahead()

    def _start(self, prompts: list[PromptState], params: SamplingParams, episodes: Episodes | None) -> Scheduler:
        """A new generation: the KV pool (allocated again if it was released), the runner
        told, and a scheduler over a new block manager and decode batch, with every
        prompt waiting."""
        self.cache.allocate()
        # A group larger than max_num_seqs still runs, alone.
        rows = max([self.config.max_num_seqs] + [p.request.n for p in prompts])
        if self.states is not None:
            self.states.allocate()
            self.states.hold_rows(rows)
        self.runner.start_generation()
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if episodes is not None:
            stop_ids |= episodes.turn_end_ids
        blocks = BlockManager(self.cache.num_blocks, self.cache.block_size)
        self.runner.routes = self._route_log(prompts, rows)
        batch = DecodeBatch(prompts, rows, self.runner.max_blocks, self.cache.sink_block, stop_ids, self.device,
                            routes=self.runner.routes)
        scheduler = Scheduler(blocks, batch, self.config.max_num_seqs, self.config.max_num_batched_tokens, episodes)
        for p in prompts:
            scheduler.add(p)
        # dropped_tokens: sampled by sequences that had finished at the step before (run-ahead).
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "dropped_tokens": 0, "steps": 0}
        return scheduler

    def _route_log(self, prompts: list[PromptState], rows: int) -> RouteLog | None:
        """Where this generation records its routes (`EngineConfig.record_routes`), or None."""
        if not self.config.record_routes:
            return None
        moe = moe_args(self.model)
        if moe is None:
            raise ValueError("EngineConfig.record_routes is for MoE models; this model has no expert layers")
        longest = max((p.max_length - len(p.request.prompt.input_ids) for p in prompts), default=0)
        return RouteLog(rows, longest, self.model.args.text.num_hidden_layers, moe.num_experts_per_tok, self.device)

    def _end(self, scheduler: Scheduler) -> None:
        self.runner.routes = None  # the samples hold their routes: the log's buffer goes
        self.stats["preemptions"] = scheduler.num_preemptions
        self.stats["released_episodes"] = scheduler.num_released_episodes
        # The first generation's graphs, and new ones for moved weights: inside this generation's time.
        # Failed: captures that ran out of memory, whose buckets decode eagerly.
        (self.stats["graph_captures"], self.stats["graph_capture_s"],
         self.stats["graph_capture_failures"]) = self.runner.captures_since_start()
        assert scheduler.blocks.num_free == self.cache.num_blocks, "KV blocks leaked"

    def _issue(self, step: Step, batch: DecodeBatch, params: SamplingParams) -> _Issued:
        """Run the step and sample, and issue its tokens to the batch (the next step's
        input); the tokens and their logprobs start on their way to the host. On the
        decode stream (a prefill's forward runs on the caller's: `ModelRunner.prefill`)."""
        index = self.stats["steps"]
        logits = self._run(step, batch)
        tokens, logprobs = self._sample(logits, step, batch, params)
        advanced = batch.advance(tokens, step.first)
        # float64 holds every token id and float32 logprob exactly: one copy for both.
        host, ready = to_host(torch.stack([tokens.double(), logprobs.double()]))
        return _Issued(step, index, advanced, host, ready)

    def _finish(self, issued: _Issued, scheduler: Scheduler, ran_ahead: bool = False) -> list[Sequence]:
        """Wait for an issued step's tokens on the host and record them; returns the
        sequences that finished. A non-finite logprob of a running sequence means NaN
        or inf in its logits (rollplex.engine.nonfinite): the step then raises, naming
        where they first appear."""
        if issued.ready is not None:
            issued.ready.synchronize()
        tokens, logprobs = issued.host.numpy()
        live = scheduler.batch.live(issued.advanced)
        failing = np.flatnonzero(live & ~np.isfinite(logprobs))
        if len(failing):
            self._raise_nonfinite(issued, scheduler.batch, failing.tolist())
        if not issued.step.is_prefill:
            kept = int(live.sum())
            self.stats["decode_tokens"] += kept
            self.stats["dropped_tokens"] += len(live) - kept
        return scheduler.finish(issued.advanced, tokens.astype(np.int64), logprobs.astype(np.float32), ran_ahead,
                                None if self.states is None else self.states.save)

    def _run(self, step: Step, batch: DecodeBatch) -> torch.Tensor:
        """The model's float32 logits for the step: one row per prefilled sequence, or per running one."""
        self.stats["steps"] += 1
        if step.is_prefill:
            self.stats["prefill_tokens"] += sum(len(s) - s.num_cached for s in step.seqs)
            self.cache.copy_blocks(step.copies)  # an episode's next turn writes into a block its group shared
            # The sequences that decode from the prefill start from its states: a group's samples fork its prompt's.
            logits = self.runner.prefill(step.seqs, step.slots, [s.decode_row for s in step.sampling], step.logit_rows)
            for s in step.seqs:  # a continued episode's kept recurrent state is in its row now (a locating rerun
                s.kept_state = None  # of this prefill, after non-finite logits, starts it from zero)
            return logits
        return self.runner.decode(batch, step.copies)

    def _prepare(self, index: int, r: Request, params: SamplingParams) -> PromptState:
        """Validate a request up front (bad input fails before any work starts; its
        pixels are checked against their grids where the vision tower takes them,
        at the prompt's first prefill: `prepare_vision`)."""
        if r.n < 1:
            raise ValueError(f"request {index}: n must be >= 1, got {r.n}")
        p = r.prompt
        if len(p.input_ids) == 0:
            raise ValueError(f"request {index}: empty prompt")
        if len(p.input_ids) >= self.max_model_len:
            raise ValueError(f"request {index}: prompt of {len(p.input_ids)} tokens does not fit the model's "
                             f"maximum length {self.max_model_len} (with room for one generated token)")
        try:
            positions, delta = mrope_positions(p.input_ids.to(self.device), self.model.args.rope_spec,
                                               _on(p.image_grid_thw, self.device), _on(p.video_grid_thw, self.device),
                                               p.second_per_grid_ts)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        if r.max_tokens is not None and r.max_tokens < 1:
            raise ValueError(f"request {index}: max_tokens must be >= 1, got {r.max_tokens}")
        longest = min(len(p.input_ids) + (r.max_tokens or params.max_tokens), self.max_model_len)
        needed = -(-longest // self.cache.block_size)
        if needed > self.cache.num_blocks:
            raise ValueError(f"the KV pool ({self.cache.num_blocks} blocks of {self.cache.block_size} tokens) cannot "
                             f"hold one sequence of request {index} ({longest} tokens, {needed} blocks); raise "
                             "kv_cache_memory / num_blocks or lower max_tokens")
        return PromptState(index, r, positions, delta, _seeds(index, r, params), longest, vision=r.vision,
                           samples=[None] * r.n)

    def _sample(self, logits: torch.Tensor, step: Step, batch: DecodeBatch,
                params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's sampled tokens and their logprobs, on the device."""
        if step.logit_rows is not None:
            logits = logits[to_device(step.logit_rows, logits.device)]
        # One value per parameter for every row: the sampler skips what they make needless.
        return sample(logits, params.temperature, params.top_p, params.top_k, batch.uniforms(step.first),
                      truncate=params.top_p < 1 or params.top_k > 0)

    def _raise_nonfinite(self, issued: _Issued, batch: DecodeBatch, rows: list[int]) -> NoReturn:
        """Raise for the non-finite logits of `rows` (indices into the issued step's sampling)."""
        step = issued.step
        if step.is_prefill:
            where = self._locate_in_prefill(step.seqs, step.slots, sorted({step.logit_rows[r] for r in rows}))
        else:
            batch.rewind(issued.advanced)
            where = self._locate_in_decode(batch, batch.running_index[issued.advanced.rows[rows]].tolist())
        # The pool may hold non-finite K/V now, which a later generation would read through its masked slots.
        self.release_kv()
        raise NonFiniteLogitsError("prefill" if step.is_prefill else "decode", issued.index,
                                   [(step.sampling[r].prompt.index, step.sampling[r].sample_index) for r in rows],
                                   where)

    def _locate_in_prefill(self, seqs: list[Sequence], slots: list[list[int]], failing: list[int]) -> str:
        """Where the logits of prefilled sequences `failing` (indices into `seqs`) turn
        non-finite: the prefill again, checked on those sequences' tokens."""
        starts = list(itertools.accumulate([0] + [len(s) - s.num_cached for s in seqs]))
        tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in failing]).to(self.device)
        return first_nonfinite_stage(self.model, lambda: self.runner.prefill(seqs, slots), tokens,
                                     torch.tensor(failing, device=self.device),
                                     [seqs[i].prompt.vision for i in failing])

    def _locate_in_decode(self, batch: DecodeBatch, failing: list[int]) -> str:
        """Where the logits of running sequences `failing` turn non-finite: the decode
        step again, eager (hooks do not run inside a CUDA graph), from the same inputs."""
        rows = torch.tensor(failing, device=self.device)
        graphs, self.runner.use_cuda_graphs = self.runner.use_cuda_graphs, False
        try:
            return first_nonfinite_stage(self.model, lambda: self.runner.decode(batch, []), rows, rows)
        finally:
            self.runner.use_cuda_graphs = graphs


@dataclass
class _Issued:
    """A step run and sampled, its tokens issued to the decode batch, on their way to the host."""

    step: Step
    index: int  # the generation's step count before it
    advanced: Advanced
    host: torch.Tensor  # (2, rows) float64: the tokens and their logprobs, on the host once `ready`
    ready: torch.cuda.Event | None  # None: already there (CPU)


def _group(p: PromptState) -> Group:
    return Group(p.request.prompt, list(p.samples), p.vision)


def _seeds(index: int, r: Request, params: SamplingParams) -> list[int]:
    """One sampling seed per child of request `index`."""
    if r.seed is not None:  # e.g. the RL loop: a prompt samples the same on any rank
        return [mix_seed(r.seed, j) for j in range(r.n)]
    base = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
    return [mix_seed(base, index, j) for j in range(r.n)]


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
