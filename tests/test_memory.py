"""Phase-aware memory on CPU, measured: the memory plan sizes a run within a
device-memory cap and predicts each phase's peak; the prompt-work scheduler admits
prompt work by the plan's own estimate, which matches what a prompt forward
keeps; no tensor memory grows across steps; a run that cannot fit fails before
any work starts, naming the bytes and the settings to change."""

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.config import LoRAConfig, load_config
from rollplex.models import build_model
from rollplex.models.inputs import Prompt
from rollplex.models import expert_parallel
from rollplex.models.expert_parallel import TokenDispatcher
from rollplex.models.moe import MoEArgs, Routing, SparseMoE
from rollplex.models.qwen3_vl_moe import TextArgs as MoETextArgs
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs
from rollplex.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION
from rollplex.models.qwen3_5 import tiny_args as qwen3_5_tiny_args
from rollplex.models.qwen3_5.decoder import HybridDecoderLayer
from rollplex.models.qwen3_5.mixing import PackedHybridAttention
from rollplex.rl import memory, prompt_work
from rollplex.rl.loop import RLTrainer, balanced_share
from rollplex.rl.trainer import build_trainer
from rollplex.rl.memory import (MemoryOptions, MemoryPlanError, live_tensor_bytes, loop_phase_bytes,
                                kept_prompt_state)
from rollplex.rl.memory.estimates import (_layer_forward_bytes, deltanet_layer_bytes, dispatch_bytes,
                                          sparse_mlp_bytes, sparse_mlp_forward_bytes)
from rollplex.rl.schedules.prompt_items import PromptItem
from rollplex.train.actor import Actor, ActorConfig
from rollplex.train.kept_prefix import prepare_prompts, prompt_forward
from rollplex.train.lora import apply_lora, freeze_base, is_adapter
from rollplex.train.parallelize import apply_activation_checkpointing
from test_model import IMG, VEND, VID, VSTART, image, tiny_args
from test_shared_prefix import groups

FAST = ["--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4", "--trainer.eval_every", "0",
        "--trainer.save_every", "0", "--logging.no_console", "--algorithm.kl_coef", "0.01"]

# A run the plan sizes by itself (0 = the plan's) within a 33.5 MB device: a tiny model wide enough that the
# plan's classes, not the process's own small tensors, make the peaks; every response at full length (the
# plan's shapes). The decode window could hold all the prompt work, the update cannot beside its micro-batch
# and gradients: the budget keeps the reference model's K/V and defers the actor's graph.
CAP = 33_500_000
CAPPED = ["--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4", "--rollout.ignore_eos", "true",
          "--data.val_size", "1", "--trainer.eval_every", "0", "--trainer.save_every", "0", "--logging.no_console",
          "--algorithm.kl_coef", "0.01", "--schedule.kind", "overlap", "--model.tiny.hidden_size", "128",
          "--model.tiny.intermediate_size", "512", "--model.tiny.vocab_size", "2048",
          "--model.tiny.vision_hidden_size", "32", "--rollout.kv_cache_memory", "0",
          "--trainer.max_tokens_per_micro_batch", "0", "--schedule.prefix_memory_budget", "0",
          "--trainer.device_memory", str(CAP)]


def test_memory_does_not_grow_over_25_steps(tmp_path):
    """The overlap schedule streaming finished groups keeps the most state (KV pool,
    kept prompts and their graphs, vision features, the streamed groups' logprobs and
    the update they started; response limits drawn per prompt, so groups finish
    apart): after step 3 nothing of it may accumulate."""
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--schedule.kind", "overlap",
                                            "--schedule.stream_groups", "true", "--rollout.min_tokens", "1",
                                            "--rollout.max_tokens", "8", "--trainer.total_steps", "25"]))
    batches = trainer._batches(0)
    sizes, streamed = [], 0.0
    for step in range(1, 26):
        trainer.step = step
        streamed += trainer.train_step(next(batches))["stream/update_groups"]
        sizes.append(live_tensor_bytes())
    assert streamed > 0
    assert max(sizes[3:]) <= sizes[2], f"live tensor bytes after step 3: {sizes[2]}, later up to {max(sizes[3:])}"
    assert trainer.engine.cache.nbytes == trainer.engine.cache.pool_bytes()  # one pool, held all run


