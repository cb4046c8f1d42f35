"""Memory plan: per-GPU bytes of every large tensor class, phase by phase, and
the sizes it decides.

Every large tensor has a lifetime, from its first use to its last (see
shared/DESIGN.md, "Memory by phase"). A colocated system that frees nothing
holds the rollout's state (KV pool, the engine's gathered weights) and the
trainer's (master weights, gradients, AdamW moments) at once, so its peak is
their sum. Rollplex holds each class only within its lifetime, so each phase
pays only for what it uses. This module computes both, for a model shape, a
parallel layout and a batch.

Phases, as the loop runs them (`loop_phase_bytes` maps them onto the loop's
measured `perf/max_memory_allocated_gb/<phase>`):
    rollout    prefill and decode (the engine's weights, KV pool and workspace)
    prefix     the prompt work (reference / actor / old prompt forwards), its
               state accumulating: in the decode window beside the KV pool
               (overlap), or after rollout (serial with share_prefix)
    logprobs   reference and old-policy logprob passes (no gradients)
    train      the actor's forward and backward passes
    optimizer  the AdamW step

The plan also decides the sizes a run leaves to it (`size_memory`): the KV
pool, the prefix budget and the training micro-batch, from the device's memory
less a headroom for what it does not count (`UNCOUNTED_FRACTION`).

One estimator per tensor class, used by the plan and by the run itself: the
prefix scheduler admits prompt work by `prefix_state` and `admitted`, the
functions the plan sums. Exact (closed formulas on the model's shape):
parameters, gradients, optimizer state, KV pool, prompt K/V, vision embeddings.
Estimated, from the tensors the model's code saves for backward (checked against
CPU measurements in tests/test_memory.py): activations, the prefix graph, and
the transient working memory of the engine and the prompt slices (`workspace`)
and of the logprob and training passes (`activations`).
"""

from __future__ import annotations

import gc
import math
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import accumulate

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from rollplex.engine.engine import EngineConfig
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs

GiB = 1 << 30

# What the plan does not count, as a fraction of the device's memory: the caching allocator's
# fragmentation (reserved but not allocated), library workspaces (cuBLAS, NCCL buffers), the CUDA
# context, and the error of the estimates. Sizes are decided within the rest (`usable_bytes`).
UNCOUNTED_FRACTION = 0.1

PHASES = ("rollout", "prefix", "logprobs", "train", "optimizer")
TENSOR_CLASSES = ("params_sharded", "optimizer_state", "ref_params", "params_gathered", "grads", "kv_pool",
                  "vision_embeds", "prompt_kv", "prefix_graph", "workspace", "activations")
PREFIX_KINDS = frozenset({"ref", "actor", "old"})
SCHEDULES = ("overlap", "serial-prefix", "serial-naive")
PREFILL_TOKENS = EngineConfig.max_num_batched_tokens  # the engine's prefill tokens per step (the loop's setting)
FP32 = 4  # bytes: RMSNorm and the loss work in float32 whatever the model's dtype


class MemoryPlanError(ValueError):
    """The run's shapes cannot fit the device, whatever the sizes: names what does not fit."""


def _preset(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tie: bool,
            vision_inter: int) -> ModelArgs:
    text = TextArgs(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads)
    return ModelArgs(vision=VisionArgs(intermediate_size=vision_inter, out_hidden_size=hidden), text=text,
                     tie_word_embeddings=tie)


# The hub's config.json values of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct. The vision tower is depth 32,
# width 1280, 16 heads, out_hidden_size = the LM width; its MLP is 3420 wide in 3B/7B and 3456 in 32B/72B.
# Totals: 3,754,622,976 / 8,292,166,656 / 33,452,718,336 / 73,410,777,344 parameters.
PRESETS: dict[str, ModelArgs] = {
    "qwen2.5-vl-3b": _preset(151936, 2048, 11008, 36, 16, 2, tie=True, vision_inter=3420),
    "qwen2.5-vl-7b": _preset(152064, 3584, 18944, 28, 28, 4, tie=False, vision_inter=3420),
    "qwen2.5-vl-32b": _preset(152064, 5120, 27648, 64, 40, 8, tie=False, vision_inter=3456),
    "qwen2.5-vl-72b": _preset(152064, 8192, 29568, 80, 64, 8, tie=False, vision_inter=3456),
}


# ----------------------------------------------------------------------------- inputs


@dataclass
class ParallelLayout:
    """Where the trainer and the engine live. The trainer's mesh is dp_shard x tp
    over all GPUs; the engine runs world / engine_tp replicas of engine_tp GPUs."""

    dp_shard: int = 1
    tp: int = 1
    engine_tp: int = 1
    nodes: int = 1
    gpus_per_node: int = 1

    def __post_init__(self):
        if self.dp_shard * self.tp != self.world:
            raise ValueError(f"dp_shard {self.dp_shard} x tp {self.tp} must equal the {self.world} GPUs "
                             f"({self.nodes} nodes x {self.gpus_per_node})")
        if self.world % self.engine_tp:
            raise ValueError(f"engine_tp {self.engine_tp} does not divide the {self.world} GPUs")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def engine_replicas(self) -> int:
        return self.world // self.engine_tp


@dataclass
class BatchShape:
    """One RL step's batch. A prompt's sequence is `prompt_tokens` text tokens
    plus `vision_tokens` merged vision tokens (image/video pads after the
    merger); its vision tower sees spatial_merge_size**2 patches per vision token."""

    prompts: int  # per step, over all GPUs
    n: int  # samples per prompt (GRPO group size)
    prompt_tokens: int  # text tokens per prompt
    response_tokens: int  # per sample, at full length
    vision_tokens: int = 0  # merged vision tokens per prompt
    longest_prompt: int = 0  # tokens of the longest prompt a batch may hold (0: prompt_len)

    def __post_init__(self):
        if min(self.prompts, self.n, self.response_tokens, self.prompt_len) < 1 or self.vision_tokens < 0:
            raise ValueError(f"a batch needs prompts, samples, response and prompt tokens: {self}")

    @property
    def prompt_len(self) -> int:
        return self.prompt_tokens + self.vision_tokens

    @property
    def sequence_len(self) -> int:
        return self.prompt_len + self.response_tokens

    @property
    def longest_sequence(self) -> int:
        """The fewest tokens a micro-batch may hold: the actor never splits a sequence."""
        return max(self.longest_prompt, self.prompt_len) + self.response_tokens

    def vision_patches(self, args: ModelArgs) -> int:
        return self.vision_tokens * args.vision.spatial_merge_size ** 2


