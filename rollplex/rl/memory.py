"""Memory plan: per-GPU bytes of every large tensor class, phase by phase.

Every large tensor has a lifetime, from its first use to its last (see
shared/DESIGN.md, "Memory by phase"). A colocated system that frees nothing
holds the rollout's state (KV pool, the engine's gathered weights) and the
trainer's (master weights, gradients, AdamW moments) at once, so its peak is
their sum. Rollplex holds each class only within its lifetime, so each phase
pays only for what it uses. This module computes both, for a model shape, a
parallel layout and a batch, so a run can be sized before it starts and its
measured peaks (`perf/max_memory_allocated_gb/<phase>`) checked against a plan.

Phases:
    rollout    prefill and decode, before any prefix work
    prefix     the decode window with the prefix work done beside it (ViT once,
               ref / actor / old prefix forwards): prefix state accumulates
    train      suffix passes and backward
    optimizer  the AdamW step

Exact (closed formulas on the model's shape): parameters, gradients, optimizer
state, reference weights, KV pool, prompt KV, vision embeddings. Estimated:
activations and the actor's prefix graph (see `layer_activation_elements`).
Not counted: engine workspace (prefill activations, sampler logits, CUDA
graphs), FSDP's per-layer gather buffers and unsharded gradients, AdamW's
temporaries, the CUDA context and allocator fragmentation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs

GiB = 1 << 30

PHASES = ("rollout", "prefix", "train", "optimizer")
TENSOR_CLASSES = ("params_sharded", "params_unsharded_bf16", "grads", "optimizer_state", "ref_params", "kv_pool",
                  "prompt_kv", "prefix_graph", "vision_embeds", "activations")
PREFIX_KINDS = frozenset({"ref", "actor", "old"})


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

    def __post_init__(self):
        if min(self.prompts, self.n, self.response_tokens, self.prompt_len) < 1 or self.vision_tokens < 0:
            raise ValueError(f"a batch needs prompts, samples, response and prompt tokens: {self}")

    @property
    def prompt_len(self) -> int:
        return self.prompt_tokens + self.vision_tokens

    def vision_patches(self, args: ModelArgs) -> int:
        return self.vision_tokens * args.vision.spatial_merge_size ** 2


@dataclass
class MemoryOptions:
    """Dtypes, which optional tensors exist, and the knobs that size the rest."""

    param_dtype: torch.dtype = torch.bfloat16  # gathered weights, KV, activations
    master_dtype: torch.dtype = torch.float32  # the sharded weights the optimizer updates
    grad_dtype: torch.dtype = torch.float32  # sharded gradients (FSDP reduces in fp32)
    optimizer_dtype: torch.dtype = torch.float32  # AdamW's two moments
    ref_model: bool = False  # kl_coef > 0: a frozen reference copy, sharded like the actor
    ref_dtype: torch.dtype = torch.bfloat16  # frozen, so bf16 suffices (today's loop loads it in model.dtype)
    recompute_old_logprobs: bool = False  # the old policy's prefix KV is kept too
    offload_optimizer: bool = False  # AdamW moments on the host outside the optimizer step
    activation_checkpointing: bool = False
    freeze_vision: bool = False  # no gradients / moments for the vision tower, no graph through it
    micro_batch_tokens: int = 8192  # trainer token budget per micro-batch
    kv_pool: float | None = None  # None: the batch at full length; <= 1: a fraction of device_memory; else bytes
    prefix_budget: float | None = None  # prompt KV + prefix graph kept per GPU; None: no limit; else as kv_pool
    device_memory: int = 80 * GiB  # one GPU's HBM, for a kv_pool fraction and the "fits" check


# ----------------------------------------------------------------------------- exact counts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements by how tensor parallelism treats them (rollplex.train.parallelize)."""

    total: int
    tp_split: int  # decoder q/k/v/o and MLP linears, embedding and head when untied: 1/tp per rank
    vision: int  # vision tower and merger: replicated over tp

    def per_tp_rank(self, tp: int) -> int:
        """Elements one rank holds once gathered over dp_shard."""
        return self.tp_split // tp + self.total - self.tp_split


