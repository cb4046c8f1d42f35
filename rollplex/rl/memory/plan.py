"""The plan: each phase's bytes per GPU by tensor class, for naive colocation
and for Rollplex, and the sizes it decides.

Phases, as the loop runs them (`loop_phase_bytes` maps them onto the loop's
measured `perf/max_memory_allocated_gb/<phase>`):
    rollout    prefill and decode (the engine's weights and workspace; its KV
               pool, and with recurrent layers its state pool, are held in every
               phase, allocated once per run)
    prefix     the prompt work (reference / actor / old prompt forwards), its
               state accumulating: in the decode window beside the KV pool
               (overlap), or after rollout (serial with share_prefix)
    logprobs   reference and old-policy logprob passes (no gradients)
    train      the actor's forward and backward passes
    optimizer  the AdamW step

The plan also decides the sizes a run leaves to it (`size_memory`): the KV
pool, the prefix budget and the training micro-batch, from the device's memory
less a headroom for what it does not count (`UNCOUNTED_FRACTION`).

MoE models (the text args' `moe`): every expert counts in the weights, so a sparse
layer's FSDP unit gathers all of its experts; with expert parallelism (layout.ep > 1)
a pass gathers this rank's share of them (1/ep), and the rollout holds the trainer's
share beside the engine's whole experts, rebuilt from the shares for the rollout
(`engine_experts`, rollplex.rl.weights). With routing replay the engine's route log
and the routes the samples carry are `routes`.

With LoRA (options.lora.rank > 0) FSDP shards, gathers and trains the adapters
only (and the vision tower with lora.train_vision); the frozen base is held whole
on every dp rank in the compute dtype (`params_frozen`), read in place by the
trainer and the engine, never gathered; the engine keeps its own copy of the
adapters for the run (`engine_adapters`) unless it reads them in place.

Multi-turn runs (options.multi_turn): a response's observations may hold images, at most
every response token a merged vision token. Every pass over responses runs the vision
tower over them (`micro_batch`'s observation_vision), and the rollout keeps each sample's
observation features (`vision_embeds`) and prefills its continuations (`workspace`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from rollplex.engine.engine import EngineConfig
from rollplex.models.family import FamilyArgs
from rollplex.models.registry import family_of
from rollplex.rl.memory.estimates import (FP32, ExpertCounts, LoRACounts, MicroBatch, ParamCounts, KeptPromptState,
                                          _layer_forward_bytes, _vision_forward_bytes, admitted, count_lora,
                                          count_params, expert_counts, kv_bytes_per_token, kv_pool_need,
                                          layer_backward_bytes, micro_batch, micro_batch_bytes, kept_prompt_state,
                                          moe_of, route_log_bytes, sample_routes_bytes, state_pool_bytes)
from rollplex.rl.memory.inputs import (GiB, UNCOUNTED_FRACTION, BatchShape, MemoryOptions, ParallelLayout,
                                       usable_bytes)
from rollplex.rl.schedules.prompt_items import PromptItem, PromptKind, prompt_work_items

PHASES = ("rollout", "prefix", "logprobs", "train", "optimizer")
TENSOR_CLASSES = ("params_sharded", "params_frozen", "engine_adapters", "optimizer_state", "ref_params",
                  "params_gathered", "engine_experts", "grads", "kv_pool", "state_pool", "routes", "vision_embeds",
                  "prompt_kv", "prefix_graph", "workspace", "activations")
PREFILL_TOKENS = EngineConfig.max_num_batched_tokens  # the engine's prefill tokens per step (the loop's setting)


class MemoryPlanError(ValueError):
    """The run's shapes cannot fit the device, whatever the sizes: names what does not fit."""


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
    train_room: int  # bytes the train phase leaves for prompt state beside its largest micro-batch (and the pool)
    prefix_budget: int | None = None  # set by the run (schedule.prefix_memory_budget in bytes): every step's

    def prefix_budget_for(self, pool_bytes: int) -> int:
        """A step's budget for kept prompt state beside the engine's KV pool of `pool_bytes`
        (held all run: the plan's, or a smaller one agreed across an engine's ranks)."""
        if self.prefix_budget is not None:
            return self.prefix_budget
        return max(0, min(self.prefix_room - pool_bytes, self.train_room))