def test_live_tensor_bytes_counts_real_storage_and_passes_over_fake_tensors():
    """torch.compile (FlexAttention on CUDA) leaves fake tensors alive in its caches: they hold no memory,
    and reading their storage's address raises, which would end a run at its step metrics."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = live_tensor_bytes()
    with FakeTensorMode():
        fake = torch.empty(1 << 20)
    real = torch.empty(1 << 18)
    assert live_tensor_bytes() - before == real.nbytes
    del fake


def measured_step(trainer: RLTrainer, batches, step: int, planned: dict[str, int]) -> tuple[dict, dict, dict]:
    """Train step `step`: its metrics, each phase's measured peak of live tensor bytes, and each
    planned phase's relative error against it."""
    trainer.step = step
    metrics = trainer.train_step(next(batches))
    measured = {k.rsplit("/", 1)[1]: v * 2**30 for k, v in metrics.items()
                if k.startswith("perf/max_memory_allocated_gb/")}
    return metrics, measured, {phase: measured[phase] / planned[phase] - 1 for phase in planned}


def test_the_plan_sizes_a_capped_run_and_predicts_each_phase(tmp_path):
    """8 overlap steps within the cap (test_memory_does_not_grow_over_25_steps runs longer): every size is the plan's, every phase's
    measured peak of live tensor bytes (trainer.device_memory on CPU turns the
    measuring on) stays under the cap, and from step 2 the plan is within 10% of
    each phase's peak. Step 1 holds no AdamW moments before its update: its gen
    peak is the plan's less the moments."""
    trainer = RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path)]))
    plan, sizes = trainer.memory, trainer.memory.sizes
    assert trainer.engine.cache.pool_bytes() <= sizes.kv_pool
    assert trainer.actor.config.max_tokens_per_micro_batch == sizes.micro_batch_tokens
    assert plan.admitted == [True, False, True]  # ref chunk 0, actor chunk 0 (deferred), ref chunk 1
    planned = loop_phase_bytes(plan)
    assert planned.keys() == {"gen", "ref", "update_actor"}
    batches = trainer._batches(0)
    for step in range(1, 9):
        metrics, measured, errors = measured_step(trainer, batches, step, planned)
        assert max(measured.values()) < CAP, measured
        assert metrics["prefix/deferred_items"] == plan.admitted.count(False)
        if step == 1:
            moments = plan.rollplex.phases["optimizer"]["optimizer_state"]
            assert abs(measured["gen"] / (planned["gen"] - moments) - 1) <= 0.1, measured
        else:
            assert all(abs(e) <= 0.1 for e in errors.values()), errors
            assert errors == pytest.approx({p: metrics[f"perf/memory_plan_error/{p}"] for p in planned})


@pytest.mark.parametrize("exclude", [".*visual.*", ""])
def test_the_plan_counts_a_lora_run_as_it_holds_its_weights_and_predicts_each_phase(tmp_path, exclude):
    """--lora.rank 8 in the capped run: the plan's frozen base is the bytes of the trainer's frozen
    parameters (outside FSDP, in the compute dtype), its adapters the trainer's adapter parameters,
    and the reference model the base itself (no weights of its own); the vision tower is frozen
    for the prompt work too unless adapters reach it; and each phase's measured peak is within 10%
    of the plan's from step 1 (the adapters' AdamW moments, absent before the first update, are a
    few KB)."""
    trainer = RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path), "--lora.rank", "8",
                                              "--lora.exclude_modules", exclude]))
    plan = trainer.memory
    params = dict(trainer.model.named_parameters())
    adapters = [p for name, p in params.items() if is_adapter(name)]
    frozen = [p for p in params.values() if not p.requires_grad]
    train = plan.rollplex.phases["train"]
    assert train["params_frozen"] == sum(p.numel() * p.element_size() for p in frozen) > 0
    assert plan.lora.adapters().total == sum(p.numel() for p in adapters) > 0
    assert train["params_sharded"] == plan.rollplex.phases["optimizer"]["grads"] == 4 * sum(p.numel() for p in adapters)
    assert set(params.values()) == set(adapters) | set(frozen)
    assert "ref_params" not in train and plan.options.ref_is_base
    frozen_tower = exclude == ".*visual.*"
    assert plan.options.freeze_vision == frozen_tower == (plan.lora.adapters().vision == 0)
    assert all(i.reuses_vision == frozen_tower for i in plan.prompt_items)
    planned = loop_phase_bytes(plan)
    batches = trainer._batches(0)
    for step in range(1, 5):
        _, _, errors = measured_step(trainer, batches, step, planned)
        assert all(abs(e) <= 0.1 for e in errors.values()), (step, errors)


