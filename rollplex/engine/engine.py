"""The decode engine: generate(requests) -> sampled tokens with their logprobs.

The loop, readable in one sitting: schedule a step (prefill or decode), run
the model for it, sample, then postprocess (fork a group's children after its
prompt's prefill, append tokens, finish and free sequences).

The running sequences' state lives in a `DecodeBatch`, persistent tensors
updated in place: a decode step's inputs, its sampled tokens and its stop
checks are a few tensor operations for the whole batch, and Python touches a
sequence only when it needs a block, finishes or is preempted. The step waits
on the device once, to read the sampled tokens back for the stop checks.

The engine runs on the model it is given and never copies its weights: in the
RL loop those weights belong to the trainer.

On CUDA, decode steps (KV block copies, input copies, graph replay, sampling)
run on `decode_stream`, created once per engine at the highest stream priority
and ordered against the caller's stream at each step's start and end; prefill
runs on the caller's stream. The GPU schedules decode kernels ahead of those of
lower-priority streams (the RL loop's prefix work), which fill the rest of it.

A step whose logits hold NaN or inf samples nothing: its sampled logprobs, read
back with its tokens, are then non-finite, and the engine raises a
`NonFiniteLogitsError` naming the step, the samples and the first layer whose
output is non-finite for them (rollplex.engine.nonfinite).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rollplex.engine.block_manager import BlockManager
from rollplex.engine.decode_batch import DecodeBatch
from rollplex.engine.kv_cache import KVCache
from rollplex.engine.nonfinite import NonFiniteLogitsError, first_nonfinite_stage
from rollplex.engine.runner import ModelRunner
from rollplex.engine.sampler import SamplingParams, sample
from rollplex.engine.scheduler import Scheduler, Step
from rollplex.engine.sequence import PromptState, Request, RequestOutput, Sample, Sequence
from rollplex.models.qwen2_5_vl import Qwen2_5_VL, check_pixels, mrope_for


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_memory: float = 0.3  # <= 1: fraction of free device memory; > 1: bytes
    num_blocks: int | None = None  # set the pool size directly (overrides kv_cache_memory)
    max_num_seqs: int = 256  # sequences decoding at once (and the largest CUDA-graph batch)
    max_num_batched_tokens: int = 16384  # prefill tokens per step (a longer prompt runs alone)
    max_model_len: int = 8192  # prompt + generation, capped by the model's max_position_embeddings
    enforce_eager: bool = False  # no CUDA graphs
    progress: bool = True  # progress line on stderr for long generations (rank 0)

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory must be > 0, got {self.kv_cache_memory}")


class Engine:
    def __init__(self, model: Qwen2_5_VL, config: EngineConfig | None = None):
        self.model, self.config = model, config or EngineConfig()
        cfg, text = self.config, model.args.text
        self.max_model_len = min(cfg.max_model_len, text.max_position_embeddings)
        self.device = model.device
        self.dtype = model.language_model.embed_tokens.weight.dtype
        # Read the KV width off the weights: under tensor parallelism k_proj holds this rank's heads only.
        k_proj = model.language_model.layers[0].self_attn.k_proj.weight
        kv_heads = _local_rows(k_proj) // text.head_dim
        self.cache = KVCache(text.num_hidden_layers, self._num_blocks(kv_heads), cfg.block_size, kv_heads,
                             text.head_dim, self.dtype, self.device)
        self.runner = ModelRunner(model, self.cache, self.max_model_len, cfg.max_num_seqs,
                                  use_cuda_graphs=not cfg.enforce_eager)
        eos = model.args.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.stats: dict[str, float] = {}

    def _num_blocks(self, kv_heads: int) -> int:
        cfg, text = self.config, self.model.args.text
        per_block = KVCache.bytes_per_block(text.num_hidden_layers, cfg.block_size, kv_heads, text.head_dim,
                                            self.dtype)
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)  # more could never be used
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        budget = cfg.kv_cache_memory if cfg.kv_cache_memory > 1 else cfg.kv_cache_memory * free_memory(self.device)
        return max(1, min(useful, int(budget) // per_block))

    @property
    def decode_stream(self) -> torch.cuda.Stream | None:
        """The high-priority CUDA stream decode steps run on (None on CPU)."""
        return self.runner.decode_stream

    # ------------------------------------------------------------------ memory between phases

    def release_kv(self) -> None:
        """Free the KV pool (before the training phase); `generate` allocates it again."""
        self.cache.release()

    # ------------------------------------------------------------------ generate

    def generate(self, requests: list[Request], params: SamplingParams | None = None,
                 between_steps: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Sample every request's n responses. `between_steps(running)`, when
        given, is called after each engine step with the number of sequences
        still decoding: the RL loop's prefix scheduler runs its work there."""
        params = params or SamplingParams()
        prompts = [self._prepare(i, r, params) for i, r in enumerate(requests)]
        self.cache.allocate(self.blocks_for(requests, params))
        self.runner.storage_may_have_moved = True
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        scheduler = self._scheduler(prompts, stop_ids)
        blocks, batch = scheduler.blocks, scheduler.batch
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "steps": 0}
        captures, capture_seconds = self.runner.captures, self.runner.capture_seconds
        progress = _Progress(sum(r.n for r in requests), enabled=self.config.progress and _is_rank0())
        samples_done = 0
        while scheduler.has_work():
            step = scheduler.schedule()
            self.stats["steps"] += 1
            if step.is_prefill:
                slots = [blocks.slots(s.block_table, 0, len(s)) for s in step.seqs]
                logits = self.runner.prefill(step.seqs, slots)
                self.stats["prefill_tokens"] += sum(len(s) for s in step.seqs)
                finished = self._after_prefill(step, slots, logits, scheduler, params)
            else:
                with self.runner.on_decode_stream():
                    logits = self.runner.decode(batch, step.copies)
                    tokens, logprobs = self._sample(logits, batch.uniforms(), params)
                    logprobs = self._checked(logprobs, step, batch.seqs,
                                             lambda rows: self._locate_in_decode(batch, rows))
                    finished = scheduler.append(tokens, logprobs)
                self.stats["decode_tokens"] += len(step.seqs)
            for s in finished:
                self._record(s, stop_ids)
            samples_done += len(finished)
            progress.update(samples_done, self.stats["decode_tokens"])
            if between_steps is not None and scheduler.has_work():
                between_steps(len(scheduler.running))
        progress.close()
        self.stats["preemptions"] = scheduler.num_preemptions
        # A new pool (or moved weights) means new graphs: inside this generation's time.
        self.stats["graph_captures"] = self.runner.captures - captures
        self.stats["graph_capture_s"] = self.runner.capture_seconds - capture_seconds
        assert blocks.num_free == self.cache.num_blocks, "KV blocks leaked"
        return [RequestOutput(list(p.request.prompt_ids), list(p.samples), p.vision, p.rope_delta) for p in prompts]

    def _scheduler(self, prompts: list[PromptState], stop_ids: set[int]) -> Scheduler:
        """A scheduler over a new block manager and decode batch, with every prompt waiting."""
        blocks = BlockManager(self.cache.num_blocks, self.cache.block_size)
        # A group larger than max_num_seqs still runs, alone.
        rows = max([self.config.max_num_seqs] + [p.request.n for p in prompts])
        batch = DecodeBatch(prompts, rows, self.runner.max_blocks, self.cache.sink_block, stop_ids, self.device)
        scheduler = Scheduler(blocks, batch, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        for p in prompts:
            scheduler.add(Sequence(p, -1, list(p.request.prompt_ids)))
        return scheduler

    def blocks_for(self, requests: list[Request], params: SamplingParams) -> int:
        """The KV pool a generation gets: what its samples could fill at full length,
        not counting the prompt blocks they share, at most the configured pool. A
        small batch leaves the rest of the memory to other work (the RL loop's prompt
        work in the decode window), and the size depends on the requests only, so
        every rank of a TP group gets the same pool."""
        bs = self.cache.block_size
        need = sum(r.n * -(-min(len(r.prompt_ids) + (r.max_tokens or params.max_tokens), self.max_model_len) // bs)
                   for r in requests)
        return max(1, min(self.cache.capacity, need))

    def _prepare(self, index: int, r: Request, params: SamplingParams) -> PromptState:
        """Validate a request up front (bad input fails before any work starts)."""
        if r.n < 1:
            raise ValueError(f"request {index}: n must be >= 1, got {r.n}")
        if not r.prompt_ids:
            raise ValueError(f"request {index}: empty prompt")
        if len(r.prompt_ids) >= self.max_model_len:
            raise ValueError(f"request {index}: prompt of {len(r.prompt_ids)} tokens does not fit the model's "
                             f"maximum length {self.max_model_len} (with room for one generated token)")
        vision = self.model.args.vision
        if r.pixel_values is not None:
            check_pixels(r.pixel_values, r.image_grid_thw, vision, "image")
        if r.pixel_values_videos is not None:
            check_pixels(r.pixel_values_videos, r.video_grid_thw, vision, "video")
        ids = torch.tensor(r.prompt_ids, device=self.device)
        try:
            positions, delta = mrope_for(self.model.args, ids, _on(r.image_grid_thw, self.device),
                                         _on(r.video_grid_thw, self.device), r.second_per_grid_ts)
        except ValueError as e:
            raise ValueError(f"request {index}: {e}") from None
        if r.max_tokens is not None and r.max_tokens < 1:
            raise ValueError(f"request {index}: max_tokens must be >= 1, got {r.max_tokens}")
        longest = min(len(r.prompt_ids) + (r.max_tokens or params.max_tokens), self.max_model_len)
        needed = -(-longest // self.cache.block_size)
        if needed > self.cache.capacity:
            raise ValueError(f"the KV pool ({self.cache.capacity} blocks of {self.cache.block_size} tokens) cannot "
                             f"hold one sequence of request {index} ({longest} tokens, {needed} blocks); raise "
                             "kv_cache_memory / num_blocks or lower max_tokens")
        if r.seed is not None:  # e.g. the RL loop: a prompt samples the same on any rank
            seeds = [mix_seed(r.seed, j) for j in range(r.n)]
        else:
            base = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
            seeds = [mix_seed(base, index, j) for j in range(r.n)]
        return PromptState(index, r, positions, delta, seeds, longest, vision=r.vision, samples=[None] * r.n)

    def _after_prefill(self, step: Step, slots: list[list[int]], logits: torch.Tensor, scheduler: Scheduler,
                       params: SamplingParams) -> list[Sequence]:
        """Sample the next token of every prefilled sequence; returns those that
        finished. A group's prompt gives each of its n children a first token, and
        the children take over its blocks (shared, copy-on-write on the last partial one)."""
        seqs, blocks = step.seqs, scheduler.blocks
        rows, decoding = [], []
        for i, s in enumerate(seqs):
            n = s.prompt.request.n if s.is_group_prompt else 1
            rows += [i] * n
            decoding += ([Sequence(s.prompt, j, list(s.token_ids), blocks.fork(s.block_table)) for j in range(n)]
                         if s.is_group_prompt else [s])
        for s in seqs:
            if s.is_group_prompt:
                blocks.free(s.block_table)
        first = scheduler.start(decoding)
        tokens, logprobs = self._sample(logits[torch.tensor(rows, device=logits.device)],
                                        scheduler.batch.uniforms(first), params)
        logprobs = self._checked(logprobs, step, decoding,
                                 lambda bad: self._locate_in_prefill(seqs, slots, sorted({rows[r] for r in bad})))
        return scheduler.append(tokens, logprobs, first)

    def _checked(self, logprobs: torch.Tensor, step: Step, seqs: list[Sequence],
                 locate: Callable[[list[int]], str]) -> torch.Tensor:
        """The step's sampled logprobs (one per sequence of `seqs`), read back to the host:
        the step's wait on the device, after which the batch reads its tokens back at
        once. A non-finite one means NaN or inf in its logits (rollplex.engine.nonfinite):
        then `locate(rows)` names where they first appear, and the step raises."""
        host = logprobs.cpu()
        if torch.isfinite(host).all():
            return host
        rows = (~torch.isfinite(host)).nonzero().flatten().tolist()
        where = locate(rows)
        # The pool may hold non-finite K/V now, which a later generation would read through its masked slots.
        self.release_kv()
        raise NonFiniteLogitsError("prefill" if step.is_prefill else "decode", self.stats["steps"] - 1,
                                   [(seqs[r].prompt.index, seqs[r].sample_index) for r in rows], where)

    def _locate_in_prefill(self, seqs: list[Sequence], slots: list[list[int]], failing: list[int]) -> str:
        """Where the logits of prefilled sequences `failing` (indices into `seqs`) turn
        non-finite: the prefill again, checked on those sequences' tokens."""
        starts = list(itertools.accumulate([0] + [len(s) for s in seqs]))
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

    def _sample(self, logits: torch.Tensor, uniforms: torch.Tensor,
                params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        # One value per parameter for every row: the sampler skips what they make needless.
        return sample(logits, params.temperature, params.top_p, params.top_k, uniforms,
                      truncate=params.top_p < 1 or params.top_k > 0)

    @staticmethod
    def _record(seq: Sequence, stop_ids: set[int]) -> None:
        """Record a finished sequence's sample."""
        reason = "stop" if seq.token_ids[-1] in stop_ids else "length"
        seq.prompt.samples[seq.sample_index] = Sample(seq.token_ids[seq.num_prompt:], seq.logprobs, reason)


def mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64 steps), so each child of each
    request gets its own stream from one user seed."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1


def _local_rows(weight: torch.Tensor) -> int:
    return weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors: on CUDA the device's free memory plus what the
    caching allocator holds but no tensor uses (last rollout's KV pool, say); on
    CPU the available RAM."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class _Progress:
    """A one-line progress display (samples done, output tokens/s) for generations
    that last more than a couple of seconds, on an interactive stderr."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self.start = self.last = time.perf_counter()
        self.shown = False

    def update(self, done: int, tokens: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.5 or now - self.start < 2.0:
            return
        self.last, self.shown = now, True
        rate = tokens / (now - self.start)
        sys.stderr.write(f"\rgenerate: {done}/{self.total} samples, {rate:,.0f} tok/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