def count_params(args: ModelArgs) -> ParamCounts:
    """Parameter counts from the layer shapes of rollplex.models.qwen2_5_vl (the tests check them against a
    built model and the hub's totals). Counted, not built: a meta-device build pulls in torch._dynamo (~5 s)."""
    v, t = args.vision, args.text
    w, inter, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    # two norms, qkv and proj (with biases), gate/up/down (with biases)
    vision_block = 2 * w + (w + 1) * 3 * w + (w + 1) * w + 2 * (w + 1) * inter + (inter + 1) * w
    # patch embedding (no bias), blocks, merger norm and its two linears
    vision = w * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 + v.depth * vision_block + \
        w + (merged + 1) * merged + (merged + 1) * v.out_hidden_size
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    # q/k/v (with biases), o, gate/up/down: what apply_tp splits; the two norms stay replicated
    split_layer = (t.hidden_size + 1) * (q + 2 * kv) + q * t.hidden_size + 3 * t.hidden_size * t.intermediate_size
    embeddings = t.vocab_size * t.hidden_size * (1 if args.tie_word_embeddings else 2)  # + the head when untied
    tp_split = t.num_hidden_layers * split_layer + (0 if args.tie_word_embeddings else embeddings)
    total = vision + t.num_hidden_layers * (split_layer + 2 * t.hidden_size) + t.hidden_size + embeddings
    return ParamCounts(total, tp_split, vision)