@dataclass
class MemoryOptions:
    """Dtypes, which optional tensors exist, the schedule, and the sizes (None: the plan decides)."""

    param_dtype: torch.dtype = torch.bfloat16  # gathered weights, KV, activations
    master_dtype: torch.dtype = torch.float32  # the sharded weights the optimizer updates
    grad_dtype: torch.dtype = torch.float32  # sharded gradients (FSDP reduces in fp32)
    optimizer_dtype: torch.dtype = torch.float32  # AdamW's two moments
    ref_model: bool = False  # kl_coef > 0: a frozen reference copy, sharded like the actor
    ref_dtype: torch.dtype = torch.bfloat16  # frozen, so bf16 suffices (the loop loads it in model.dtype)
    recompute_old_logprobs: bool = False  # the old policy's prefix KV is kept too
    offload_optimizer: bool = False  # AdamW moments on the host outside the optimizer step
    activation_checkpointing: bool = False
    freeze_vision: bool = False  # no gradients / moments for the vision tower, no graph through it
    schedule: str = "overlap"  # one of SCHEDULES
    updates_per_batch: int = 1  # optimizer steps per batch: the actor's prompt work covers the first only
    entropy: bool = True  # the update computes the entropy bonus (entropy_coef > 0): more logits kept
    attention: str = "torch"  # the training passes' kernels: torch (SDPA, gathers per segment) or flash
    block_size: int = 16  # KV pool block size
    max_num_seqs: int = 256  # the engine's decode batch
    micro_batch_tokens: int | None = None  # trainer token budget per micro-batch
    kv_pool: float | None = None  # the KV pool's capacity: <= 1 a fraction of device_memory, else bytes
    prefix_budget: float | None = None  # kept prompt state per GPU, as kv_pool
    device_memory: int = 80 * GiB  # one GPU's memory

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")

    @property
    def share_prefix(self) -> bool:
        return self.schedule != "serial-naive"

    @classmethod
    def from_config(cls, cfg, param_dtype: torch.dtype, device_memory: int, attention: str) -> "MemoryOptions":
        """A run's options (rollplex.config.Config): its sizes, where set, override the plan's."""
        s = cfg.schedule
        schedule = "overlap" if s.kind == "overlap" else "serial-prefix" if s.share_prefix else "serial-naive"
        return cls(param_dtype=param_dtype, ref_model=cfg.algorithm.kl_coef > 0, ref_dtype=param_dtype,
                   recompute_old_logprobs=cfg.algorithm.recompute_old_logprobs,
                   offload_optimizer=cfg.parallel.offload_optimizer,
                   activation_checkpointing=cfg.parallel.activation_checkpointing,
                   freeze_vision=cfg.parallel.freeze_vision, schedule=schedule,
                   updates_per_batch=cfg.algorithm.updates_per_batch, entropy=cfg.algorithm.entropy_coef > 0,
                   attention=attention, block_size=cfg.rollout.block_size, max_num_seqs=cfg.rollout.max_num_seqs,
                   micro_batch_tokens=cfg.trainer.max_tokens_per_micro_batch or None,
                   kv_pool=cfg.rollout.kv_cache_memory or None, prefix_budget=s.prefix_memory_budget or None,
                   device_memory=device_memory)


def usable_bytes(options: MemoryOptions) -> int:
    """The memory the plan may fill: the device's, less UNCOUNTED_FRACTION of it."""
    return int(options.device_memory * (1 - UNCOUNTED_FRACTION))


def _bytes(fraction_or_bytes: float, device_memory: int) -> int:
    """The config convention: a value <= 1 is a fraction of the device's memory, else bytes."""
    return int(fraction_or_bytes * device_memory if fraction_or_bytes <= 1 else fraction_or_bytes)


# ----------------------------------------------------------------------------- exact counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements by how tensor parallelism and FSDP treat them
    (rollplex.train.parallelize)."""

    total: int
    tp_split: int  # decoder q/k/v/o and MLP linears, embedding and head when untied: 1/tp per rank
    vision: int  # vision tower and merger: replicated over tp
    root: int  # FSDP's root unit (all but decoder layers and vision blocks), at tp 1
    root_tp_split: int  # of which split by tp (the embedding and head when untied)
    layer_tp_split: int  # one decoder layer's tp-split elements (the rest are its two norms)

    def per_tp_rank(self, tp: int) -> int:
        """Elements one rank holds once gathered over dp_shard."""
        return self.tp_split // tp + self.total - self.tp_split

    def root_per_tp_rank(self, tp: int) -> int:
        """The root unit's elements on one rank once gathered over dp_shard."""
        return self.root_tp_split // tp + self.root - self.root_tp_split

    def layer_per_tp_rank(self, tp: int, text: TextArgs) -> int:
        """One decoder layer's elements on one rank once gathered over dp_shard."""
        return self.layer_tp_split // tp + 2 * text.hidden_size