# An MoE run within a cap, serial with routing replay (the schedule it runs with): the capped run's shape with
# 8 experts of 32, 2 per token, and a cap 6.5 MB higher (serial keeps no room for prompt work in the update).
MOE_CAP = 40_000_000


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_the_plan_predicts_an_moe_runs_phases(tmp_path, family):
    """A tiny MoE model's run (serial, rollout routing replay) sized by the plan: every phase's measured peak
    within 10% of the plan's from step 2 (the plan counts every expert, the route log and the samples'
    routes; step 1 holds no AdamW moments)."""
    trainer = RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path), "--model.tiny.family", family,
                                              "--schedule.kind", "serial", "--algorithm.routing_replay", "rollout",
                                              "--trainer.device_memory", str(MOE_CAP)]))
    plan = trainer.memory
    assert plan.experts.layers == plan.args.text.num_hidden_layers and plan.options.routing_replay == "rollout"
    assert all(phase.get("routes", 0) > 0 for phase in plan.rollplex.phases.values() if phase)
    planned = loop_phase_bytes(plan)
    assert planned.keys() == {"gen", "prefix", "ref", "update_actor"}
    batches = trainer._batches(0)
    for step in range(1, 3):
        _, measured, errors = measured_step(trainer, batches, step, planned)
        assert max(measured.values()) < MOE_CAP, measured
        if step > 1:
            assert all(abs(e) <= 0.1 for e in errors.values()), (step, errors)


def test_the_scheduler_admits_by_the_plans_estimate(tmp_path):
    """One estimator: the loop's prompt work carries the plan's per-item estimates,
    and the scheduler admits it by the plan's rule, so a step keeps exactly the
    state the plan counted."""
    trainer = RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path)]))
    plan = trainer.memory
    assert prompt_work.admitted is memory.admitted
    state = trainer.rollout(balanced_share(next(trainer._batches(0)), 1, 0), 1)  # CAPPED: overlap
    scheduler = state.prompt_work
    items = scheduler.admitted + scheduler.deferred
    assert sorted((w.kind, w.chunk) for w in items) == sorted((i.kind, i.chunk) for i in plan.prompt_items)
    states = {(i.kind, i.chunk): s for i, s in zip(plan.prompt_items, plan.prompt_states)}
    assert all(w.estimate == states[w.kind, w.chunk].total for w in items)
    assert [(w.kind, w.chunk) for w in scheduler.deferred] == \
        [(i.kind, i.chunk) for i, a in zip(plan.prompt_items, plan.admitted) if not a]


# ----------------------------------------------------------------------------- one prompt forward, measured


