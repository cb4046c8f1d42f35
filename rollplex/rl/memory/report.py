"""The plan as text: its inputs, each phase's bytes by tensor class for both
schedules, their peaks, and what is exact, estimated or not counted."""

from __future__ import annotations

from rollplex.models.registry import family_of
from rollplex.rl.memory.estimates import layer_counts, moe_of, route_bytes_per_token
from rollplex.rl.memory.inputs import GiB, UNCOUNTED_FRACTION
from rollplex.rl.memory.plan import TENSOR_CLASSES, MemoryPlan


def _gib(n: int) -> str:
    return f"{n / GiB:9.2f}"


def _header(plan: MemoryPlan) -> list[str]:
    args, lay, b, o, p, z = plan.args, plan.layout, plan.batch, plan.options, plan.params, plan.sizes
    t = args.text
    deferred = [f"{i.kind} (chunk {i.chunk})" for i, a in zip(plan.prompt_items, plan.admitted) if not a]
    return [
        f"model {plan.model_name or '(config)'}: {p.total / 1e9:.2f}B parameters ({p.vision / 1e9:.2f}B vision, "
        f"{p.tp_split / 1e9:.2f}B split by tp), {t.num_hidden_layers} layers{_recurrent_layers(plan)}, "
        f"hidden {t.hidden_size}, {t.num_key_value_heads} kv heads x {t.head_dim}",
        *_experts_line(plan),
        f"layout: {lay.nodes} node(s) x {lay.gpus_per_node} GPUs; trainer dp_shard {lay.dp_shard} x tp {lay.tp}"
        f"{_ep(plan)}; engine tp {lay.engine_tp} ({lay.engine_replicas} replicas)",
        f"batch: {b.prompts} prompts x n {b.n}; prompt {b.prompt_tokens} text + {b.vision_tokens} vision tokens "
        f"({b.vision_patches(args)} patches); response {b.response_tokens} tokens",
        f"options: schedule {o.schedule}, {o.updates_per_batch} update(s) per batch, activation checkpointing "
        f"{o.activation_checkpointing}, freeze vision {o.freeze_vision}, optimizer offload {o.offload_optimizer}, "
        f"ref model {o.ref_model}, old prefix {o.recompute_old_logprobs}, {o.param_dtype}, {o.attention} attention"
        + (f", routing replay {o.routing_replay}" if moe_of(args) is not None else "")
        + (", multi-turn" if o.multi_turn else ""),
        *_lora_line(plan),
        f"sizes within {z.usable / GiB:.1f} GiB ({o.device_memory / GiB:.1f} GiB less {UNCOUNTED_FRACTION:.0%} "
        f"uncounted): KV pool {z.kv_pool / GiB:.2f} GiB, micro-batch {z.micro_batch_tokens} tokens, prefix budget "
        f"{plan.prefix_budget / GiB:.2f} GiB for this batch",
        f"per trainer rank: {plan.prompts_per_rank} prompts; prompt work "
        + (f"deferred to the serial path: {', '.join(deferred)}" if deferred else "all kept from the prefix phase"),
        "",
    ]


def _recurrent_layers(plan: MemoryPlan) -> str:
    """Which layers keep K/V and which a recurrent state, where some do not keep K/V (Qwen3.5)."""
    attention, recurrent = layer_counts(plan.args)
    if not recurrent:
        return ""
    state = family_of(plan.args).recurrent_state_bytes(plan.args, plan.layout.engine_tp)
    return (f" ({attention} with K/V, {recurrent} Gated DeltaNet: {state / 2 ** 20:.1f} MiB of recurrent state per "
            f"sequence on an engine rank, {plan.options.max_num_seqs} + 1 rows in the engine's state pool)")


def _experts_line(plan: MemoryPlan) -> list[str]:
    """The experts of an MoE model: how many, how wide, in which layers, and their share of the weights."""
    moe, e = moe_of(plan.args), plan.experts
    if moe is None:
        return []
    shared = (f", a shared expert of {moe.shared_expert_intermediate_size}"
              if moe.shared_expert_intermediate_size else "")
    return [f"experts: {e.layers} MoE layers of {moe.num_experts} experts of width {moe.moe_intermediate_size}, "
            f"{moe.num_experts_per_tok} per token{shared}: {e.total / 1e9:.2f}B routed-expert parameters "
            f"({e.total / plan.params.total:.0%} of the model), {e.per_layer / 1e9:.2f}B in each MoE layer"
            + (f", of which a rank gathers its 1/{plan.layout.ep} in a pass" if plan.layout.ep > 1 else
               ", all gathered with its layer's FSDP unit in a pass")]