def kv_bytes_per_token(args: ModelArgs, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Keys and values of one token in every decoder layer, on one of `tp` ranks."""
    t = args.text
    if t.num_key_value_heads % tp:
        raise ValueError(f"tp {tp} does not divide num_key_value_heads {t.num_key_value_heads}")
    return 2 * t.num_hidden_layers * (t.num_key_value_heads // tp) * t.head_dim * dtype.itemsize


def prefix_state_bytes(args: ModelArgs, prompt_tokens: int, vision_tokens: int, kinds: Iterable[str],
                       dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
    """Kept prompt KV of one prompt (its `prompt_tokens` text plus `vision_tokens`
    merged vision tokens) for each kind of prefix pass in `kinds` ('ref', 'actor',
    'old'), on one of `tp` ranks. Kept once per prompt: the n samples share it.
    Vision embeddings and the actor's graph are not included."""
    kinds = set(kinds)
    if kinds - PREFIX_KINDS:
        raise ValueError(f"unknown prefix kinds {sorted(kinds - PREFIX_KINDS)}; expected a subset of "
                         f"{sorted(PREFIX_KINDS)}")
    return len(kinds) * (prompt_tokens + vision_tokens) * kv_bytes_per_token(args, dtype, tp)


# ----------------------------------------------------------------------------- estimates


def layer_activation_elements(width: int, q_dim: int, kv_dim: int, inter: int, tp: int = 1) -> int:
    """Elements per token that one transformer layer keeps for backward (flash-style
    attention, no score matrix): the two norms' inputs and outputs (4 x width,
    replicated over tp), q and the attention output (2 x q_dim), k and v
    (2 x kv_dim), and the SwiGLU's gate, up, silu(gate) and product (4 x inter);
    the last three groups are split over tp."""
    return 4 * width + (2 * q_dim + 2 * kv_dim + 4 * inter) // tp


def _saved_elements(layers: int, width: int, layer_elements: int, checkpointing: bool) -> int:
    """Per token, what a stack of layers keeps from forward to backward: every
    layer's saved tensors, or with activation checkpointing every layer's input."""
    return layers * (width if checkpointing else layer_elements)


def _backward_elements(layers: int, width: int, layer_elements: int, checkpointing: bool) -> int:
    """Per token, the peak during backward: the saved tensors, plus with
    checkpointing the one layer being recomputed."""
    return _saved_elements(layers, width, layer_elements, checkpointing) + (layer_elements if checkpointing else 0)


def _logits_bytes(args: ModelArgs, response_tokens: int) -> int:
    """Logits at the response positions: bf16 from the head (gathered over tp, so the
    whole vocabulary), their fp32 copy and the fp32 log-softmax kept for backward."""
    return response_tokens * args.text.vocab_size * (2 + 4 + 4)


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
        return max(PHASES, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)


@dataclass
class MemoryPlan:
    """The inputs, the parameter counts, and both schedules' bytes per GPU."""

    args: ModelArgs
    layout: ParallelLayout
    batch: BatchShape
    options: MemoryOptions
    params: ParamCounts
    naive: SchedulePlan
    rollplex: SchedulePlan
    prompts_per_rank: int  # of a trainer dp rank
    prefix_prompts: int  # of those, how many keep prefix state from the decode window (the prefix budget)
    model_name: str = ""


def _bytes(fraction_or_bytes: float, device_memory: int) -> int:
    """The config convention: a value <= 1 is a fraction of the device's memory, else bytes."""
    return int(fraction_or_bytes * device_memory if fraction_or_bytes <= 1 else fraction_or_bytes)


def plan_memory(args: ModelArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                params: ParamCounts | None = None, model_name: str = "") -> MemoryPlan:
    """Both schedules' per-GPU bytes. `params` may be passed to skip recounting."""
    params = params or count_params(args)
    o, t = options, args.text
    prompts_per_rank = math.ceil(batch.prompts / layout.dp_shard)
    prompts_per_engine = math.ceil(batch.prompts / layout.engine_replicas)

    # Weights: master shard = (tp-split / tp + replicated) / dp_shard elements (FSDP2's dim-0 padding, under
    # dp_shard rows per tensor, left out). Gradients and moments cover the trainable part only.
    rank_elems = params.per_tp_rank(layout.tp)
    trainable_elems = rank_elems - (params.vision if o.freeze_vision else 0)
    shard = math.ceil(rank_elems / layout.dp_shard)
    trainable_shard = math.ceil(trainable_elems / layout.dp_shard)
    params_sharded = shard * o.master_dtype.itemsize
    grads = trainable_shard * o.grad_dtype.itemsize
    optimizer_state = 2 * trainable_shard * o.optimizer_dtype.itemsize
    ref_params = shard * o.ref_dtype.itemsize if o.ref_model else 0
    engine_weights = params.per_tp_rank(layout.engine_tp) * o.param_dtype.itemsize
    trainer_weights = rank_elems * o.param_dtype.itemsize

    # KV pool: every sequence of the engine replica's prompts at full length, each prompt's blocks held
    # once (the n samples fork from them).
    kv_pool = prompts_per_engine * (batch.prompt_len + batch.n * batch.response_tokens) * \
        kv_bytes_per_token(args, o.param_dtype, layout.engine_tp) if o.kv_pool is None else \
        _bytes(o.kv_pool, o.device_memory)

    act_bytes, ckpt = o.param_dtype.itemsize, o.activation_checkpointing
    decoder_elems = layer_activation_elements(t.hidden_size, t.num_attention_heads * t.head_dim,
                                              t.num_key_value_heads * t.head_dim, t.intermediate_size, layout.tp)
    decoder = (t.num_hidden_layers, t.hidden_size, decoder_elems, ckpt)
    v = args.vision
    vision_elems = layer_activation_elements(v.hidden_size, v.hidden_size, v.hidden_size, v.intermediate_size)
    vision = (v.depth, v.hidden_size, vision_elems, ckpt)
    patches = 0 if o.freeze_vision else batch.vision_patches(args)  # a frozen tower keeps no graph

    # Prefix state per prompt, at the trainer's tp: the prompt KV of each prefix pass, and the actor's graph
    # (its k/v are in the prompt KV already). Vision embeddings are kept for every prompt of the rank.
    kinds = {"actor"} | ({"ref"} if o.ref_model else set()) | ({"old"} if o.recompute_old_logprobs else set())
    kv_per_prompt = prefix_state_bytes(args, batch.prompt_tokens, batch.vision_tokens, kinds, o.param_dtype,
                                       layout.tp)
    kv_elems = 2 * t.num_key_value_heads * t.head_dim // layout.tp
    prefix_decoder = (t.num_hidden_layers, t.hidden_size, decoder_elems - kv_elems, ckpt)
    graph_per_prompt = act_bytes * (batch.prompt_len * _saved_elements(*prefix_decoder) +
                                    patches * _saved_elements(*vision))
    prefix_prompts = prompts_per_rank
    if o.prefix_budget is not None:
        budget = _bytes(o.prefix_budget, o.device_memory)
        prefix_prompts = min(prompts_per_rank, budget // (kv_per_prompt + graph_per_prompt))
    prompt_kv, prefix_graph = prefix_prompts * kv_per_prompt, prefix_prompts * graph_per_prompt
    vision_embeds = prompts_per_rank * batch.vision_tokens * t.hidden_size * o.param_dtype.itemsize

    # Training micro-batches, one at a time, of response tokens only (the prefix is done). Prompts over the
    # prefix budget run their prefix here instead, a group (or sub-group) at a time.
    responses_per_mb = min(prompts_per_rank * batch.n, max(1, o.micro_batch_tokens // batch.response_tokens))
    suffix_tokens = responses_per_mb * batch.response_tokens
    activations = suffix_tokens * _backward_elements(*decoder) * act_bytes + _logits_bytes(args, suffix_tokens)
    if prefix_prompts < prompts_per_rank:
        group_tokens = batch.prompt_len + min(batch.n, responses_per_mb) * batch.response_tokens
        activations = max(activations, act_bytes * (group_tokens * _backward_elements(*decoder) +
                                                    patches * _backward_elements(*vision)) +
                          _logits_bytes(args, group_tokens - batch.prompt_len))

    # Rollplex: each class within its lifetime. The engine reads the trainer's gathered weights in place
    # (with engine_tp != tp, the prefix passes also need the trainer's own gathered copy); they stay gathered
    # through backward. Gradients exist from backward to the step; moments stay on the host unless stepping.
    resident_moments = 0 if o.offload_optimizer else optimizer_state
    prefix_weights = engine_weights + (trainer_weights if layout.engine_tp != layout.tp else 0)
    base = dict(params_sharded=params_sharded, optimizer_state=resident_moments, ref_params=ref_params)
    prefix_state = dict(prompt_kv=prompt_kv, prefix_graph=prefix_graph, vision_embeds=vision_embeds)
    rollplex = SchedulePlan("rollplex", {
        "rollout": dict(base, params_unsharded_bf16=engine_weights, kv_pool=kv_pool, vision_embeds=vision_embeds),
        "prefix": dict(base, params_unsharded_bf16=prefix_weights, kv_pool=kv_pool, **prefix_state),
        "train": dict(base, params_unsharded_bf16=trainer_weights, grads=grads, activations=activations,
                      **prefix_state),
        "optimizer": dict(base, grads=grads, optimizer_state=optimizer_state),
    })
    # Naive: the same tensors, none ever freed, so every class is resident at its largest in every phase.
    everything = {c: max(rollplex.phases[p].get(c, 0) for p in PHASES) for c in TENSOR_CLASSES}
    naive = SchedulePlan("naive", {p: dict(everything) for p in PHASES})
    return MemoryPlan(args, layout, batch, options, params, naive, rollplex, prompts_per_rank, prefix_prompts,
                      model_name)


# ----------------------------------------------------------------------------- printing


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f}"


def format_plan(plan: MemoryPlan) -> str:
    args, lay, b, o, p = plan.args, plan.layout, plan.batch, plan.options, plan.params
    t = args.text
    lines = [
        f"model {plan.model_name or '(config)'}: {p.total / 1e9:.2f}B parameters ({p.vision / 1e9:.2f}B vision, "
        f"{p.tp_split / 1e9:.2f}B split by tp), {t.num_hidden_layers} layers, hidden {t.hidden_size}, "
        f"{t.num_key_value_heads} kv heads x {t.head_dim}",
        f"layout: {lay.nodes} node(s) x {lay.gpus_per_node} GPUs; trainer dp_shard {lay.dp_shard} x tp {lay.tp}; "
        f"engine tp {lay.engine_tp} ({lay.engine_replicas} replicas)",
        f"batch: {b.prompts} prompts x n {b.n}; prompt {b.prompt_tokens} text + {b.vision_tokens} vision tokens "
        f"({b.vision_patches(args)} patches); response {b.response_tokens} tokens",
        f"options: activation checkpointing {o.activation_checkpointing}, freeze vision {o.freeze_vision}, "
        f"optimizer offload {o.offload_optimizer}, ref model {o.ref_model}, old prefix {o.recompute_old_logprobs}, "
        f"micro-batch {o.micro_batch_tokens} tokens",
        f"per trainer rank: {plan.prompts_per_rank} prompts, {plan.prefix_prompts} of them keep prefix state from "
        "the decode window" + ("" if o.prefix_budget is None else
                                f" (prefix budget {_bytes(o.prefix_budget, o.device_memory) / GiB:.1f} GiB)"),
        "",
    ]
    for phase in PHASES:
        lines.append(f"phase {phase:<10} {'naive GiB':>9}  {'rollplex GiB':>12}")
        for cls in TENSOR_CLASSES:
            nv, rp = plan.naive.phases[phase].get(cls, 0), plan.rollplex.phases[phase].get(cls, 0)
            if nv or rp:
                lines.append(f"  {cls:<22}{_gib(nv)}  {_gib(rp):>12}")
        lines.append(f"  {'total':<22}{_gib(plan.naive.total(phase))}  {_gib(plan.rollplex.total(phase)):>12}")
        lines.append("")
    for sched in (plan.naive, plan.rollplex):
        fits = "fits" if sched.peak <= o.device_memory else "does NOT fit"
        lines.append(f"peak per GPU, {sched.name:<8}: {sched.peak / GiB:7.2f} GiB in phase {sched.peak_phase} "
                     f"({fits} in {o.device_memory / GiB:.0f} GiB)")
    lines += [
        "",
        "exact: parameters (from the layer shapes); master shard = (tp-split/tp + replicated)/dp_shard "
        "elements; gradients and 2 AdamW moments on the trainable part of it; ref weights = the shard in ref dtype; "
        "gathered weights = tp-split/tp + replicated elements x 2 B; KV per token = 2 x layers x kv_heads/tp x "
        "head_dim x 2 B; prompt KV = that x prompt length x kinds (actor, +ref, +old), once per prompt; KV pool = "
        "every sequence of the engine replica at full length, prompt blocks shared by the n samples; vision embeds "
        "= vision tokens x hidden x 2 B.",
        "estimated: A = 4 hidden + (2 q + 2 kv + 4 intermediate)/tp elements per token per decoder layer "
        "(8 width + 4 intermediate per vision block); a training micro-batch keeps L x A per token, or with "
        "checkpointing L x hidden + A, x 2 B, plus logits = response tokens x vocab x 10 B; the prefix graph keeps "
        "per prompt token L x (A - 2 kv/tp) (its k/v are in prompt KV), or with checkpointing L x hidden, x 2 B, "
        "plus the vision tower's over the patches unless frozen.",
        "naive = the same tensors with nothing ever freed: each class at its largest, in every phase "
        "(so optimizer offload does not apply to it).",
        "not counted: engine workspace, FSDP gather buffers, optimizer temporaries, CUDA context, fragmentation.",
    ]
    return "\n".join(lines)