def prompt_args() -> ModelArgs:
    return ModelArgs(
        vision=VisionArgs(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                          window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
        text=TextArgs(vocab_size=100, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=[4, 6, 6], rope_theta=10000.0),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        eos_token_id=94, bos_token_id=95)


def prompts() -> list[Prompt]:
    out = []
    for seed in range(3):
        pixels, grid, n = image(1, 8, 8, seed=seed)
        ids = [1, VSTART] + [IMG] * n + [VEND] + [j % 80 + 5 for j in range(150)]
        out.append(Prompt(torch.tensor(ids), pixel_values=pixels, image_grid_thw=grid))
    return out


def memory_events(fn) -> list[int]:
    """The bytes of each allocation (> 0) and free (< 0) `fn` makes, in order (the torch profiler's memory
    events); `fn` returns what it keeps."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()
    assert kept is not None
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    return [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())]


def bytes_kept(fn) -> int:
    """Bytes `fn` allocates and does not free."""
    return sum(memory_events(fn))


def peak_bytes(fn) -> int:
    """The most bytes `fn` holds at once of what it allocates."""
    held, peak = 0, 0
    for nbytes in memory_events(fn):
        held += nbytes
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("item", [PromptItem("ref", 0, keep_graph=False, reuses_vision=True),
                                  PromptItem("actor", 0, keep_graph=True, reuses_vision=True),
                                  PromptItem("actor", 0, keep_graph=True, reuses_vision=False)])
def test_prefix_state_estimate_matches_what_a_prompt_forward_keeps(item, checkpointing):
    """The estimate the scheduler admits by is within 10% of the bytes a prompt
    forward keeps: K/V once (not also in the graph), and with activation
    checkpointing only each layer's input in the graph."""
    model = build_model(prompt_args(), seed=0)
    if checkpointing:
        apply_activation_checkpointing(model)
    ps = prompts()
    vision = None
    if item.reuses_vision:
        with torch.no_grad():
            vision = model.encode_vision(torch.cat([p.pixel_values for p in ps]),
                                         torch.cat([p.image_grid_thw for p in ps]), None, None)
    chunk = prepare_prompts(model, ps, vision)

    def forward():
        with torch.set_grad_enabled(item.keep_graph):
            for result in prompt_forward(model, chunk):
                pass
        return result.boundary() if item.keep_graph else result

    held = bytes_kept(forward)
    options = MemoryOptions(param_dtype=torch.float32, activation_checkpointing=checkpointing)
    estimate = kept_prompt_state(model.args, item, len(ps), sum(len(p.input_ids) for p in ps),
                            sum(p.pixel_values.shape[0] for p in ps), options).total
    assert abs(estimate / held - 1) <= 0.1, (estimate, held)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("vision_adapters", [False, True])
def test_the_estimate_matches_what_a_lora_prompt_forward_keeps(checkpointing, dropout, vision_adapters):
    """With adapters on a frozen base the actor's prompt forward keeps, within 10% of the estimate,
    each adapter's rank-wide product, with dropout its dropped input and mask, and its frozen norms
    no normalised value; with adapters in the vision tower its graph too, else it reuses the features."""
    lora = LoRAConfig(rank=8, dropout=dropout, exclude_modules="" if vision_adapters else ".*visual.*")
    model = build_model(prompt_args(), seed=0)
    apply_lora(model, lora)
    freeze_base(model, torch.float32)
    if checkpointing:
        apply_activation_checkpointing(model)
    model.train()  # dropout where gradients flow
    ps = prompts()
    vision = None
    if not vision_adapters:
        with torch.no_grad():
            vision = model.encode_vision(torch.cat([p.pixel_values for p in ps]),
                                         torch.cat([p.image_grid_thw for p in ps]), None, None)
    chunk = prepare_prompts(model, ps, vision)

    def forward():
        for result in prompt_forward(model, chunk):
            pass
        return result.boundary()

    held = bytes_kept(forward)
    options = MemoryOptions(param_dtype=torch.float32, activation_checkpointing=checkpointing, lora=lora)
    item = PromptItem("actor", 0, keep_graph=True, reuses_vision=not vision_adapters)
    estimate = kept_prompt_state(model.args, item, len(ps), sum(len(p.input_ids) for p in ps),
                                 sum(p.pixel_values.shape[0] for p in ps), options).total
    assert abs(estimate / held - 1) <= 0.1, (estimate, held)


def test_the_backward_of_a_checkpointed_prompt_forward_keeps_no_second_copy_of_its_kv():
    model = build_model(prompt_args(), seed=0)
    apply_activation_checkpointing(model)
    for kept in prompt_forward(model, prepare_prompts(model, prompts())):
        pass
    kept.last_hidden.float().square().sum().backward()  # recomputes every layer
    assert len(kept.keys) == len(kept.values) == model.args.text.num_hidden_layers


@pytest.mark.parametrize("dtype,within", [(torch.float32, 0.02), (torch.bfloat16, 0.1)])
def test_a_deltanet_layer_keeps_and_peaks_at_what_the_plan_estimates(dtype, within):
    """A Gated DeltaNet decoder layer over two 256-token sequences (the plain-torch chunked rule) keeps for
    backward what `deltanet_layer_bytes` counts: within 2% in float32, within 10% in bfloat16 (Qwen3.5's
    zero-centred norms keep float32 copies the estimate leaves out); its forward without a graph peaks within
    15% of the plan's estimate of a layer's forward (the rule's intermediates, not the MLP's, make it)."""
    base = qwen3_5_tiny_args()
    text = dataclasses.replace(base.text, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               layer_types=[LINEAR_ATTENTION, FULL_ATTENTION], linear_key_head_dim=64,
                               linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4)
    args = dataclasses.replace(base, text=text)
    layer = HybridDecoderLayer(text, 0).to(dtype)
    tokens, mixing = 512, PackedHybridAttention([0, 256, 512], "cpu")
    x = torch.randn(tokens, text.hidden_size, dtype=dtype, requires_grad=True)
    held = bytes_kept(lambda: layer(x, None, None, mixing))  # a DeltaNet layer reads no rotary table
    estimate = tokens * deltanet_layer_bytes(text, dtype.itemsize)
    assert abs(estimate / held - 1) <= within, (estimate, held)
    with torch.no_grad():
        peak = peak_bytes(lambda: layer(x, None, None, mixing))
    estimate = tokens * _layer_forward_bytes(args, dtype.itemsize, 1, "torch")
    assert abs(estimate / peak - 1) <= 0.15, (estimate, peak)


# ----------------------------------------------------------------------------- MoE blocks, measured

MOE_TOKENS = 512


def moe_text(shared: bool) -> MoETextArgs:
    """A decoder's text args with 16 experts of width 64, 4 per token (and a shared expert of 96)."""
    return MoETextArgs(hidden_size=128, moe=MoEArgs(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                                                    shared_expert_intermediate_size=96 if shared else 0))


def moe_block(text: MoETextArgs, dtype: torch.dtype, backend: str) -> tuple[SparseMoE, torch.Tensor]:
    torch.manual_seed(0)
    block = SparseMoE(text.hidden_size, text.moe, layer=0).to(dtype)
    block.experts.backend = backend
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    return block, torch.randn(MOE_TOKENS, text.hidden_size, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("backend", ["grouped", "loop"])
def test_an_moe_block_keeps_and_peaks_at_what_the_plan_estimates(dtype, shared, backend):
    """A sparse MoE block (router, 4 of 16 experts per token, a shared expert or none), routing as a
    training pass does (recording its routes), keeps for backward what `sparse_mlp_bytes` counts
    within 1% (besides its output), with either grouped GEMM backend; without a graph, with the grouped
    GEMM (the GPU's backend: the CPU loop also holds each expert's piece beside their concatenation), it
    peaks within 10% of `sparse_mlp_forward_bytes`."""
    text = moe_text(shared)
    block, x = moe_block(text, dtype, backend)
    size = dtype.itemsize
    held = bytes_kept(lambda: block(x, Routing())) - MOE_TOKENS * text.hidden_size * size
    assert abs(MOE_TOKENS * sparse_mlp_bytes(text, size) / held - 1) <= 0.01, held / MOE_TOKENS
    if backend == "grouped":
        with torch.no_grad():
            peak = peak_bytes(lambda: block(x, Routing()))
        assert abs(MOE_TOKENS * sparse_mlp_forward_bytes(text, size) / peak - 1) <= 0.1, peak / MOE_TOKENS


def one_rank_exchange(monkeypatch) -> TokenDispatcher:
    """Expert parallelism's token exchange over one rank (every row sent to this rank and back), in this
    process: its all-to-alls copy, as one rank's do."""
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        output.copy_(input)

    monkeypatch.setattr(expert_parallel.dist, "all_to_all_single", all_to_all_single)
    dispatcher = object.__new__(TokenDispatcher)
    dispatcher.group, dispatcher.size = None, 1
    return dispatcher


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_parallel_dispatch_keeps_and_peaks_at_what_the_plan_estimates(monkeypatch, dtype):
    """Through the token exchange (rollplex.models.expert_parallel.TokenDispatcher) a block keeps what it
    keeps without it, within 2% (the received and returned rows replace the gathered rows and the experts'
    output; the two int64 indices a pair more, which the estimate leaves out, are 1% at this width and 0.1%
    at the hub's); without a graph it peaks within 10% of the estimate with ep > 1 (the rows sent, received,
    regrouped and returned in flight); with a graph the rows in flight beyond what it keeps are
    `dispatch_bytes`, within 5%."""
    text = moe_text(shared=False)
    block, x = moe_block(text, dtype, "grouped")
    block.experts.dispatcher = one_rank_exchange(monkeypatch)
    size = dtype.itemsize
    kept = bytes_kept(lambda: block(x, Routing()))  # with its output
    held = kept - MOE_TOKENS * text.hidden_size * size
    assert abs(MOE_TOKENS * sparse_mlp_bytes(text, size) / held - 1) <= 0.02, held / MOE_TOKENS
    with torch.no_grad():
        peak = peak_bytes(lambda: block(x, Routing()))
    assert abs(MOE_TOKENS * sparse_mlp_forward_bytes(text, size, ep=2) / peak - 1) <= 0.1, peak / MOE_TOKENS
    in_flight = peak_bytes(lambda: block(x, Routing())) - kept
    assert abs(MOE_TOKENS * dispatch_bytes(text, size) / in_flight - 1) <= 0.05, in_flight / MOE_TOKENS


# ----------------------------------------------------------------------------- sizes and failures


def test_sizes_set_in_the_config_override_the_plan(tmp_path):
    trainer = RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path), "--rollout.kv_cache_memory",
                                              "300000", "--trainer.max_tokens_per_micro_batch", "200",
                                              "--schedule.prefix_memory_budget", "1e6"]))
    sizes = trainer.memory.sizes
    assert (sizes.kv_pool, sizes.micro_batch_tokens, sizes.prefix_budget_for(12345)) == (300_000, 200, 1_000_000)
    cache = trainer.engine.cache
    block = cache.pool_bytes() // (cache.num_blocks + 1)
    assert cache.pool_bytes() <= 300_000 < cache.pool_bytes() + block
    assert trainer.actor.config.max_tokens_per_micro_batch == 200