def _ep(plan: MemoryPlan) -> str:
    lay, moe = plan.layout, moe_of(plan.args)
    if lay.ep == 1:
        return ", ep 1" if moe is not None else ""
    over = lay.dp_shard // lay.ep
    return f", ep {lay.ep} ({moe.num_experts // lay.ep} experts a rank, FSDP-sharded over {over} rank{'s' * (over > 1)})"


def _moe_notes(plan: MemoryPlan) -> list[str]:
    """What the plan counts for an MoE model, where it is one."""
    if moe_of(plan.args) is None:
        return []
    lay = plan.layout
    ep = (f"With ep {lay.ep} a pass gathers this rank's 1/{lay.ep} of a sparse layer's experts, and the rollout "
          "holds this rank's share beside the engine's own whole experts (engine_experts: rebuilt from the shares "
          "by an all-gather at each rollout start, freed after it); the master shard, gradients and moments are "
          "the same size as at ep 1 (1/ep of the experts over dp_shard/ep ranks). "
          if lay.ep > 1 else "Expert parallelism (--ep) would split a pass's gathered experts, not the rollout's. ")
    return [
        "experts (MoE): exact: every expert is counted in the weights, gradients and moments; a sparse layer's FSDP "
        f"unit gathers all its experts; the engine holds every expert whole in rollout (it runs at tp 1). {ep}"
        "Estimated per token and sparse layer (replacing the dense SwiGLU's 4 x intermediate; measured on CPU in "
        "tests/test_memory.py): the router's float32 probabilities over the experts, and per routed pair (k per "
        "token) the gathered row, gate_up's output (2 x width), silu's output and the product, the experts' "
        "output and the weighted rows (hidden each), its weight and two int64 indices; the shared expert as a dense "
        "SwiGLU; with ep > 1 the token exchange's rows in flight in a pass's working memory. Routing replay "
        f"(routes): the engine's route log (max_num_seqs x (response + 1) x {route_bytes_per_token(plan.args)} "
        "bytes: layers x k int16) in rollout, and the samples' routes (prompt once, each response) to the step's "
        "end. Not counted: an expert-parallel rank receiving more rows than its tokens send (routing imbalance), "
        "FSDP's prefetch of the next layer's unit and a layer's unsharded gradients in backward (an MoE layer's "
        "are large: left to the headroom).",
    ]


def _recurrent_notes(plan: MemoryPlan) -> list[str]:
    """What the plan counts for recurrent layers, where the model has them."""
    if not layer_counts(plan.args)[1]:
        return []
    rule = "the plain-torch chunked scan's" if plan.options.attention == "torch" else "fla's kernel's (not measured)"
    return [
        "recurrent layers (Gated DeltaNet): KV per token counts the layers with K/V only; exact: state pool = "
        "(max_num_seqs + 1) rows x one sequence's state (the convolution's last kernel - 1 inputs in the compute "
        "dtype and the float32 delta-rule state, per DeltaNet layer), allocated once and held the whole run like "
        "the KV pool; prompt K/V adds each prompt's final state, once per item. Estimated per token and DeltaNet "
        "layer: the same norms and MLP, the convolution's input, padded copy and output, q and k in float32, the "
        f"gated norm, and {rule} saved tensors per chunk of 64 tokens; its forward without a graph peaks in the "
        "rule. Not counted: Qwen3.5's zero-centred norms' second float32 copy and float32 normalised value, its "
        "gated attention's gate and q/k norms.",
    ]


def _multi_turn_notes(plan: MemoryPlan) -> list[str]:
    """What the plan counts for a multi-turn run's observations, where it is one."""
    if not plan.options.multi_turn:
        return []
    return [
        "multi-turn: the response tokens above hold the observations, at full length (KV pool, activations, "
        "logits). Their images, at most every response token a merged vision token: in each logprob pass and "
        "update micro-batch the vision tower over spatial_merge_size^2 patches per response token (its forward, "
        "and in the update its saved tensors unless it is frozen); in rollout each sample's observation features "
        "(vision_embeds), continuation prefills up to the engine's token budget and one observation's encoding "
        "(workspace). Not counted: the continuation prefill's gathered context K/V, one sequence and layer at a "
        "time.",
    ]