def count_params(args: ModelArgs) -> ParamCounts:
    """Parameter counts from the layer shapes of rollplex.models.qwen2_5_vl (the tests check them against a
    built model and the hub's totals). Counted, not built: a meta-device build pulls in torch._dynamo (~5 s)."""
    v, t = args.vision, args.text
    w, inter, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    # two norms, qkv and proj (with biases), gate/up/down (with biases)
    vision_block = 2 * w + (w + 1) * 3 * w + (w + 1) * w + 2 * (w + 1) * inter + (inter + 1) * w
    # patch embedding (no bias), merger norm and its two linears: in the root unit
    vision_root = w * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 + \
        w + (merged + 1) * merged + (merged + 1) * v.out_hidden_size
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    # q/k/v (with biases), o, gate/up/down: what apply_tp splits; the two norms stay replicated
    split_layer = (t.hidden_size + 1) * (q + 2 * kv) + q * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    embeddings = t.vocab_size * t.hidden_size * (1 if args.tie_word_embeddings else 2)  # + the head when untied
    root_split = 0 if args.tie_word_embeddings else embeddings
    tp_split = t.num_hidden_layers * split_layer + root_split
    root = vision_root + t.hidden_size + embeddings
    total = v.depth * vision_block + t.num_hidden_layers * (split_layer + 2 * t.hidden_size) + root
    return ParamCounts(total, tp_split, v.depth * vision_block + vision_root, root, root_split, split_layer)


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Keys and values of one token in every decoder layer, on one of `tp` ranks."""
    t = args.text
    if t.num_key_value_heads % tp:
        raise ValueError(f"tp {tp} does not divide num_key_value_heads {t.num_key_value_heads}")
    return 2 * t.num_hidden_layers * (t.num_key_value_heads // tp) * t.head_dim * dtype.itemsize


def kv_pool_need(args: ModelArgs, batch: BatchShape, prompts: int, options: MemoryOptions, tp: int) -> int:
    """The KV pool a generation of `prompts` prompts allocates (rollplex.engine.Engine.blocks_for):
    every sample's blocks at full length, plus the sink block."""
    blocks = prompts * batch.n * -(-batch.sequence_len // options.block_size)
    return (blocks + 1) * options.block_size * kv_bytes_per_token(args, options.param_dtype, tp)


# ----------------------------------------------------------------------------- activations


def _norm_bytes(width: int, size: int) -> int:
    """What an RMSNorm keeps per token for backward: its input in float32, the
    normalised value and the output, both in the model's dtype (`size` bytes)."""
    return (FP32 + 2 * size) * width


def _attention_bytes(q_dim: int, kv_dim: int, size: int, attention: str) -> int:
    """Per token, what an attention kernel's backward keeps: q, k, v and the output
    (flash-attn varlen). The torch path gathers q, k and v per segment group, so it
    keeps those copies, the kernel's output and the scattered output."""
    return (3 * q_dim + 2 * kv_dim if attention == "torch" else 2 * q_dim + 2 * kv_dim) * size


def decoder_layer_bytes(t: TextArgs, size: int, tp: int = 1, attention: str = "torch") -> int:
    """Bytes per token one decoder layer keeps for backward: its two norms, its
    attention, and the SwiGLU's gate, silu(gate), up and their product."""
    q, kv, inter = (t.num_attention_heads * t.head_dim // tp, t.num_key_value_heads * t.head_dim // tp,
                    t.intermediate_size // tp)
    return 2 * _norm_bytes(t.hidden_size, size) + _attention_bytes(q, kv, size, attention) + 4 * inter * size


def vision_patch_bytes(v: VisionArgs, size: int, checkpointing: bool, attention: str = "torch") -> int:
    """Bytes per patch the vision tower keeps for backward: every block (its input
    alone with checkpointing) and the merger (its norm, and its two linears'
    inputs: 4 x width per merged token, a quarter of the patches). The patch
    embedding keeps its input, the prepared pixels, which the plan counts with the
    batch's inputs (not at all)."""
    w = v.hidden_size
    block = w * size if checkpointing else \
        2 * _norm_bytes(w, size) + _attention_bytes(w, w, size, attention) + 4 * v.intermediate_size * size
    return v.depth * block + _norm_bytes(w, size) + 2 * w * size


def _decoder_saved(t: TextArgs, size: int, tp: int, options: MemoryOptions) -> int:
    """Per token, what the decoder stack and the final norm keep from forward to
    backward: every layer's saved tensors, or with checkpointing every layer's input."""
    layer = t.hidden_size * size if options.activation_checkpointing else \
        decoder_layer_bytes(t, size, tp, options.attention)
    return t.num_hidden_layers * layer + (FP32 + size) * t.hidden_size


def _layer_forward_bytes(t: TextArgs, size: int, tp: int) -> int:
    """Per token, the working memory of one decoder layer's forward without a
    graph: the residual, its norm in float32, and three SwiGLU intermediates."""
    return (FP32 + size) * t.hidden_size + 3 * t.intermediate_size // tp * size


def _vision_forward_bytes(v: VisionArgs, size: int) -> int:
    """Per patch, the working memory of one vision block's forward without a graph."""
    return (FP32 + size) * v.hidden_size + 3 * v.intermediate_size * size


def _logits_bytes(args: ModelArgs, grad: bool, entropy: bool) -> int:
    """Per response token, the peak of the logits and the loss over them (measured
    with the torch profiler on CPU, in float32 and bfloat16 alike): a pass without
    gradients holds two float32 vocabulary rows (the logits and their
    log-softmax); forward and backward hold up to six with the entropy bonus,
    four without it."""
    rows = (6 if entropy else 4) if grad else 2
    return rows * FP32 * args.text.vocab_size


# ----------------------------------------------------------------------------- prefix state


@dataclass(frozen=True)
class PrefixItem:
    """One prompt forward per chunk of prompts (rollplex.rl.prefix.PrefixWork)."""

    kind: str  # "ref" | "actor" | "old"
    chunk: int
    keep_graph: bool
    reuses_vision: bool  # reads the rollout's cached vision features instead of running the tower


def prefix_items(options: MemoryOptions) -> list[PrefixItem]:
    """A step's prompt work, in admission order: per chunk (one optimizer step's
    prompts) the reference model's forward, then the actor's with its graph
    (first chunk: later chunks train on weights that do not exist yet during
    rollout) or the old policy's (later chunks, when old logprobs are recomputed).
    Items reuse the rollout's vision features where the tower is the rollout's and
    needs no gradient: the old policy always, the others when the tower is frozen."""
    frozen, items = options.freeze_vision, []
    for chunk in range(options.updates_per_batch):
        if options.ref_model:
            items.append(PrefixItem("ref", chunk, False, frozen))
        if chunk == 0:
            items.append(PrefixItem("actor", chunk, True, frozen))
        elif options.recompute_old_logprobs:
            items.append(PrefixItem("old", chunk, False, True))
    return items


@dataclass(frozen=True)
class PrefixState:
    """What one prefix item keeps from its prompt forward to its suffix passes, on one rank."""

    kv: int  # every layer's K/V of the prompt tokens and each prompt's last hidden state (exact)
    graph: int  # the actor's autograd graph: saved activations, vision tower included when it runs (estimate)

    @property
    def total(self) -> int:
        return self.kv + self.graph


def prefix_state(args: ModelArgs, item: PrefixItem, prompts: int, tokens: int, patches: int,
                 options: MemoryOptions, tp: int = 1) -> PrefixState:
    """The estimate the prefix scheduler admits by and the plan sums, for `prompts`
    prompts of `tokens` tokens in all and `patches` vision patches. The K/V are
    kept once per item; with flash-attn the graph saves those same tensors, with
    the torch path it saves its own gathered copies (`decoder_layer_bytes`)."""
    if item.kind not in PREFIX_KINDS:
        raise ValueError(f"unknown prefix kind {item.kind!r}; expected one of {sorted(PREFIX_KINDS)}")
    t, size = args.text, options.param_dtype.itemsize
    kv = tokens * kv_bytes_per_token(args, options.param_dtype, tp) + prompts * t.hidden_size * size
    if not item.keep_graph:
        return PrefixState(kv, 0)
    shared_kv = 0 if options.attention == "torch" or options.activation_checkpointing else \
        t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim // tp * size
    graph = tokens * (_decoder_saved(t, size, tp, options) - shared_kv)
    if not (item.reuses_vision or options.freeze_vision):
        graph += patches * vision_patch_bytes(args.vision, size, options.activation_checkpointing, options.attention)
    return PrefixState(kv, graph)


def admitted(estimates: list[int], budget: int | None) -> list[bool]:
    """Which prefix items a byte budget admits (None: all): in order, each one whose
    estimate fits beside those admitted before it. The rest take the serial path."""
    used, out = 0, []
    for estimate in estimates:
        fits = budget is None or used + estimate <= budget
        used += estimate if fits else 0
        out.append(fits)
    return out


# ----------------------------------------------------------------------------- micro-batches


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch a token budget lets the actor build (rollplex.train.actor)."""

    tokens: int  # through the decoder
    responses: int  # response tokens: logits
    sequences: int  # responses
    prompts: int  # prompts computed in it (0 over kept prompts)
    patches: int  # through the vision tower


def micro_batch(args: ModelArgs, batch: BatchShape, budget: int, groups: int, share_prefix: bool,
                kept: bool) -> MicroBatch:
    """A budget counts a unit's prompt once with its responses (share_prefix) or once
    per response, and kept prompts too, though a pass over them computes responses
    only. Responses may end early, so units pack tighter than at full length: the
    most response tokens a micro-batch can hold is, over the number g of prompts in
    it, the smaller of g full units and the budget less g prompts."""
    per_prompt = batch.n if share_prefix else 1  # responses a prompt's tokens are counted once for
    units = groups * (1 if share_prefix else batch.n)
    best = (0, 1)
    for g in range(1, units + 1):
        room = budget - g * batch.prompt_len
        if room < min(batch.response_tokens, budget):
            break
        best = max(best, (min(g * per_prompt * batch.response_tokens, room), g))
    responses, g = best
    sequences = -(-responses // batch.response_tokens)
    prompts = 0 if kept else g if share_prefix else sequences
    return MicroBatch(responses + prompts * batch.prompt_len, responses, sequences, prompts,
                      prompts * batch.vision_patches(args))


def micro_batch_bytes(args: ModelArgs, mb: MicroBatch, batch: BatchShape, options: MemoryOptions, tp: int,
                      grad: bool) -> int:
    """Peak working memory of one micro-batch's pass: with gradients, every token's
    saved activations (the vision tower's too when it trains), then the larger of
    the logits' peak and one layer's backward; without, the larger of one layer's
    forward and the logits. The torch path also keeps, per response and layer, its
    copy of the prompt's K/V (`PrefixedSegments`)."""
    t, size = args.text, options.param_dtype.itemsize
    logits = mb.responses * _logits_bytes(args, grad, options.entropy)
    if not grad:
        vision = mb.patches * _vision_forward_bytes(args.vision, size)
        return max(mb.tokens * _layer_forward_bytes(t, size, tp), logits, vision) + mb.tokens * t.hidden_size * size
    saved = mb.tokens * _decoder_saved(t, size, tp, options)
    if not options.freeze_vision:
        saved += mb.patches * vision_patch_bytes(args.vision, size, options.activation_checkpointing,
                                                 options.attention)
    if options.attention == "torch" and options.share_prefix:
        saved += mb.sequences * batch.prompt_len * t.num_hidden_layers * \
            2 * t.num_key_value_heads * t.head_dim // tp * size
    return saved + max(logits, mb.tokens * decoder_layer_bytes(t, size, tp, options.attention))


# ----------------------------------------------------------------------------- the plan


@dataclass
class SchedulePlan:
    """One schedule's bytes per GPU, by phase and tensor class (absent = 0)."""

    name: str
    phases: dict[str, dict[str, int]]

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)


@dataclass(frozen=True)
class MemorySizes:
    """What the plan decided, and the rooms a run sizes each step's prefix budget from."""

    usable: int  # the device's memory less UNCOUNTED_FRACTION of it
    kv_pool: int  # the engine's KV pool capacity, bytes
    micro_batch_tokens: int
    prefix_room: int  # bytes the prefix phase leaves for prompt state beside its fixed classes, before any pool
    train_room: int  # bytes the train phase leaves for prompt state beside its largest micro-batch
    pool_in_prefix: bool  # overlap: the decode window holds the pool and the prompt state at once
    prefix_budget: int | None = None  # set by the run (schedule.prefix_memory_budget in bytes): every step's

    def prefix_budget_for(self, pool_bytes: int) -> int:
        """A step's budget for kept prompt state, given the KV pool its rollout allocated."""
        if self.prefix_budget is not None:
            return self.prefix_budget
        return max(0, min(self.prefix_room - (pool_bytes if self.pool_in_prefix else 0), self.train_room))


@dataclass
class MemoryPlan:
    """The inputs, the sizes the plan decided, the parameter counts, and both
    schedules' bytes per GPU."""

    args: ModelArgs
    layout: ParallelLayout
    batch: BatchShape
    options: MemoryOptions
    sizes: MemorySizes
    params: ParamCounts
    naive: SchedulePlan
    rollplex: SchedulePlan
    prompts_per_rank: int  # of a trainer dp rank
    prefix_items: list[PrefixItem]  # a rank's prompt work in a step
    prefix_states: list[PrefixState]  # what each keeps (`prefix_state`)
    admitted: list[bool]  # which of them the step's prefix budget admits (the rest take the serial path)
    prefix_budget: int  # the step's, for this batch's KV pool
    model_name: str = ""

    @property
    def kv_pool_blocks(self) -> int:
        """The engine's pool capacity in blocks: the plan's bytes less the engine's sink block."""
        o = self.options
        block = o.block_size * kv_bytes_per_token(self.args, o.param_dtype, self.layout.engine_tp)
        return max(1, self.sizes.kv_pool // block - 1)


class _Shapes:
    """One rank's quantities for options whose sizes are all set, and the bytes of
    each class in the phases that hold it."""

    def __init__(self, args: ModelArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                 params: ParamCounts):
        self.args, self.layout, self.batch, self.o, self.params = args, layout, batch, options, params
        self.size = options.param_dtype.itemsize
        self.prompts_per_rank = math.ceil(batch.prompts / layout.dp_shard)
        self.prompts_per_engine = math.ceil(batch.prompts / layout.engine_replicas)
        self.chunk_prompts = math.ceil(self.prompts_per_rank / options.updates_per_batch)
        self.patches = batch.vision_patches(args)
        self.items = prefix_items(options) if options.share_prefix else []
        self.states = [prefix_state(args, i, self.chunk_prompts, self.chunk_prompts * batch.prompt_len,
                                    self.chunk_prompts * self.patches, options, layout.tp) for i in self.items]

    def resident(self) -> dict[str, int]:
        """Held all step: master weights, AdamW moments (unless offloaded), the reference weights."""
        o, shard = self.o, math.ceil(self.params.per_tp_rank(self.layout.tp) / self.layout.dp_shard)
        out = dict(params_sharded=shard * o.master_dtype.itemsize,
                   optimizer_state=0 if o.offload_optimizer else self.moments())
        if o.ref_model:
            out["ref_params"] = shard * o.ref_dtype.itemsize
        return out

    def trainable_shard(self) -> int:
        p, lay = self.params, self.layout
        return math.ceil((p.per_tp_rank(lay.tp) - (p.vision if self.o.freeze_vision else 0)) / lay.dp_shard)

    def moments(self) -> int:
        return 2 * self.trainable_shard() * self.o.optimizer_dtype.itemsize

    def grads(self) -> int:
        return self.trainable_shard() * self.o.grad_dtype.itemsize

    def kv_pool(self, prompts: int | None = None) -> int:
        """The pool a generation allocates: its prompts' need, at most the capacity."""
        need = kv_pool_need(self.args, self.batch, prompts or self.prompts_per_engine, self.o, self.layout.engine_tp)
        return min(need, int(self.o.kv_pool))

    def engine_weights(self) -> int:
        return self.params.per_tp_rank(self.layout.engine_tp) * self.size

    def prefix_weights(self) -> int:
        """The rollout's gathered weights; with engine_tp != tp the prompt work also needs the trainer's."""
        trainer = self.params.per_tp_rank(self.layout.tp) * self.size
        return self.engine_weights() + (trainer if self.layout.engine_tp != self.layout.tp else 0)

    def root_weights(self, dtype: torch.dtype) -> int:
        """FSDP's root unit gathered (embedding, head, final norm, vision patch embedding and merger): FSDP
        keeps it from a forward to the end of the backward."""
        return self.params.root_per_tp_rank(self.layout.tp) * dtype.itemsize

    def pass_weights(self, dtype: torch.dtype) -> int:
        """Gathered weights during a training or logprob pass: the root unit and the decoder layer computing."""
        layer = self.params.layer_per_tp_rank(self.layout.tp, self.args.text)
        return self.root_weights(dtype) + layer * dtype.itemsize

    def vision_embeds(self) -> int:
        """The rollout's cached vision features (schedules with prompt work), kept to the step's end."""
        if not self.o.share_prefix:
            return 0
        return self.prompts_per_rank * self.batch.vision_tokens * self.args.text.hidden_size * self.size

    def engine_workspace(self) -> int:
        """The engine's transient memory: a prefill step's layer (and the vision tower
        over its prompts when their features are not cached), or a decode step's
        float32 logits and the sampler's vocabulary-wide temporaries over the batch."""
        b, size = self.batch, self.size
        prompts = max(1, min(self.prompts_per_engine, PREFILL_TOKENS // b.prompt_len))
        prefill = prompts * b.prompt_len * _layer_forward_bytes(self.args.text, size, self.layout.engine_tp)
        if not self.o.share_prefix:
            prefill = max(prefill, prompts * self.patches * _vision_forward_bytes(self.args.vision, size))
        decode = min(self.o.max_num_seqs, self.prompts_per_engine * b.n) * self.args.text.vocab_size * 4 * FP32
        return max(prefill, decode)

    def slice_workspace(self, admitted: list[bool]) -> int:
        """An admitted item's working memory in one slice without a graph (a graph's
        slices are counted in the graph): one layer's forward over its chunk, or the
        tower's over its patches."""
        no_graph = [i for i, a in zip(self.items, admitted) if a and not i.keep_graph]
        if not no_graph:
            return 0
        vision = 0 if all(i.reuses_vision for i in no_graph) else \
            self.chunk_prompts * self.patches * _vision_forward_bytes(self.args.vision, self.size)
        tokens = self.chunk_prompts * self.batch.prompt_len
        return max(tokens * _layer_forward_bytes(self.args.text, self.size, self.layout.tp), vision)

    def prefix_state(self, admitted: list[bool], graphs: bool = True) -> dict[str, int]:
        states = [s for s, a in zip(self.states, admitted) if a]
        return dict(prompt_kv=sum(s.kv for s in states), prefix_graph=sum(s.graph for s in states) if graphs else 0,
                    vision_embeds=self.vision_embeds())

    def micro_batch(self, kept: bool) -> MicroBatch:
        return micro_batch(self.args, self.batch, self.o.micro_batch_tokens, self.chunk_prompts, self.o.share_prefix,
                           kept)

    def pass_bytes(self, kept: bool, grad: bool) -> int:
        """A micro-batch's working memory (`micro_batch_bytes`) at the options' token budget."""
        return micro_batch_bytes(self.args, self.micro_batch(kept), self.batch, self.o, self.layout.tp, grad)

    def micro_batches(self, kept: bool) -> int:
        """Micro-batches of an optimizer step: its chunk's response tokens over a micro-batch's."""
        return math.ceil(self.chunk_prompts * self.batch.n * self.batch.response_tokens /
                         max(1, self.micro_batch(kept).responses))


def _rollout_phases(s: _Shapes, admitted: list[bool], base: dict[str, int]) -> dict[str, dict[str, int]]:
    """Rollout, and the prompt work: in the decode window beside the KV pool (overlap, the
    engine's steps and the slices alternating), or after rollout without it (serial)."""
    rollout = dict(base, params_gathered=s.engine_weights(), kv_pool=s.kv_pool(), vision_embeds=s.vision_embeds(),
                   workspace=s.engine_workspace())
    if not s.o.share_prefix:
        return {"rollout": rollout}
    # The reference model's root unit stays gathered from its prompt forward to its logprob passes.
    ref_root = s.pass_weights(s.o.ref_dtype) if any(a and i.kind == "ref" for i, a in zip(s.items, admitted)) else 0
    work = dict(s.prefix_state(admitted), params_gathered=s.prefix_weights() + ref_root)
    if s.o.schedule == "overlap":
        prefix = dict(rollout, **work, workspace=max(rollout["workspace"], s.slice_workspace(admitted)))
    else:
        prefix = dict(base, **work, workspace=s.slice_workspace(admitted))
    return {"rollout": rollout, "prefix": prefix}


def _logprobs(s: _Shapes, admitted: list[bool], base: dict[str, int]) -> dict[str, int]:
    """Reference or old-policy passes, without gradients: suffix-only where every
    prompt's state was kept, else full passes."""
    o = s.o
    if not (o.ref_model or o.recompute_old_logprobs):
        return {}
    kept = bool(s.items) and all(admitted)
    return dict(base, params_gathered=s.pass_weights(o.ref_dtype if o.ref_model else o.param_dtype),
                **s.prefix_state(admitted), activations=s.pass_bytes(kept, grad=False))


def _train(s: _Shapes, admitted: list[bool], base: dict[str, int]) -> dict[str, int]:
    """The actor's update, at its largest of:
    - a micro-batch's backward start: its saved activations and the logits' peak
      beside the gathered root unit and the head's gradient (the step's sharded
      gradients exist from its second micro-batch on);
    - a backward's end: every sharded gradient beside the root unit's unsharded ones;
    - over kept prompts, the prompts' backward start: the gradients the suffix
      passes gathered at the boundary, one layer's backward over the prompt tokens.
    The first optimizer step keeps the actor's graph; a later one (full passes) has
    only the other items' K/V."""
    o, grads = s.o, s.grads()
    root_grads = s.root_weights(o.param_dtype)
    actor = next((st for i, st, a in zip(s.items, s.states, admitted) if a and i.kind == "actor"), None)

    def update(state: dict[str, int], kept: bool) -> list[dict[str, int]]:
        in_pass = dict(base, **state, params_gathered=s.pass_weights(o.param_dtype),
                       grads=root_grads + (grads if s.micro_batches(kept) > 1 else 0),
                       activations=s.pass_bytes(kept, grad=True))
        return [in_pass, dict(base, **state, grads=grads + root_grads)]

    candidates = update(s.prefix_state(admitted), actor is not None)
    if actor is not None:
        layer = decoder_layer_bytes(s.args.text, s.size, s.layout.tp, o.attention)
        candidates.append(dict(base, **s.prefix_state(admitted), params_gathered=s.pass_weights(o.param_dtype),
                               grads=grads, activations=actor.kv + s.chunk_prompts * s.batch.prompt_len * layer))
    if o.updates_per_batch > 1:
        candidates += update(s.prefix_state(admitted, graphs=False), False)
    return max(candidates, key=_total)


def _phases(s: _Shapes, admitted: list[bool]) -> dict[str, dict[str, int]]:
    """Rollplex's phases: each class within its lifetime (a phase the schedule does not run is empty)."""
    base = s.resident()
    phases = _rollout_phases(s, admitted, base)
    phases["logprobs"] = _logprobs(s, admitted, base)
    phases["train"] = _train(s, admitted, base)
    phases["optimizer"] = dict(base, grads=s.grads(), optimizer_state=s.moments())
    return {p: phases.get(p, {}) for p in PHASES}


def _total(phase: dict[str, int]) -> int:
    return sum(phase.values())


# ----------------------------------------------------------------------------- sizing


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest value in [low, high] for which `fits` holds (it holds for all below), else low."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2 ** 20:.1f} MiB"


def _does_not_fit(what: str, need: int, phase: dict[str, int], usable: int, knobs: str) -> MemoryPlanError:
    held = ", ".join(f"{c} {_fmt(b)}" for c, b in sorted(phase.items(), key=lambda cb: -cb[1]) if b)
    return MemoryPlanError(f"{what} needs {_fmt(need)}, but its phase holds {_fmt(_total(phase))} beside it "
                           f"({held}) in {_fmt(usable)} usable (the device's memory less {UNCOUNTED_FRACTION:.0%}). "
                           f"To fit: {knobs}")


_FEWER_BYTES = ("shard the model over more GPUs (parallel.dp_shard, parallel.tp), set parallel.offload_optimizer, "
                "or give a larger trainer.device_memory")


def _size_pool(s: _Shapes, usable: int) -> int:
    """The KV pool: the batch's need at full length, at most what the rollout (and
    the overlap's decode window, before any prompt state) leaves beside its fixed
    classes; at least one prompt's samples."""
    fixed = _phases(s, [False] * len(s.items))
    held = max((fixed[p] for p in ("rollout", "prefix") if fixed[p]), key=_total)
    one_prompt = kv_pool_need(s.args, s.batch, 1, s.o, s.layout.engine_tp)
    if usable - _total(held) < one_prompt:
        raise _does_not_fit(f"the KV pool for one prompt's {s.batch.n} samples", one_prompt, held, usable,
                            f"lower rollout.n or rollout.max_tokens, {_FEWER_BYTES}")
    return min(kv_pool_need(s.args, s.batch, s.prompts_per_engine, s.o, s.layout.engine_tp), usable - _total(held))


def _size_micro_batch(s: _Shapes, usable: int) -> int:
    """The most tokens whose full training pass leaves the train phase as much room
    for prompt state as the prefix phase has (at most what the step's prompt work
    keeps); at least the longest sequence, at most a whole chunk of groups."""
    none = [False] * len(s.items)
    train = lambda tokens: _phases(_Shapes(s.args, s.layout, s.batch, replace(s.o, micro_batch_tokens=tokens),  # noqa: E731
                                           s.params), none)["train"]
    prefix = _phases(s, none)["prefix"]
    target = max(0, min(usable - _total(prefix), sum(st.total for st in s.states))) if prefix else 0
    b, least = s.batch, s.batch.longest_sequence
    if _total(train(least)) > usable:
        held = train(least)
        need = held.pop("activations")
        raise _does_not_fit(f"training one sequence ({least} tokens)", need, held, usable,
                            f"set parallel.activation_checkpointing, lower rollout.max_tokens, {_FEWER_BYTES}")
    per_prompt = b.prompt_len + b.n * b.response_tokens if s.o.share_prefix else b.n * b.sequence_len
    return _largest(least, max(least, s.chunk_prompts * per_prompt),
                    lambda tokens: usable - _total(train(tokens)) >= target)


def size_memory(args: ModelArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                params: ParamCounts | None = None) -> MemorySizes:
    """The sizes `options` leaves to the plan (None), within `usable_bytes`, in this order:
    - the KV pool: what the batch needs at full length, at most what the rollout
      (and the overlap's decode window, before any prompt state) leaves beside its
      fixed classes;
    - the micro-batch: the most tokens whose training pass leaves the train phase as
      much room for prompt state as the prefix phase has (no more than the step's
      prompt work keeps), and at least the longest sequence;
    - the prefix budget, each step (`MemorySizes.prefix_budget_for`): the prompt
      state both the prefix phase (beside that step's pool, in overlap) and the
      train phase can hold.
    Raises MemoryPlanError, naming the bytes and the settings to change, when one
    prompt's samples or one training sequence cannot fit."""
    params = params or count_params(args)
    usable = usable_bytes(options)
    trial = replace(options, kv_pool=0.0, prefix_budget=0.0, micro_batch_tokens=batch.longest_sequence)
    kv_pool = _size_pool(_Shapes(args, layout, batch, trial, params), usable) if options.kv_pool is None else \
        _bytes(options.kv_pool, options.device_memory)
    trial = replace(trial, kv_pool=float(kv_pool))
    micro = options.micro_batch_tokens or _size_micro_batch(_Shapes(args, layout, batch, trial, params), usable)
    if micro < batch.longest_sequence:
        raise MemoryPlanError(f"trainer.max_tokens_per_micro_batch {micro} is smaller than the longest sequence, "
                              f"{batch.longest_sequence} tokens (the actor never splits one): raise it, or set 0 "
                              "for the memory plan's")
    fixed = _phases(_Shapes(args, layout, batch, replace(trial, micro_batch_tokens=micro), params),
                    [False] * len(prefix_items(options)) if options.share_prefix else [])
    prefix_room = usable - _total(fixed["prefix"]) + fixed["prefix"].get("kv_pool", 0) if fixed["prefix"] else 0
    budget = None if options.prefix_budget is None else _bytes(options.prefix_budget, options.device_memory)
    return MemorySizes(usable, kv_pool, micro, prefix_room, usable - _total(fixed["train"]),
                       options.schedule == "overlap", budget)


def plan_memory(args: ModelArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                params: ParamCounts | None = None, model_name: str = "") -> MemoryPlan:
    """Both schedules' per-GPU bytes, with the sizes `options` leaves to the plan
    decided first (`size_memory`). Sizes the run set are taken as given: when they
    do not fit, a warning says which phase and by how much. `params` may be passed
    to skip recounting."""
    params = params or count_params(args)
    sizes = size_memory(args, layout, batch, options, params)
    resolved = replace(options, kv_pool=float(sizes.kv_pool), micro_batch_tokens=sizes.micro_batch_tokens)
    shapes = _Shapes(args, layout, batch, resolved, params)
    budget = sizes.prefix_budget_for(shapes.kv_pool())
    admits = admitted([st.total for st in shapes.states], budget)
    rollplex = SchedulePlan("rollplex", _phases(shapes, admits))
    if rollplex.peak > sizes.usable:
        warnings.warn(f"the memory plan's phase {rollplex.peak_phase} needs {_fmt(rollplex.peak)}, over the "
                      f"{_fmt(sizes.usable)} usable: the sizes set in the config (rollout.kv_cache_memory, "
                      "schedule.prefix_memory_budget, trainer.max_tokens_per_micro_batch) are too large; 0 lets "
                      "the plan size them", stacklevel=2)
    # Naive: the same tensors, none ever freed, so every class is resident at its largest in every phase.
    everything = {c: max(rollplex.phases[p].get(c, 0) for p in PHASES) for c in TENSOR_CLASSES}
    naive = SchedulePlan("naive", {p: dict(everything) for p in PHASES if rollplex.phases[p]})
    return MemoryPlan(args, layout, batch, resolved, sizes, params, naive, rollplex, shapes.prompts_per_rank,
                      shapes.items, shapes.states, admits, budget, model_name)


# The loop's phases (rollplex.rl.loop, `perf/max_memory_allocated_gb/<phase>`) and the plan's phases each spans.
LOOP_PHASES = {"gen": ("rollout",), "prefix": ("prefix",), "ref": ("logprobs",), "old_log_prob": ("logprobs",),
               "update_actor": ("train", "optimizer")}


def loop_phase_bytes(plan: MemoryPlan) -> dict[str, int]:
    """The plan's peak bytes of each phase the loop runs and measures: overlap's
    gen spans the decode window with its prompt work, serial runs that work as a
    phase of its own."""
    o = plan.options
    spans = dict(LOOP_PHASES, gen=("rollout", "prefix") if o.schedule == "overlap" else ("rollout",))
    if o.schedule != "serial-prefix":
        del spans["prefix"]
    if not o.ref_model:
        del spans["ref"]
    if not o.recompute_old_logprobs:
        del spans["old_log_prob"]
    return {name: max(plan.rollplex.total(p) for p in parts) for name, parts in spans.items()}


# ----------------------------------------------------------------------------- printing


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f}"


def _header(plan: MemoryPlan) -> list[str]:
    args, lay, b, o, p, z = plan.args, plan.layout, plan.batch, plan.options, plan.params, plan.sizes
    t = args.text
    deferred = [f"{i.kind} (chunk {i.chunk})" for i, a in zip(plan.prefix_items, plan.admitted) if not a]
    return [
        f"model {plan.model_name or '(config)'}: {p.total / 1e9:.2f}B parameters ({p.vision / 1e9:.2f}B vision, "
        f"{p.tp_split / 1e9:.2f}B split by tp), {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"{t.num_key_value_heads} kv heads x {t.head_dim}",
        f"layout: {lay.nodes} node(s) x {lay.gpus_per_node} GPUs; trainer dp_shard {lay.dp_shard} x tp {lay.tp}; "
        f"engine tp {lay.engine_tp} ({lay.engine_replicas} replicas)",
        f"batch: {b.prompts} prompts x n {b.n}; prompt {b.prompt_tokens} text + {b.vision_tokens} vision tokens "
        f"({b.vision_patches(args)} patches); response {b.response_tokens} tokens",
        f"options: schedule {o.schedule}, {o.updates_per_batch} update(s) per batch, activation checkpointing "
        f"{o.activation_checkpointing}, freeze vision {o.freeze_vision}, optimizer offload {o.offload_optimizer}, "
        f"ref model {o.ref_model}, old prefix {o.recompute_old_logprobs}, {o.param_dtype}, {o.attention} attention",
        f"sizes within {z.usable / GiB:.1f} GiB ({o.device_memory / GiB:.1f} GiB less {UNCOUNTED_FRACTION:.0%} "
        f"uncounted): KV pool {z.kv_pool / GiB:.2f} GiB, micro-batch {z.micro_batch_tokens} tokens, prefix budget "
        f"{plan.prefix_budget / GiB:.2f} GiB for this batch",
        f"per trainer rank: {plan.prompts_per_rank} prompts; prompt work "
        + (f"deferred to the serial path: {', '.join(deferred)}" if deferred else "all kept from the prefix phase"),
        "",
    ]


def format_plan(plan: MemoryPlan) -> str:
    lines = _header(plan)
    for phase in plan.naive.phases:
        lines.append(f"phase {phase:<10} {'naive GiB':>9}  {'rollplex GiB':>12}")
        for cls in TENSOR_CLASSES:
            nv, rp = plan.naive.phases[phase].get(cls, 0), plan.rollplex.phases[phase].get(cls, 0)
            if nv or rp:
                lines.append(f"  {cls:<22}{_gib(nv)}  {_gib(rp):>12}")
        lines.append(f"  {'total':<22}{_gib(plan.naive.total(phase))}  {_gib(plan.rollplex.total(phase)):>12}")
        lines.append("")
    for sched in (plan.naive, plan.rollplex):
        fits = "fits" if sched.peak <= plan.sizes.usable else "does NOT fit"
        lines.append(f"peak per GPU, {sched.name:<8}: {sched.peak / GiB:7.2f} GiB in phase {sched.peak_phase} "
                     f"({fits} in {plan.sizes.usable / GiB:.1f} GiB usable)")
    lines += [
        "",
        "exact: parameters (from the layer shapes); master shard = (tp-split/tp + replicated)/dp_shard "
        "elements; gradients and 2 AdamW moments on the trainable part of it; ref weights = the shard in ref dtype; "
        "gathered weights = all of them in rollout and prompt work, FSDP's root unit + 1 decoder layer in passes; "
        "KV per token = 2 x layers x kv_heads/tp x head_dim x dtype; KV pool = every sample's blocks at full length "
        "(as the engine allocates), at most its capacity; prompt K/V = that per prompt token, once per item "
        "(ref, actor, old); vision embeds = vision tokens x hidden x dtype.",
        "estimated from what the model's code saves for backward: per token and decoder layer 2 RMSNorms "
        "(float32 input, normalised value, output) + attention (q, k, v, output; the torch path's gathered copies) + "
        "4 x intermediate; with checkpointing the layer's input; the prefix graph = that over the actor's prompt "
        "tokens (+ the vision tower over its patches unless it reuses cached features); a training micro-batch = "
        "that over its tokens + max(logits: 6 float32 vocabulary rows per response token with the entropy bonus, "
        "one layer's backward); a logprob pass = max(one layer's forward, logits: 2 rows); workspace = the engine's "
        "prefill layer or decode logits and sampling, or a prompt slice's layer.",
        "naive = the same tensors with nothing ever freed: each class at its largest, in every phase "
        "(so optimizer offload does not apply to it).",
        f"not counted (the {UNCOUNTED_FRACTION:.0%} headroom): allocator fragmentation, library workspaces, "
        "the CUDA context, FSDP's reduce buffers, optimizer temporaries.",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- measuring on CPU


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


PHASE_MARK = "rollplex/phase/"


class CpuPhasePeaks:
    """Each phase's peak of live tensor bytes on CPU, where torch keeps no
    allocator statistics: the counterpart of torch.cuda.max_memory_allocated.

    A step runs under the torch profiler with memory events (every allocation
    and free of torch's CPU allocator, in time order); the loop marks its phases
    with `record_function(PHASE_MARK + name)`. The level at the first step's
    start is counted from the tensors the process references
    (`live_tensor_bytes`); each later step starts where the previous one ended.
    The profiler makes a step about 3x slower."""

    def __init__(self):
        self.level: int | None = None

    @contextmanager
    def step(self) -> Iterator[dict[str, int]]:
        """Profile one step; the yielded dict holds each phase's peak bytes once the step is done."""
        if self.level is None:
            self.level = live_tensor_bytes()
        peaks: dict[str, int] = {}
        # One cycle per step; acc_events only keeps torch 2.11 from warning that cycles drop events.
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
            yield peaks
        phases, changes = [], []
        for e in prof.profiler.kineto_results.events():
            if e.name() == "[memory]":
                changes.append((e.start_ns(), e.nbytes()))
            elif e.name().startswith(PHASE_MARK):
                phases.append((e.name()[len(PHASE_MARK):], e.start_ns(), e.start_ns() + e.duration_ns()))
        changes.sort()
        times = [t for t, _ in changes]
        levels = list(accumulate((n for _, n in changes), initial=self.level))  # [i]: after i changes
        for name, start, end in phases:
            first, last = bisect_left(times, start), bisect_right(times, end)
            peaks[name] = max(peaks.get(name, 0), *levels[first:last + 1])
        self.level = levels[-1]