def test_a_run_that_cannot_fit_fails_before_any_work(tmp_path):
    with pytest.raises(MemoryPlanError, match=r"training one sequence \(35 tokens\) needs .* MiB.*To fit:.*"
                                              r"parallel.activation_checkpointing.*trainer.device_memory"):
        RLTrainer(load_config(CAPPED + ["--trainer.output_dir", str(tmp_path), "--trainer.device_memory", "3e7"]))


@pytest.mark.parametrize("extra, message", [
    (["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1"], r"rollout_ranks < world size 1"),
    (["--parallel.tp", "3"], r"tp=3 does not divide the world size 1"),
    (["--data.batch_size", "1", "--algorithm.updates_per_batch", "2"],
     r"data.batch_size 1 over 1 dp rank\(s\) leaves a rank 1 prompt\(s\), fewer than algorithm.updates_per_batch 2"),
])
def test_impossible_layouts_fail_first(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        build_trainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), *extra]))
    assert not (tmp_path / "tiny_model").exists()  # raised before any work


def test_micro_batches_compute_at_most_their_token_budget():
    """The plan sizes a pass's activations by its micro-batch's tokens: without
    shared prompts every response's sequence computes its prompt again, and the
    budget counts it each time."""
    model = build_model(tiny_args(), seed=0)
    for share_prefix in (True, False):
        actor = Actor(model, ActorConfig(max_tokens_per_micro_batch=40, share_prefix=share_prefix))
        for mb in actor.micro_batches(groups()):
            prompts = sum(len(u.group.prompt.input_ids) * (1 if share_prefix else len(u.group.responses)) for u in mb)
            assert prompts + sum(len(r) for u in mb for r in u.group.responses) <= 40