def _lora_line(plan: MemoryPlan) -> list[str]:
    if plan.lora is None:
        return []
    lo, adapters = plan.options.lora, plan.lora.adapters()
    return [f"lora: rank {lo.rank} on {len(plan.lora.linears)} linears ({', '.join(lo.target_modules)}, excluding "
            f"{lo.exclude_modules!r}): {adapters.total / 1e6:.2f}M adapter parameters trained, "
            f"{'the vision tower trained in full' if lo.train_vision else 'the vision tower frozen'} "
            f"(freeze vision above is the effective one); the base frozen in {plan.options.param_dtype}"]


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
        "with LoRA: the master shard, gradients and moments are the adapters' (rank x (in + out) per adapted "
        "linear, counted on a meta-device model; + the vision tower with lora.train_vision), the frozen base "
        "(params_frozen) = (tp-split/tp + replicated) elements in the compute dtype, whole on every dp rank, never "
        "gathered, and engine_adapters = the engine's own copy of the adapters, kept for the run; "
        "gathered weights = all of them in rollout and prompt work, FSDP's root unit + 1 decoder layer in passes; "
        "KV per token = 2 x layers x kv_heads/tp x head_dim x dtype; KV pool = every sample's blocks at full length, "
        "at most what every phase leaves (allocated once, held the whole run); prompt K/V = that per prompt token, once per item "
        "(ref, actor, old); vision embeds = vision tokens x hidden x dtype.",
        "estimated from what the model's code saves for backward: per token and decoder layer 2 RMSNorms "
        "(float32 input, normalised value, output) + attention (q, k, v, output; the torch path's gathered copies) + "
        "4 x intermediate (+ per adapted linear its rank-wide product, and with lora.dropout its dropped input and "
        "mask); with checkpointing the layer's input; the prefix graph = that over the actor's prompt "
        "tokens (+ the vision tower over its patches unless it reuses cached features); a training micro-batch = "
        "that over its tokens + max(logits: 6 float32 vocabulary rows per response token with the entropy bonus, "
        "over one chunk of the head's tokens at most, one layer's backward); a logprob pass = max(one layer's "
        "forward, logits: 2 rows); workspace = the engine's "
        "prefill layer or decode logits and sampling, or a prompt slice's layer.",
        *_recurrent_notes(plan),
        *_moe_notes(plan),
        *_multi_turn_notes(plan),
        "naive = the same tensors with nothing ever freed: each class at its largest, in every phase "
        "(so optimizer offload does not apply to it).",
        f"not counted (the {UNCOUNTED_FRACTION:.0%} headroom): allocator fragmentation, library workspaces, "
        "the CUDA context, FSDP's reduce buffers, optimizer temporaries.",
    ]
    return "\n".join(lines)


def format_lora_saving(lora: MemoryPlan, full: MemoryPlan) -> str:
    """The LoRA plan's update (the train and optimizer phases) beside the same run's without adapters
    at the same sizes (`full`): what the frozen base saves, class by class."""
    classes = ("params_sharded", "params_frozen", "engine_adapters", "grads", "optimizer_state")

    def update(plan: MemoryPlan) -> tuple[int, dict[str, int]]:
        phase = max(("train", "optimizer"), key=plan.rollplex.total)
        return plan.rollplex.total(phase), {c: plan.rollplex.phases["optimizer"].get(c, 0) for c in classes}

    (lora_peak, lora_state), (full_peak, full_state) = update(lora), update(full)

    def state(by_class: dict[str, int]) -> str:
        return ", ".join(f"{c} {b / GiB:.2f}" for c, b in by_class.items() if b)

    fits = "fits" if full_peak <= full.sizes.usable else "does NOT fit"
    return "\n".join([
        "LoRA against full fine-tuning, same sizes (KV pool, micro-batch, prefix budget), update phase per GPU:",
        f"  full fine-tuning: {full_peak / GiB:8.2f} GiB ({fits} in {full.sizes.usable / GiB:.1f} GiB usable); "
        f"weights and optimizer state {sum(full_state.values()) / GiB:.2f} GiB ({state(full_state)})",
        f"  LoRA rank {lora.options.lora.rank}:      {lora_peak / GiB:8.2f} GiB; weights and optimizer state "
        f"{sum(lora_state.values()) / GiB:.2f} GiB ({state(lora_state)})",
        f"  saved: {(sum(full_state.values()) - sum(lora_state.values())) / GiB:.2f} GiB of weights and optimizer "
        f"state; {(full_peak - lora_peak) / GiB:.2f} GiB of the update's peak at these sizes (with the vision "
        "tower's graph, where LoRA freezes it)",
    ])