@dataclass
class MemoryPlan:
    """The inputs, the sizes the plan decided, the parameter counts, and both
    schedules' bytes per GPU."""

    args: FamilyArgs
    layout: ParallelLayout
    batch: BatchShape
    options: MemoryOptions
    sizes: MemorySizes
    params: ParamCounts  # the model's (the base's, with LoRA)
    naive: SchedulePlan
    rollplex: SchedulePlan
    prompts_per_rank: int  # of a trainer dp rank
    prompt_items: list[PromptItem]  # a rank's prompt work in a step
    prompt_states: list[KeptPromptState]  # what each keeps (`kept_prompt_state`)
    admitted: list[bool]  # which of them the step's prefix budget admits (the rest take the serial path)
    prefix_budget: int  # the step's, for this batch's KV pool
    model_name: str = ""
    lora: LoRACounts | None = None  # the adapters (options.lora.rank > 0)
    experts: ExpertCounts = ExpertCounts(0, 0, 0)  # the routed experts (MoE models), which layout.ep splits

    def streamed_update_bytes(self) -> int:
        """What the first update's passes hold in the decode window when finished groups stream
        (schedule.stream_groups, rollplex.rl.schedules.overlap_stream): the gradients, whole on each rank until the
        prompt's backward reduces them after rollout, and one micro-batch's working memory."""
        s = _Shapes(self.args, self.layout, self.batch, self.options, self.params)
        return s.trainable_shard() * self.layout.dp_shard * self.options.grad_dtype.itemsize + \
            s.pass_bytes(kept=True, grad=True)

    def gathered_ref_bytes(self) -> int:
        """What holding the reference model gathered through the decode window adds, so that
        the streamed finished groups' reference passes need no collective (dp_shard > 1):
        its whole weights on each rank, beside the shard it keeps (none when it is LoRA's base: not sharded)."""
        if self.options.ref_is_base:
            return 0
        whole = self.params.per_tp_rank(self.layout.tp)
        return (whole - math.ceil(whole / self.layout.dp_shard)) * self.options.ref_dtype.itemsize

    @property
    def kv_pool_blocks(self) -> int:
        """The engine's pool capacity in blocks: the plan's bytes less the engine's sink block."""
        o = self.options
        block = o.block_size * kv_bytes_per_token(self.args, o.param_dtype, self.layout.engine_tp)
        return max(1, self.sizes.kv_pool // block - 1)


class _Shapes:
    """One rank's quantities for options whose sizes are all set, and the bytes of
    each class in the phases that hold it."""

    def __init__(self, args: FamilyArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                 params: ParamCounts):
        self.args, self.layout, self.batch, self.o, self.params = args, layout, batch, options, params
        self.lora = count_lora(args, options.lora, options.freeze_vision) if options.lora.rank > 0 else None
        self.experts = expert_counts(args)
        _check_experts(args, layout, options)
        # What FSDP shards (fp32 masters, gathered in the compute dtype): every weight, or LoRA's trained ones.
        self.sharded = self.lora.trained(options.lora.train_vision) if self.lora else params
        self.size = options.param_dtype.itemsize
        self.prompts_per_rank = math.ceil(batch.prompts / layout.dp_shard)
        self.prompts_per_engine = math.ceil(batch.prompts / layout.engine_replicas)
        self.chunk_prompts = math.ceil(self.prompts_per_rank / options.updates_per_batch)
        self.patches = batch.vision_patches(args)
        self.items = prompt_work_items(options) if options.share_prefix else []
        self.states = [kept_prompt_state(args, i, self.chunk_prompts, self.chunk_prompts * batch.prompt_len,
                                    self.chunk_prompts * self.patches, options, layout.tp) for i in self.items]

    def resident(self) -> dict[str, int]:
        """Held all step: master weights, AdamW moments (unless offloaded), the reference weights,
        the engine's KV pool and recurrent-state pool (allocated once per run: the decode graphs read
        them by address), and with LoRA the frozen base and the engine's adapter buffers (kept for the
        run, for the same graphs). Expert parallelism leaves a rank's shard the same size: its
        experts, 1/ep of them, are FSDP-sharded over dp_shard / ep ranks, the rest over dp_shard."""
        o, lay = self.o, self.layout
        out = dict(params_sharded=math.ceil(self.sharded.per_tp_rank(lay.tp) / lay.dp_shard) * o.master_dtype.itemsize,
                   optimizer_state=0 if o.offload_optimizer else self.moments(), kv_pool=int(o.kv_pool),
                   state_pool=state_pool_bytes(self.args, o.max_num_seqs, lay.engine_tp))
        if self.lora:
            out["params_frozen"] = self.frozen(lay.tp) * self.size
            # The engine reads an adapter in place only where the trainer's is whole and in its dtype
            # (rollplex.rl.weights): dp_shard 1, no mixed-precision cast, one TP layout.
            in_place = lay.dp_shard == 1 and o.master_dtype == o.param_dtype and lay.engine_tp == lay.tp
            out["engine_adapters"] = 0 if in_place else self.lora.adapters().per_tp_rank(lay.engine_tp) * self.size
        if o.ref_model and not o.ref_is_base:
            out["ref_params"] = math.ceil(self.params.per_tp_rank(lay.tp) / lay.dp_shard) * o.ref_dtype.itemsize
        return out

    def frozen(self, tp: int) -> int:
        """LoRA's frozen base on one of `tp` ranks, whole over dp_shard: every weight but the vision
        tower's when lora.train_vision trains it (replicated over tp, as ParamCounts counts it)."""
        return self.params.per_tp_rank(tp) - (self.params.vision if self.o.lora.train_vision else 0)

    def trainable_shard(self) -> int:
        p, lay = self.sharded, self.layout
        return math.ceil((p.per_tp_rank(lay.tp) - (p.vision if self.o.freeze_vision else 0)) / lay.dp_shard)

    def moments(self) -> int:
        return 2 * self.trainable_shard() * self.o.optimizer_dtype.itemsize

    def grads(self) -> int:
        return self.trainable_shard() * self.o.grad_dtype.itemsize

    def experts_not_held(self, experts: int) -> int:
        """Of `experts` routed-expert elements, those a rank's gathered FSDP units lack under expert
        parallelism: all but its 1/ep share (none at ep 1)."""
        return experts - experts // self.layout.ep

    def engine_experts(self) -> int:
        """The engine's own buffers of every expert, whole, rebuilt from the ep ranks' shares by an all-gather at
        each rollout start and freed after it (rollplex.rl.weights); none at ep 1, where the engine reads the
        trainer's gathered experts."""
        return self.experts.total * self.size if self.layout.ep > 1 else 0

    def engine_weights(self) -> int:
        """The trainer's weights gathered in rollout, which the engine reads (every weight; under expert
        parallelism this rank's share of the experts, which the engine holds whole beside them:
        `engine_experts`). With LoRA: the trainer's gathered units (the
        adapters, the vision tower with lora.train_vision); the base in place, but where the engine's
        TP layout differs from a split trainer's (its blocks rebuilt, for the rollout)."""
        lay = self.layout
        if not self.lora:
            return (self.params.per_tp_rank(lay.engine_tp) - self.experts_not_held(self.experts.total)) * self.size
        rebuilt = self.frozen(lay.engine_tp) if lay.tp > 1 and lay.engine_tp != lay.tp else 0
        return (self.sharded.per_tp_rank(lay.tp) + rebuilt) * self.size

    def prefix_weights(self) -> int:
        """The rollout's gathered weights; with engine_tp != tp the prompt work also needs the trainer's
        (with LoRA the engine's count holds them already)."""
        trainer = self.params.per_tp_rank(self.layout.tp) * self.size
        return self.engine_weights() + (trainer if self.layout.engine_tp != self.layout.tp and not self.lora else 0)

    def root_weights(self, dtype: torch.dtype) -> int:
        """The actor's FSDP root unit gathered (embedding, head, final norm, vision patch embedding and merger;
        with LoRA the adapters among them): FSDP keeps it from a forward to the end of the backward."""
        return self.sharded.root_per_tp_rank(self.layout.tp) * dtype.itemsize

    def pass_weights(self, dtype: torch.dtype, ref: bool = False) -> int:
        """Gathered weights during a training or logprob pass: the root unit and the decoder layer computing,
        the actor's or the reference model's (every weight; none when it is LoRA's base, read in place)."""
        if ref and self.o.ref_is_base:
            return 0
        units = self.params if ref else self.sharded
        layer = units.layer_per_tp_rank(self.layout.tp)
        if units is self.params:  # a sparse layer's unit: all its experts, this rank's share under expert parallelism
            layer -= self.experts_not_held(self.experts.in_largest_layer)
        return (units.root_per_tp_rank(self.layout.tp) + layer) * dtype.itemsize

    def vision_embeds(self) -> int:
        """The rollout's cached vision features (schedules with prompt work), kept to the step's end."""
        if not self.o.share_prefix:
            return 0
        rows = self.batch.vision_tokens * family_of(self.args).vision_feature_levels(self.args)
        return self.prompts_per_rank * rows * self.args.text.hidden_size * self.size

    def observation_embeds(self) -> int:
        """A multi-turn rollout's observation features: each sample keeps its observations' (encoded at their
        continuation prefill, kept for a recompute after preemption: rollplex.engine.runner) until it
        finishes; at most every response token's, for every sample of the engine's batch."""
        if not self.o.multi_turn:
            return 0
        rows = self.batch.response_tokens * family_of(self.args).vision_feature_levels(self.args)
        return self.prompts_per_engine * self.batch.n * rows * self.args.text.hidden_size * self.size

    def engine_workspace(self) -> int:
        """The engine's transient memory: a prefill step's layer (and the vision tower
        over its prompts when their features are not cached), or a decode step's
        float32 logits and the sampler's vocabulary-wide temporaries over the batch.
        Multi-turn, a step's continuation prefills (many samples' observations) fill
        up to its token budget, and the tower encodes one observation at a time (at
        most a response's tokens)."""
        b, size = self.batch, self.size
        prompts = max(1, min(self.prompts_per_engine, PREFILL_TOKENS // b.prompt_len))
        layer = _layer_forward_bytes(self.args, size, self.layout.engine_tp, self.o.attention)
        prefill = prompts * b.prompt_len * layer
        if not self.o.share_prefix:
            prefill = max(prefill, prompts * self.patches * _vision_forward_bytes(self.args, size))
        if self.o.multi_turn:
            observations = min(PREFILL_TOKENS, self.prompts_per_engine * b.n * b.response_tokens)
            one_observation = b.response_tokens * self.args.vision.spatial_merge_size ** 2
            prefill = max(prefill, observations * layer, one_observation * _vision_forward_bytes(self.args, size))
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
            self.chunk_prompts * self.patches * _vision_forward_bytes(self.args, self.size)
        tokens = self.chunk_prompts * self.batch.prompt_len
        layer = _layer_forward_bytes(self.args, self.size, self.layout.tp, self.o.attention, self.layout.ep)
        return max(tokens * layer, vision)

    def route_log(self) -> int:
        """The engine's route log, during a rollout that records routes (routing replay rollout)."""
        return route_log_bytes(self.args, self.o.max_num_seqs, self.batch) if self.o.routing_replay == "rollout" \
            else 0

    def sample_routes(self, phase: str) -> int:
        """The routes the rank's samples carry in `phase` (one of PHASES): from the rollout with routing replay
        rollout, from the old-logprob pass with old, to the step's end."""
        since = {"rollout": "rollout", "old": "logprobs"}.get(self.o.routing_replay)
        if since is None or PHASES.index(phase) < PHASES.index(since):
            return 0
        return sample_routes_bytes(self.args, self.batch, self.prompts_per_rank)

    def kept_prompt_state(self, admitted: list[bool], graphs: bool = True) -> dict[str, int]:
        states = [s for s, a in zip(self.states, admitted) if a]
        return dict(prompt_kv=sum(s.kv for s in states), prefix_graph=sum(s.graph for s in states) if graphs else 0,
                    vision_embeds=self.vision_embeds())

    def micro_batch(self, kept: bool) -> MicroBatch:
        return micro_batch(self.args, self.batch, self.o.micro_batch_tokens, self.chunk_prompts, self.o.share_prefix,
                           kept, observation_vision=self.o.multi_turn)

    def pass_bytes(self, kept: bool, grad: bool) -> int:
        """A micro-batch's working memory (`micro_batch_bytes`) at the options' token budget."""
        return micro_batch_bytes(self.args, self.micro_batch(kept), self.batch, self.o, self.layout.tp, grad,
                                 self.layout.ep)

    def micro_batches(self, kept: bool) -> int:
        """Micro-batches of an optimizer step: its chunk's response tokens over a micro-batch's."""
        return math.ceil(self.chunk_prompts * self.batch.n * self.batch.response_tokens /
                         max(1, self.micro_batch(kept).responses))


def _rollout_phases(s: _Shapes, admitted: list[bool], base: dict[str, int]) -> dict[str, dict[str, int]]:
    """Rollout, and the prompt work: in the decode window beside the KV pool (overlap, the
    engine's steps and the slices alternating), or after rollout without it (serial)."""
    rollout = dict(base, params_gathered=s.engine_weights(),
                   vision_embeds=s.vision_embeds() + s.observation_embeds(), workspace=s.engine_workspace(),
                   **_some(engine_experts=s.engine_experts(), routes=s.route_log() + s.sample_routes("rollout")))
    if not s.o.share_prefix:
        return {"rollout": rollout}
    # The reference model's root unit stays gathered from its prompt forward to its logprob passes.
    ref_admitted = any(a and i.kind == PromptKind.REF for i, a in zip(s.items, admitted))
    ref_root = s.pass_weights(s.o.ref_dtype, ref=True) if ref_admitted else 0
    work = dict(s.kept_prompt_state(admitted), params_gathered=s.prefix_weights() + ref_root,
                **_some(engine_experts=s.engine_experts()))
    if s.o.schedule == "overlap":
        prefix = dict(rollout, **work, workspace=max(rollout["workspace"], s.slice_workspace(admitted)))
    else:  # after rollout: its route log is gone
        prefix = dict(base, **work, workspace=s.slice_workspace(admitted), **_some(routes=s.sample_routes("prefix")))
    return {"rollout": rollout, "prefix": prefix}


def _logprobs(s: _Shapes, admitted: list[bool], base: dict[str, int]) -> dict[str, int]:
    """Reference or old-policy passes, without gradients: suffix-only where every
    prompt's state was kept, else full passes."""
    o = s.o
    if not (o.ref_model or o.recompute_old_logprobs):
        return {}
    kept = bool(s.items) and all(admitted)
    return dict(base, params_gathered=s.pass_weights(o.ref_dtype if o.ref_model else o.param_dtype, o.ref_model),
                **s.kept_prompt_state(admitted), activations=s.pass_bytes(kept, grad=False),
                **_some(routes=s.sample_routes("logprobs")))


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
    actor = next((st for i, st, a in zip(s.items, s.states, admitted) if a and i.kind == PromptKind.ACTOR), None)
    base = dict(base, **_some(routes=s.sample_routes("train")))

    def update(state: dict[str, int], kept: bool) -> list[dict[str, int]]:
        in_pass = dict(base, **state, params_gathered=s.pass_weights(o.param_dtype),
                       grads=root_grads + (grads if s.micro_batches(kept) > 1 else 0),
                       activations=s.pass_bytes(kept, grad=True))
        return [in_pass, dict(base, **state, grads=grads + root_grads)]

    candidates = update(s.kept_prompt_state(admitted), actor is not None)
    if actor is not None:
        layer = layer_backward_bytes(s.args, s.size, s.layout.tp, o, s.layout.ep)
        candidates.append(dict(base, **s.kept_prompt_state(admitted), params_gathered=s.pass_weights(o.param_dtype),
                               grads=grads, activations=actor.kv + s.chunk_prompts * s.batch.prompt_len * layer))
    if o.updates_per_batch > 1:
        candidates += update(s.kept_prompt_state(admitted, graphs=False), False)
    return max(candidates, key=_total)


def _phases(s: _Shapes, admitted: list[bool]) -> dict[str, dict[str, int]]:
    """Rollplex's phases: each class within its lifetime (a phase the schedule does not run is empty)."""
    base = s.resident()
    phases = _rollout_phases(s, admitted, base)
    phases["logprobs"] = _logprobs(s, admitted, base)
    phases["train"] = _train(s, admitted, base)
    phases["optimizer"] = dict(base, grads=s.grads(), optimizer_state=s.moments(),
                               **_some(routes=s.sample_routes("optimizer")))
    return {p: phases.get(p, {}) for p in PHASES}


def _total(phase: dict[str, int]) -> int:
    return sum(phase.values())


def _some(**classes: int) -> dict[str, int]:
    """The classes that hold bytes: those a model or an option may not have (experts, routes) are left out
    of a phase rather than listed at 0."""
    return {c: b for c, b in classes.items() if b}


def _check_experts(args: FamilyArgs, layout: ParallelLayout, options: MemoryOptions) -> None:
    """Expert parallelism and routing replay need an MoE model, and ep must divide its experts (as
    rollplex.models.expert_parallel.check_ep and the engine's route log refuse otherwise)."""
    moe = moe_of(args)
    if layout.ep > 1:
        if moe is None or not expert_counts(args).layers:
            raise ValueError(f"parallel.ep {layout.ep}: the model has no MoE layers to split by expert; use ep 1")
        if moe.num_experts % layout.ep:
            raise ValueError(f"parallel.ep {layout.ep} does not divide the MoE layers' {moe.num_experts} experts")
        if options.lora.rank > 0:
            raise ValueError(f"parallel.ep {layout.ep} with lora.rank {options.lora.rank}: expert parallelism does "
                             "not split LoRA's frozen base yet")
    if options.routing_replay != "none" and moe is None:
        raise ValueError(f"algorithm.routing_replay {options.routing_replay}: routes are an MoE model's; this "
                         "model has no experts")


# ----------------------------------------------------------------------------- sizing


def _largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest value in [low, high] for which `fits` holds (it holds for all below), else low."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _bytes(fraction_or_bytes: float, device_memory: int) -> int:
    """The config convention: a value <= 1 is a fraction of the device's memory, else bytes."""
    return int(fraction_or_bytes * device_memory if fraction_or_bytes <= 1 else fraction_or_bytes)


def _fmt(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / 2 ** 20:.1f} MiB"


def _does_not_fit(what: str, need: int, phase: dict[str, int], usable: int, knobs: str) -> MemoryPlanError:
    if phase.get("state_pool"):
        knobs = f"lower rollout.max_num_seqs (the recurrent-state pool holds a row each), {knobs}"
    held = ", ".join(f"{c} {_fmt(b)}" for c, b in sorted(phase.items(), key=lambda cb: -cb[1]) if b)
    return MemoryPlanError(f"{what} needs {_fmt(need)}, but its phase holds {_fmt(_total(phase))} beside it "
                           f"({held}) in {_fmt(usable)} usable (the device's memory less {UNCOUNTED_FRACTION:.0%}). "
                           f"To fit: {knobs}")


_FEWER_BYTES = ("shard the model over more GPUs (parallel.dp_shard, parallel.tp), set parallel.offload_optimizer, "
                "or give a larger trainer.device_memory")


def _size_pool(s: _Shapes, usable: int) -> int:
    """The KV pool, held all run: the batch's need at full length, at most what every
    phase (before any prompt state, training at its least micro-batch) leaves beside
    its fixed classes; at least one prompt's samples."""
    fixed = _phases(s, [False] * len(s.items))
    one_prompt = kv_pool_need(s.args, s.batch, 1, s.o, s.layout.engine_tp)

    def require_room(phases: list[dict[str, int]]) -> dict[str, int]:
        held = max((phase for phase in phases if phase), key=_total)
        if usable - _total(held) < one_prompt:
            raise _does_not_fit(f"the KV pool for one prompt's {s.batch.n} samples", one_prompt, held, usable,
                                f"lower rollout.n or rollout.max_tokens, {_FEWER_BYTES}")
        return held

    # In the order that names the likeliest fix: the rollout's room, training one sequence, then every phase.
    require_room([fixed["rollout"], fixed["prefix"]])
    _require_one_sequence_trains(dict(fixed["train"], kv_pool=one_prompt), s.o.micro_batch_tokens, usable)
    held = require_room(list(fixed.values()))
    return min(kv_pool_need(s.args, s.batch, s.prompts_per_engine, s.o, s.layout.engine_tp), usable - _total(held))


def _require_engine_weights(s: _Shapes, usable: int) -> None:
    """Raise when the weights the rollout holds on each GPU (the engine's: every weight of its TP share, the
    trainer's gathered units, and under expert parallelism the engine's whole experts beside the trainer's
    share) alone do not fit, whatever the batch: no KV pool, batch or dp_shard makes room for them."""
    weights = s.engine_weights() + s.engine_experts()
    if weights <= usable:
        return
    lay, experts = s.layout, s.experts.total * s.size
    share = s.experts.total // lay.ep * s.size if lay.ep > 1 else 0
    held = "every weight whole" if lay.engine_tp == 1 else \
        f"its 1/{lay.engine_tp} share of the split weights and the rest whole"
    what = (f"the rollout holds {held} on each GPU (engine tp {lay.engine_tp}): {_fmt(weights - share)}"
            + (f", {_fmt(experts)} of them the routed experts" if experts else "")
            + (f", and beside them this rank's 1/{lay.ep} share of the experts, gathered by the trainer's FSDP units "
               f"({_fmt(share)}): {_fmt(weights)} in all" if share else "")
            + f", more than the {_fmt(usable)} usable (the device's memory less {UNCOUNTED_FRACTION:.0%})")
    if experts:
        why = ("MoE families roll out at tensor parallel 1 and the engine holds every expert whole (expert "
               "parallelism and expert tensor parallelism in the engine are not built yet), so this model "
               f"cannot roll out on one GPU of {s.o.device_memory / GiB:.1f} GiB. To fit: a smaller model, or a GPU "
               "with more memory (trainer.device_memory)")
    else:
        why = "To fit: split the engine over more GPUs (rollout.tp), or give a larger trainer.device_memory"
    raise MemoryPlanError(f"{what}. {why}")


def _require_one_sequence_trains(train: dict[str, int], tokens: int, usable: int) -> None:
    """Raise, naming what holds the memory, when the train phase at one sequence of `tokens` does not fit."""
    if _total(train) > usable:
        held = dict(train)
        need = held.pop("activations")
        raise _does_not_fit(f"training one sequence ({tokens} tokens)", need, held, usable,
                            f"set parallel.activation_checkpointing, lower rollout.max_tokens, {_FEWER_BYTES}")


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
    _require_one_sequence_trains(train(least), least, usable)
    per_prompt = b.prompt_len + b.n * b.response_tokens if s.o.share_prefix else b.n * b.sequence_len
    return _largest(least, max(least, s.chunk_prompts * per_prompt),
                    lambda tokens: usable - _total(train(tokens)) >= target)


def size_memory(args: FamilyArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                params: ParamCounts | None = None) -> MemorySizes:
    """The sizes `options` leaves to the plan (None), within `usable_bytes`, in this order:
    - the KV pool, held all run: what the batch needs at full length, at most what
      every phase (before any prompt state) leaves beside its fixed classes;
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
    _require_engine_weights(_Shapes(args, layout, batch, trial, params), usable)
    kv_pool = _size_pool(_Shapes(args, layout, batch, trial, params), usable) if options.kv_pool is None else \
        _bytes(options.kv_pool, options.device_memory)
    trial = replace(trial, kv_pool=float(kv_pool))
    micro = options.micro_batch_tokens or _size_micro_batch(_Shapes(args, layout, batch, trial, params), usable)
    if micro < batch.longest_sequence:
        raise MemoryPlanError(f"trainer.max_tokens_per_micro_batch {micro} is smaller than the longest sequence, "
                              f"{batch.longest_sequence} tokens (the actor never splits one): raise it, or set 0 "
                              "for the memory plan's")
    shapes = _Shapes(args, layout, batch, replace(trial, micro_batch_tokens=micro), params)
    fixed = _phases(shapes, [False] * len(shapes.items))
    prefix_room = usable - _total(fixed["prefix"]) + fixed["prefix"]["kv_pool"] if fixed["prefix"] else 0
    if shapes.items:  # what admitting prompt work holds besides its state: the reference's root unit, a slice's layer
        admitted_all = _phases(shapes, [True] * len(shapes.items))["prefix"]
        prefix_room -= sum(max(0, admitted_all.get(c, 0) - fixed["prefix"].get(c, 0))
                           for c in ("params_gathered", "workspace"))
    budget = None if options.prefix_budget is None else _bytes(options.prefix_budget, options.device_memory)
    return MemorySizes(usable, kv_pool, micro, prefix_room, usable - _total(fixed["train"]), budget)


def plan_memory(args: FamilyArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                params: ParamCounts | None = None, model_name: str = "") -> MemoryPlan:
    """Both schedules' per-GPU bytes, with the sizes `options` leaves to the plan
    decided first (`size_memory`), under the run's effective options (`effective_options`:
    the plan's options, which its prompt items and the run's prompt work read). Sizes
    the run set are taken as given: when they do not fit, a warning says which phase
    and by how much. `params` may be passed to skip recounting."""
    params = params or count_params(args)
    options = effective_options(args, options)
    sizes = size_memory(args, layout, batch, options, params)
    resolved = replace(options, kv_pool=float(sizes.kv_pool), micro_batch_tokens=sizes.micro_batch_tokens)
    shapes = _Shapes(args, layout, batch, resolved, params)
    budget = sizes.prefix_budget_for(sizes.kv_pool)
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
                      shapes.items, shapes.states, admits, budget, model_name, shapes.lora,
                      shapes.experts)


def effective_options(args: FamilyArgs, options: MemoryOptions) -> MemoryOptions:
    """`options` with the run's effective freeze_vision: with LoRA the vision tower is frozen (no
    gradients, no moments, no graph through it: its items reuse the rollout's features) unless
    lora.train_vision trains it in full or adapters reach it (lora.target_modules, exclude_modules)."""
    if options.lora.rank == 0:
        return options
    trains = options.lora.train_vision or count_lora(args, options.lora, options.freeze_vision).adapters().vision > 0
    return replace(options, freeze_vision=not trains)


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
