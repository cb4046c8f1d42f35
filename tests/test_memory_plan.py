"""The memory plan: its exact figures equal hand-computed sizes, its schedules keep
their invariants (naive never below Rollplex, each class within its lifetime), it
decides the sizes a run leaves to it within the device's memory or says what does
not fit, it counts Qwen3.5's recurrent state and the K/V of its attention layers
only, an MoE model's experts (whole in a sparse layer's unit, split by expert
parallelism), its sparse layers' activations and routing replay's routes, and it
predicts the first H200 run's measured peaks."""

import dataclasses
import functools
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from rollplex.config import LoRAConfig, config_from_dict
from rollplex.models import qwen3_5, qwen3_5_moe, qwen3_vl_moe
from rollplex.models.qwen3_5 import FULL_ATTENTION, LINEAR_ATTENTION
from rollplex.models.registry import family_of
from rollplex.models.qwen2_5_vl.hf import hf_config_from_args
from rollplex.models.qwen2_5_vl import ModelArgs, Qwen2_5_VL, TextArgs, VisionArgs
from rollplex.models.qwen_vl.tp_plan import decoder_layer_plan
from rollplex.rl.memory import (GiB, PHASES, PRESETS, TENSOR_CLASSES, UNCOUNTED_FRACTION, BatchShape, MemoryOptions,
                                MemoryPlan, MemoryPlanError, ParallelLayout, count_lora, count_params,
                                kv_bytes_per_token, loop_phase_bytes, micro_batch, plan_memory, kept_prompt_state)
from rollplex.rl.memory.estimates import (_vision_forward_bytes, decoder_layer_bytes, deltanet_layer_bytes,
                                          dispatch_bytes, expert_counts, layer_backward_bytes, sparse_mlp_bytes,
                                          vision_patch_bytes)
from rollplex.rl.schedules.prompt_items import PromptItem, prompt_work_items
from rollplex.rl.schedules.registry import build_schedule
from rollplex.train.lora import apply_lora, is_adapter
from torch.distributed.tensor.parallel import ColwiseParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import memory_plan  # noqa: E402

V_HID, V_INTER, V_DEPTH = 32, 48, 3
HID, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 96, 2, 4, 2, 16, 100
BATCH = BatchShape(prompts=6, n=4, prompt_tokens=20, response_tokens=30, vision_tokens=16)
TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # apply_tp's layer plan
H200_REPORT = Path(__file__).resolve().parent.parent / "benchmarks/2026-11-30-h200-c98158e/bench_schedules_report.json"


def small_args(tie: bool = False) -> ModelArgs:
    return ModelArgs(
        vision=VisionArgs(depth=V_DEPTH, hidden_size=V_HID, intermediate_size=V_INTER, num_heads=2,
                          out_hidden_size=HID, fullatt_block_indexes=[1]),
        text=TextArgs(vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, mrope_section=[2, 3, 3]),
        tie_word_embeddings=tie)


@functools.cache
def model_counts(tie: bool = False) -> tuple[int, int, int, int]:
    """(total, split by tp, vision, FSDP's root unit) parameters of the built model."""
    params = dict(Qwen2_5_VL(small_args(tie)).named_parameters())
    split = sum(p.numel() for name, p in params.items() if name.startswith("language_model.layers.") and
                name.split(".")[-2] in TP_SPLIT)
    if not tie:
        split += params["language_model.embed_tokens.weight"].numel() + params["lm_head.weight"].numel()
    vision = sum(p.numel() for name, p in params.items() if name.startswith("visual."))
    units = ("language_model.layers.", "visual.blocks.")  # apply_fsdp's units; the rest is the root's
    root = sum(p.numel() for name, p in params.items() if not name.startswith(units))
    return sum(p.numel() for p in params.values()), split, vision, root


@pytest.mark.parametrize("tie", [False, True])
def test_param_counts(tie):
    counts = count_params(small_args(tie))
    assert (counts.total, counts.tp_split, counts.vision, counts.root) == model_counts(tie)


@pytest.mark.parametrize("name,total", [("qwen2.5-vl-3b", 3_754_622_976), ("qwen2.5-vl-7b", 8_292_166_656),
                                        ("qwen2.5-vl-32b", 33_452_718_336)])
def test_presets_match_the_hub_parameter_counts(name, total):
    assert count_params(PRESETS[name]).total == total


LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 1), (4, 1, 2), (1, 2, 1)]


@pytest.mark.parametrize("dp,tp,engine_tp", LAYOUTS)
def test_exact_sizes(dp, tp, engine_tp):
    args = small_args()
    total, split, _, _ = model_counts()
    layout = ParallelLayout(dp_shard=dp, tp=tp, engine_tp=engine_tp, nodes=1, gpus_per_node=dp * tp)
    plan = plan_memory(args, layout, BATCH, MemoryOptions(ref_model=True))
    shard = math.ceil((split // tp + total - split) / dp)
    kv_token = 2 * LAYERS * (KV_HEADS // engine_tp) * HEAD_DIM * 2
    prompts_per_engine = math.ceil(BATCH.prompts / (dp * tp // engine_tp))
    prompts_per_rank = math.ceil(BATCH.prompts / dp)
    blocks = prompts_per_engine * BATCH.n * math.ceil((BATCH.prompt_len + BATCH.response_tokens) / 16) + 1
    expected = {
        "params_sharded": 4 * shard,
        "optimizer_state": 2 * 4 * shard,
        "ref_params": 2 * shard,
        "params_gathered": 2 * (split // engine_tp + total - split),
        "kv_pool": blocks * 16 * kv_token,  # every sample at full length, and a sink: the pool the plan sizes
        "vision_embeds": prompts_per_rank * BATCH.vision_tokens * HID * 2,
    }
    rollout = plan.rollplex.phases["rollout"]
    assert {k: rollout[k] for k in expected} == expected
    assert plan.rollplex.phases["optimizer"]["grads"] == 4 * shard
    # the actor's and the reference model's prompt K/V and last hidden states, once per prompt, at the trainer's tp
    kv = prompts_per_rank * 2 * (BATCH.prompt_len * 2 * LAYERS * (KV_HEADS // tp) * HEAD_DIM * 2 + HID * 2)
    assert plan.rollplex.phases["train"]["prompt_kv"] == kv
    assert kv_bytes_per_token(args, torch.bfloat16, engine_tp) == kv_token


def test_frozen_vision_has_no_gradients_or_moments():
    args, layout = small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    total, _, vision, _ = model_counts()
    plan = plan_memory(args, layout, BATCH, MemoryOptions(freeze_vision=True))
    assert plan.rollplex.phases["optimizer"]["grads"] == 4 * math.ceil((total - vision) / 2)
    assert plan.rollplex.phases["optimizer"]["optimizer_state"] == 8 * math.ceil((total - vision) / 2)
    assert plan.rollplex.phases["rollout"]["params_sharded"] == 4 * math.ceil(total / 2)


def test_prefix_items_and_their_state():
    """Per chunk: the reference model's prompt K/V, the actor's graph (first chunk)
    or the old policy's K/V (later chunks); the K/V are exact and kept once."""
    options = MemoryOptions(ref_model=True, recompute_old_logprobs=True, updates_per_batch=2)
    assert [(i.kind, i.chunk, i.keep_graph) for i in prompt_work_items(options)] == \
        [("ref", 0, False), ("actor", 0, True), ("ref", 1, False), ("old", 1, False)]
    args, per_token = small_args(), 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    ref = kept_prompt_state(args, PromptItem("ref", 0, False, False), 2, 72, 64, options)
    assert (ref.kv, ref.graph) == (72 * per_token + 2 * HID * 2, 0)
    actor = kept_prompt_state(args, PromptItem("actor", 0, True, False), 2, 72, 64, options)
    assert actor.kv == ref.kv and actor.graph > 0
    checkpointed = kept_prompt_state(args, PromptItem("actor", 0, True, False), 2, 72, 64,
                                dataclasses.replace(options, activation_checkpointing=True))
    assert checkpointed.kv == ref.kv and checkpointed.graph < actor.graph / 4
    reusing = kept_prompt_state(args, PromptItem("actor", 0, True, True), 2, 72, 64, options)  # no vision tower graph
    assert reusing.graph < actor.graph
    with pytest.raises(ValueError, match="unknown prefix kind"):
        kept_prompt_state(args, PromptItem("critic", 0, False, False), 1, 1, 0, options)
    with pytest.raises(ValueError, match="does not divide"):
        kv_bytes_per_token(args, tp=4)


# ----------------------------------------------------------------------------- Qwen3.5's recurrent state


def hybrid_args():
    """Qwen3.5's tiny shape with 3 Gated DeltaNet layers and 1 full-attention layer."""
    return qwen3_5.tiny_args(layer_types=(LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,))


def test_the_qwen3_5_plan_counts_its_state_pool_and_the_kv_of_its_attention_layers():
    """The engine's state pool (max_num_seqs rows and a sink, each a sequence's conv tail and fp32 state over
    the 3 DeltaNet layers) is held in every phase; the KV pool, its blocks and the prompts' K/V count the one
    full-attention layer; each kept prompt keeps its final recurrent state too."""
    args, layout = hybrid_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    t = args.text
    plan = plan_memory(args, layout, BATCH, MemoryOptions(ref_model=True, max_num_seqs=16))
    keys, values = t.linear_num_key_heads * t.linear_key_head_dim, t.linear_num_value_heads * t.linear_value_head_dim
    state = 3 * ((2 * keys + values) * (t.linear_conv_kernel_dim - 1) * 2 +
                 t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim * 4)
    assert all(phase["state_pool"] == 17 * state for phase in plan.rollplex.phases.values() if phase)
    kv_token = 2 * 1 * t.num_key_value_heads * t.head_dim * 2
    assert kv_bytes_per_token(args) == kv_token
    prompts_per_rank = math.ceil(BATCH.prompts / 2)
    blocks = prompts_per_rank * BATCH.n * math.ceil(BATCH.sequence_len / 16)  # an engine per GPU: 3 prompts each
    assert plan.rollplex.phases["rollout"]["kv_pool"] == (blocks + 1) * 16 * kv_token
    assert plan.kv_pool_blocks == blocks
    # the reference model's and the actor's prompt K/V, last hidden states and final recurrent states
    prompt_state = BATCH.prompt_len * kv_token + t.hidden_size * 2 + state
    assert plan.rollplex.phases["train"]["prompt_kv"] == prompts_per_rank * 2 * prompt_state


def test_the_state_pool_is_fixed_memory_taken_before_the_kv_pool():
    """Where the device limits the KV pool, a larger state pool (more decode rows) leaves it that much less."""
    args, layout = hybrid_args(), ParallelLayout()
    sized = MemoryOptions(micro_batch_tokens=BATCH.longest_sequence, max_num_seqs=20)
    need = plan_memory(args, layout, BATCH, sized).sizes.kv_pool
    # What every phase holds beside a KV pool of 2 bytes (and no prompt state), at 20 rows: room for half the need.
    fixed = dataclasses.replace(sized, kv_pool=2.0, prefix_budget=2.0)
    held = plan_memory(args, layout, BATCH, fixed).rollplex.peak - 2
    device = math.ceil((held + need // 2) / (1 - UNCOUNTED_FRACTION))
    plans = [plan_memory(args, layout, BATCH, dataclasses.replace(sized, max_num_seqs=rows, device_memory=device))
             for rows in (16, 20)]
    state_pools = [p.rollplex.phases["rollout"]["state_pool"] for p in plans]
    assert plans[0].sizes.kv_pool < need
    assert plans[0].sizes.kv_pool - plans[1].sizes.kv_pool == state_pools[1] - state_pools[0] > 0


def test_activations_follow_each_layer_kind():
    """The actor's prompt graph sums each layer's kind (3 DeltaNet layers, 1 attention) and the final norm;
    one layer's backward (what checkpointing recomputes) is the larger kind's, the DeltaNet's."""
    args, size = hybrid_args(), 4
    t, options = args.text, MemoryOptions(param_dtype=torch.float32)
    graph = kept_prompt_state(args, PromptItem("actor", 0, True, True), 2, 100, 0, options).graph
    final_norm = (4 + size) * t.hidden_size
    assert graph == 100 * (3 * deltanet_layer_bytes(t, size) + decoder_layer_bytes(t, size) + final_norm)
    assert layer_backward_bytes(args, size, 1, options) == deltanet_layer_bytes(t, size) > decoder_layer_bytes(t, size)
    flash = dataclasses.replace(options, attention="flash")  # fla's kernel keeps far less than the torch scan
    assert deltanet_layer_bytes(t, size, attention="flash") < deltanet_layer_bytes(t, size)
    assert layer_backward_bytes(args, size, 1, flash) == deltanet_layer_bytes(t, size, attention="flash")


# ----------------------------------------------------------------------------- MoE


MOE_FAMILIES = ["qwen3_vl_moe", "qwen3_5_moe"]


def moe_args(family: str):
    """The MoE families' tiny shapes: Qwen3-VL-MoE's with 3 layers, the second dense (mlp_only_layers), 8
    experts of 48, 2 per token; Qwen3.5-MoE's, every layer sparse (2 DeltaNet, 1 attention), 8 experts of 16,
    2 per token, a shared expert of 24."""
    return qwen3_vl_moe.tiny_args(layers=3, mlp_only_layers=(1,)) if family == "qwen3_vl_moe" else \
        qwen3_5_moe.tiny_args()


def built_units(args) -> tuple[int, int, int, int]:
    """The built model's (on the meta device) elements: in all, in FSDP's root unit, in its largest decoder
    layer, and in one MoE layer's experts (gate_up_proj and down_proj)."""
    family = family_of(args)
    with torch.device("meta"):
        model = family.model_class(args)
    tower = {id(m) for m in family.vision_tower(model).modules()}
    units = [block for blocks in family.repeated_blocks(model) for block in blocks]
    layers = [sum(p.numel() for p in b.parameters()) for b in units if id(b) not in tower]
    experts = next(m for m in model.modules() if type(m).__name__ == "Experts")
    total = sum(p.numel() for p in model.parameters())
    return (total, total - sum(p.numel() for b in units for p in b.parameters()), max(layers),
            sum(p.numel() for p in experts.parameters()))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_plans_count_every_expert_and_gather_a_sparse_layer_whole(family):
    """The plan reads the family's counts: every expert in the weights (the engine gathers them all for the
    rollout), and a pass gathers FSDP's root unit and the largest layer, a sparse one with all its experts."""
    args = moe_args(family)
    total, root, layer, experts = built_units(args)
    counts, moe = count_params(args), expert_counts(args)
    assert (counts.total, counts.root, counts.layer_per_tp_rank(1)) == (total, root, layer)
    assert (moe.per_layer, moe.in_largest_layer) == (experts, experts)
    assert moe.layers == sum(args.text.moe.is_sparse(i) for i in range(args.text.num_hidden_layers))
    plan = plan_memory(args, ParallelLayout(dp_shard=2, gpus_per_node=2), BATCH, MemoryOptions(ref_model=True))
    assert plan.rollplex.phases["rollout"]["params_gathered"] == 2 * total
    assert plan.rollplex.phases["train"]["params_gathered"] == 2 * (root + layer)
    assert plan.rollplex.phases["optimizer"]["params_sharded"] == 4 * math.ceil(total / 2)
    assert all("engine_experts" not in phase and "routes" not in phase for phase in plan.rollplex.phases.values())


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallelism_divides_the_experts_a_pass_gathers(family, ep):
    """ep splits each MoE layer's experts: a pass gathers this rank's 1/ep of a sparse layer's; the master
    shard, gradients and moments stay the size they are (1/ep of the experts over dp_shard / ep ranks); the
    rollout holds the trainer's share beside the engine's whole experts (rebuilt from the shares)."""
    args, options = moe_args(family), MemoryOptions(ref_model=True)
    _, _, _, experts = built_units(args)
    whole, split = (plan_memory(args, ParallelLayout(dp_shard=4, gpus_per_node=4, ep=e), BATCH, options).rollplex
                    for e in (1, ep))
    moe = expert_counts(args)
    for cls in ("params_sharded", "optimizer_state", "grads", "ref_params"):
        assert split.phases["optimizer"][cls] == whole.phases["optimizer"][cls]
    for phase in ("train", "logprobs"):
        assert whole.phases[phase]["params_gathered"] - split.phases[phase]["params_gathered"] == \
            2 * (experts - experts // ep)
    rollout = split.phases["rollout"]
    assert rollout["engine_experts"] == 2 * moe.total and "engine_experts" not in whole.phases["rollout"]
    assert rollout["params_gathered"] == whole.phases["rollout"]["params_gathered"] - 2 * (moe.total - moe.total // ep)
    assert split.phases["prefix"]["engine_experts"] == 2 * moe.total  # the prompt work runs on the rollout's weights


def test_expert_parallel_layouts_that_cannot_split_are_refused():
    args = moe_args("qwen3_vl_moe")
    with pytest.raises(ValueError, match="ep 3 does not divide dp_shard 4"):
        ParallelLayout(dp_shard=4, gpus_per_node=4, ep=3)
    with pytest.raises(ValueError, match="expert parallelism runs at tp 1"):
        ParallelLayout(dp_shard=2, tp=2, gpus_per_node=4, ep=2)
    with pytest.raises(ValueError, match="no MoE layers to split"):
        plan_memory(small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2, ep=2), BATCH, MemoryOptions())
    with pytest.raises(ValueError, match="ep 16 does not divide the MoE layers' 8 experts"):
        plan_memory(args, ParallelLayout(dp_shard=16, gpus_per_node=16, ep=16), BATCH, MemoryOptions())


def test_sparse_layers_replace_the_dense_mlp_term():
    """A sparse layer keeps its MoE block's tensors in place of the SwiGLU's four intermediates; the prompt
    graph sums each layer by its kind (Qwen3-VL-MoE: 2 sparse, 1 dense; Qwen3.5-MoE: 2 sparse DeltaNet, 1
    sparse attention); one layer's backward is the largest kind's, with the token exchange's rows in flight
    under expert parallelism."""
    size, options = 4, MemoryOptions(param_dtype=torch.float32)
    vl = moe_args("qwen3_vl_moe")
    t = vl.text
    assert decoder_layer_bytes(t, size, sparse=True) - decoder_layer_bytes(t, size) == \
        sparse_mlp_bytes(t, size) - 4 * t.intermediate_size * size
    graph = kept_prompt_state(vl, PromptItem("actor", 0, True, True), 2, 100, 0, options).graph
    final_norm = (4 + size) * t.hidden_size
    assert graph == 100 * (2 * decoder_layer_bytes(t, size, sparse=True) + decoder_layer_bytes(t, size) + final_norm)
    assert layer_backward_bytes(vl, size, 1, options) == decoder_layer_bytes(t, size, sparse=True)
    assert layer_backward_bytes(vl, size, 1, options, ep=2) == \
        decoder_layer_bytes(t, size, sparse=True) + dispatch_bytes(t, size)
    hybrid = moe_args("qwen3_5_moe")
    t = hybrid.text
    graph = kept_prompt_state(hybrid, PromptItem("actor", 0, True, True), 2, 100, 0, options).graph
    assert graph == 100 * (2 * deltanet_layer_bytes(t, size, sparse=True) + decoder_layer_bytes(t, size, sparse=True)
                           + (4 + size) * t.hidden_size)
    assert sparse_mlp_bytes(t, size) > 4 * t.moe.num_experts_per_tok * t.moe.moe_intermediate_size * size


def test_routing_replay_counts_the_route_log_and_the_samples_routes():
    """Rollout replay (R3): the engine's route log (a row per decode row, each response's tokens and one more)
    in rollout, and the samples' routes (each prompt once, each response) from the rollout to the step's end;
    old replay (R2): the samples' routes from the old-logprob pass on; each prompt item that replays keeps its
    prompts' routes too. All int16, layers x top-k per token."""
    args, layout = moe_args("qwen3_vl_moe"), ParallelLayout(dp_shard=2, gpus_per_node=2)
    t = args.text
    route = t.num_hidden_layers * t.moe.num_experts_per_tok * 2
    samples = math.ceil(BATCH.prompts / 2) * (BATCH.prompt_len + BATCH.n * BATCH.response_tokens) * route
    log = 16 * (BATCH.response_tokens + 1) * route
    base = MemoryOptions(ref_model=True, schedule="serial-prefix", max_num_seqs=16)
    r3 = plan_memory(args, layout, BATCH, dataclasses.replace(base, routing_replay="rollout")).rollplex.phases
    assert r3["rollout"]["routes"] == log + samples
    assert all(r3[p]["routes"] == samples for p in ("prefix", "logprobs", "train", "optimizer"))
    r2 = plan_memory(args, layout, BATCH, dataclasses.replace(base, routing_replay="old", recompute_old_logprobs=True,
                                                              updates_per_batch=2)).rollplex.phases
    assert "routes" not in r2["rollout"] and "routes" not in r2["prefix"]
    assert all(r2[p]["routes"] == samples for p in ("logprobs", "train", "optimizer"))
    item, options = PromptItem("ref", 0, False, True), dataclasses.replace(base, routing_replay="rollout")
    assert kept_prompt_state(args, item, 2, 100, 0, options).kv - kept_prompt_state(args, item, 2, 100, 0, base).kv \
        == 100 * route
    with pytest.raises(ValueError, match="routing_replay rollout: routes are an MoE model's"):
        plan_memory(small_args(), layout, BATCH, options)
    with pytest.raises(ValueError, match="needs recompute_old_logprobs"):
        MemoryOptions(routing_replay="old")


# ----------------------------------------------------------------------------- LoRA


def lora_hand_count(rank: int, tp: int = 1) -> int:
    """Adapter elements on one of `tp` ranks, all-linear without the vision tower: per decoder layer
    r x (in + out) of q, k, v, o, gate, up and down, the column-parallel ones' B and the row-parallel
    ones' A split by tp."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    column = sum(rank * HID + rank * out // tp for out in (q, kv, kv, INTER, INTER))
    row = sum(rank * inp // tp + rank * HID for inp in (q, INTER))
    return LAYERS * (column + row)


LORAS = [LoRAConfig(rank=4), LoRAConfig(rank=8, target_modules=["q_proj", "mlp.down_proj"]),
         LoRAConfig(rank=2, exclude_modules=""),  # the vision tower's linears too
         LoRAConfig(rank=4, target_modules=["lm_head", "attn.proj", "mlp.0"], exclude_modules="")]  # root, merger


@pytest.mark.parametrize("lora", LORAS)
def test_adapters_are_counted_exactly(lora):
    """count_lora's adapters are the parameters apply_lora puts on a built model, its vision ones those in the
    tower; and its elements on a TP rank are the TP plan's: B split in a column-parallel layer, A in a row one."""
    model = Qwen2_5_VL(small_args())
    apply_lora(model, lora)
    adapters = {name: p.numel() for name, p in model.named_parameters() if is_adapter(name)}
    counts = count_lora(small_args(), lora)
    assert counts.adapters().total == sum(adapters.values()) > 0
    assert counts.adapters().vision == sum(n for name, n in adapters.items() if name.startswith("visual."))
    assert counts.adapters().root == sum(n for name, n in adapters.items()
                                         if not name.startswith(("language_model.layers.", "visual.blocks.")))
    assert counts.vision == count_params(small_args()).vision
    plan = decoder_layer_plan(qk_norm=False)
    for linear in counts.linears:
        if linear.unit == "decoder":
            a, b = lora.rank * linear.in_features, lora.rank * linear.out_features
            column = isinstance(plan[linear.name.split(".", 3)[3]], ColwiseParallel)  # language_model.layers.N.<name>
            assert linear.elements(lora.rank, tp=2) == (a + b // 2 if column else a // 2 + b), linear


def test_the_default_adapters_match_the_hand_count_at_every_tp():
    counts = count_lora(small_args(), LoRAConfig(rank=4)).adapters()
    for tp in (1, 2):
        assert counts.per_tp_rank(tp) == lora_hand_count(4, tp)
    assert counts.layer_per_tp_rank(2) * LAYERS == lora_hand_count(4, 2) and counts.root == counts.vision == 0


@pytest.mark.parametrize("dp,tp,engine_tp", LAYOUTS)
def test_lora_exact_sizes(dp, tp, engine_tp):
    """The frozen base in the compute dtype, whole over dp_shard and split by tp; the adapters' fp32
    master, gradients and moments sharded over dp; the engine's own bf16 copy of them; the trainer's
    adapters gathered in rollout (and the base rebuilt for an engine TP layout a split trainer does
    not share); no reference copy (it is the base)."""
    total, split, _, _ = model_counts()
    layout = ParallelLayout(dp_shard=dp, tp=tp, engine_tp=engine_tp, nodes=1, gpus_per_node=dp * tp)
    plan = plan_memory(small_args(), layout, BATCH, MemoryOptions(ref_model=True, lora=LoRAConfig(rank=4)))
    adapters = math.ceil(lora_hand_count(4, tp) / dp)
    rebuilt = split // engine_tp + total - split if tp > 1 and engine_tp != tp else 0
    rollout, optimizer = plan.rollplex.phases["rollout"], plan.rollplex.phases["optimizer"]
    assert {k: rollout[k] for k in ("params_sharded", "params_frozen", "engine_adapters", "optimizer_state",
                                    "params_gathered")} == {
        "params_sharded": 4 * adapters, "params_frozen": 2 * (split // tp + total - split),
        "engine_adapters": 2 * lora_hand_count(4, engine_tp), "optimizer_state": 8 * adapters,
        "params_gathered": 2 * (lora_hand_count(4, tp) + rebuilt)}
    assert optimizer["grads"] == 4 * adapters and "ref_params" not in rollout
    assert plan.rollplex.phases["logprobs"]["params_gathered"] == 0  # the reference passes read the base in place
    assert plan.gathered_ref_bytes() == 0


def test_lora_freezes_the_vision_tower_unless_it_trains_or_has_adapters():
    """The plan's freeze_vision is the run's effective one, which the prompt items read; with
    lora.train_vision the tower is FSDP's, trained in full, and the reference model a copy again."""
    args, layout = small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    _, _, vision, _ = model_counts()
    frozen, adapted, trained = (
        plan_memory(args, layout, BATCH, MemoryOptions(ref_model=True, lora=lora))
        for lora in (LoRAConfig(rank=4), LoRAConfig(rank=4, exclude_modules=""), LoRAConfig(rank=4, train_vision=True)))
    assert frozen.options.freeze_vision and all(i.reuses_vision for i in frozen.prompt_items)
    for plan in (adapted, trained):
        assert not plan.options.freeze_vision and not any(i.reuses_vision for i in plan.prompt_items)
    vision_adapters = adapted.lora.adapters().vision
    assert vision_adapters > 0
    assert adapted.rollplex.phases["optimizer"]["grads"] == 4 * math.ceil((lora_hand_count(4) + vision_adapters) / 2)
    assert trained.rollplex.phases["optimizer"]["grads"] == 4 * math.ceil((lora_hand_count(4) + vision) / 2)
    total = count_params(args).total
    assert trained.rollplex.phases["rollout"]["params_frozen"] == 2 * (total - vision)
    assert trained.rollplex.phases["rollout"]["ref_params"] == 2 * math.ceil(total / 2)
    assert frozen.rollplex.phases["prefix"]["prefix_graph"] < adapted.rollplex.phases["prefix"]["prefix_graph"]
    with pytest.raises(ValueError, match="lora.train_vision trains the vision tower in full, freeze_vision"):
        MemoryOptions(freeze_vision=True, lora=LoRAConfig(rank=4, train_vision=True))


LAYOUT_1 = ParallelLayout()
BATCH_7B_1 = BatchShape(prompts=8, n=8, prompt_tokens=256, response_tokens=1024, vision_tokens=1024)


def test_the_7b_one_gpu_lora_plan_by_hand():
    """Qwen2.5-VL-7B, rank 16 on every linear of the decoder (the issue's case): its base in bf16 on
    the one GPU, 40.4M adapters with fp32 master, gradient and two moments, the engine's bf16 copy.
    Full fine-tuning's fp32 master, gradients and moments alone (123.6 GiB) do not fit an 80 GiB GPU."""
    args = PRESETS["qwen2.5-vl-7b"]
    t = args.text
    h, q, kv, inter = t.hidden_size, t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim, \
        t.intermediate_size
    adapters = t.num_hidden_layers * 16 * ((h + q) * 2 + (h + kv) * 2 + (h + inter) * 3)
    assert adapters == 40_370_176
    base = 8_292_166_656  # the hub's count (test_presets_match_the_hub_parameter_counts)
    plan = plan_memory(args, LAYOUT_1, BATCH_7B_1, MemoryOptions(activation_checkpointing=True, ref_model=True,
                                                                 lora=LoRAConfig(rank=16)))
    optimizer = plan.rollplex.phases["optimizer"]
    assert {k: optimizer[k] for k in ("params_frozen", "params_sharded", "grads", "optimizer_state",
                                      "engine_adapters")} == {
        "params_frozen": 2 * base, "params_sharded": 4 * adapters, "grads": 4 * adapters,
        "optimizer_state": 8 * adapters, "engine_adapters": 2 * adapters}
    assert plan.rollplex.phases["rollout"]["params_gathered"] == 2 * adapters  # FSDP's units: the adapters only
    assert plan.rollplex.phases["train"]["params_gathered"] == 2 * adapters // t.num_hidden_layers
    assert "ref_params" not in optimizer and plan.rollplex.peak <= plan.sizes.usable
    full_state = 16 * base  # fp32 master + gradient + two moments per weight
    assert full_state - sum(optimizer[k] for k in ("params_frozen", "params_sharded", "grads", "optimizer_state",
                                                   "engine_adapters")) > 84e9


@pytest.mark.parametrize("dp,tp,engine_tp", LAYOUTS)
@pytest.mark.parametrize("options", [MemoryOptions(), MemoryOptions(ref_model=True, activation_checkpointing=True),
                                     MemoryOptions(offload_optimizer=True, freeze_vision=True, kv_pool=0.01,
                                                   recompute_old_logprobs=True, updates_per_batch=2),
                                     MemoryOptions(schedule="serial-prefix", ref_model=True),
                                     MemoryOptions(schedule="serial-naive", ref_model=True),
                                     MemoryOptions(ref_model=True, lora=LoRAConfig(rank=4, train_vision=True)),
                                     MemoryOptions(schedule="serial-prefix", recompute_old_logprobs=True,
                                                   updates_per_batch=2, lora=LoRAConfig(rank=4, dropout=0.1))])
def test_naive_holds_everything_at_once(dp, tp, engine_tp, options):
    layout = ParallelLayout(dp_shard=dp, tp=tp, engine_tp=engine_tp, nodes=1, gpus_per_node=dp * tp)
    plan = plan_memory(small_args(), layout, BATCH, options)
    ran = [p for p in PHASES if plan.rollplex.phases[p]]
    assert plan.naive.peak >= plan.rollplex.peak
    everything = sum(max(plan.rollplex.phases[p].get(c, 0) for p in PHASES) for c in TENSOR_CLASSES)
    assert all(plan.naive.total(p) == everything for p in ran)
    # lifetimes: the KV pool in every phase (one pool per run, at one address for the decode graphs), no
    # activations or prompt state in rollout, only weights, optimizer state and the pool in the optimizer step
    assert all(plan.rollplex.phases[p]["kv_pool"] == plan.sizes.kv_pool for p in ran)
    assert all(plan.rollplex.phases[p]["state_pool"] == 0 for p in ran)  # no recurrent layers
    assert plan.rollplex.phases["rollout"].keys().isdisjoint({"activations", "prompt_kv", "prefix_graph"})
    assert plan.rollplex.phases["optimizer"].keys() <= {"params_sharded", "params_frozen", "engine_adapters", "grads",
                                                        "optimizer_state", "ref_params", "kv_pool", "state_pool"}
    # the prompt work's phase: none without shared prompts
    assert ("prefix" in ran) == (options.schedule != "serial-naive")


def test_optimizer_offload_lowers_every_phase_but_the_step():
    args, layout = small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    kept, offloaded = (plan_memory(args, layout, BATCH, MemoryOptions(offload_optimizer=off)).rollplex
                       for off in (False, True))
    moments = kept.phases["optimizer"]["optimizer_state"]
    assert moments > 0
    for phase in ("rollout", "prefix", "train"):
        assert offloaded.total(phase) == kept.total(phase) - moments
    assert offloaded.total("optimizer") == kept.total("optimizer")


def test_layout_must_cover_the_gpus():
    with pytest.raises(ValueError, match="must equal"):
        ParallelLayout(dp_shard=2, tp=2, nodes=1, gpus_per_node=8)
    with pytest.raises(ValueError, match="engine_tp"):
        ParallelLayout(dp_shard=3, gpus_per_node=3, engine_tp=2)


# ----------------------------------------------------------------------------- sizes


def test_micro_batch_holds_the_most_response_tokens_its_budget_allows():
    """The actor counts a unit's prompt with its responses, so the most responses a
    budget of 8192 holds over 2076-token prompts is two groups' worth less their
    prompts (responses that end early pack two groups), not one group's 8 x 256."""
    batch = BatchShape(prompts=16, n=8, prompt_tokens=28, response_tokens=256, vision_tokens=2048)
    args = PRESETS["qwen2.5-vl-3b"]
    kept = micro_batch(args, batch, 8192, groups=16, share_prefix=True, kept=True)
    assert (kept.tokens, kept.responses, kept.prompts) == (8192 - 2 * 2076, 8192 - 2 * 2076, 0)
    full = micro_batch(args, batch, 8192, groups=16, share_prefix=True, kept=False)
    assert (full.tokens, full.responses, full.prompts, full.patches) == (8192, 4040, 2, 2 * 2048 * 4)
    per_sample = micro_batch(args, batch, 8192, groups=16, share_prefix=False, kept=False)
    assert (per_sample.responses, per_sample.prompts) == (3 * 256, 3)  # three 2332-token sequences


LAYOUT_7B = ParallelLayout(dp_shard=8, gpus_per_node=8)
BATCH_7B = BatchShape(prompts=64, n=8, prompt_tokens=256, response_tokens=1024, vision_tokens=2048)


def test_the_plan_sizes_what_the_run_leaves_to_it():
    """A device with room for everything: the pool is the batch's need and the prompt
    work all fits. A smaller one: the pool still fits, the micro-batch shrinks and
    the prefix budget defers the actor's graph; every phase stays within the usable
    memory."""
    roomy, small = (plan_memory(PRESETS["qwen2.5-vl-7b"], LAYOUT_7B, BATCH_7B, MemoryOptions(
        ref_model=True, activation_checkpointing=True, device_memory=device)) for device in (140 * GiB, 60 * GiB))
    for plan, device in ((roomy, 140 * GiB), (small, 60 * GiB)):
        assert plan.sizes.usable == int(device * (1 - UNCOUNTED_FRACTION))
        assert plan.rollplex.peak <= plan.sizes.usable
        assert plan.rollplex.phases["train"]["kv_pool"] == plan.sizes.kv_pool  # the batch's need, at most
    assert all(roomy.admitted) and not all(small.admitted)
    assert small.sizes.micro_batch_tokens < roomy.sizes.micro_batch_tokens
    assert small.sizes.micro_batch_tokens >= BATCH_7B.longest_sequence


def test_the_prefix_budget_is_what_both_the_decode_window_and_the_update_hold():
    for schedule in ("overlap", "serial-prefix"):
        sizes = plan_memory(PRESETS["qwen2.5-vl-7b"], LAYOUT_7B, BATCH_7B, MemoryOptions(
            schedule=schedule, activation_checkpointing=True, device_memory=60 * GiB)).sizes
        assert sizes.prefix_budget_for(GiB) == min(sizes.prefix_room - GiB, sizes.train_room) > 0
    explicit = plan_memory(PRESETS["qwen2.5-vl-7b"], LAYOUT_7B, BATCH_7B, MemoryOptions(
        activation_checkpointing=True, prefix_budget=3e9)).sizes
    assert explicit.prefix_budget_for(GiB) == 3_000_000_000


def test_shapes_that_cannot_fit_raise_naming_the_bytes_and_the_settings():
    args, layout = PRESETS["qwen2.5-vl-7b"], ParallelLayout()
    batch = BatchShape(prompts=8, n=8, prompt_tokens=256, response_tokens=1024, vision_tokens=2048)
    with pytest.raises(MemoryPlanError, match=r"the KV pool for one prompt's 8 samples needs .* GiB.*optimizer_state"
                                              r".*To fit: lower rollout.n .*parallel.offload_optimizer"):
        plan_memory(args, layout, batch, MemoryOptions(device_memory=80 * GiB))
    with pytest.raises(MemoryPlanError, match=r"training one sequence \(3328 tokens\) needs .*activation_check"):
        plan_memory(args, layout, batch, MemoryOptions(device_memory=80 * GiB, offload_optimizer=True))
    with pytest.raises(MemoryPlanError, match="max_tokens_per_micro_batch 2048 is smaller than the longest sequence"):
        plan_memory(args, ParallelLayout(dp_shard=8, gpus_per_node=8), batch, MemoryOptions(micro_batch_tokens=2048))


def test_sizes_set_by_the_run_are_kept_and_a_warning_says_when_they_do_not_fit():
    args, layout = small_args(), ParallelLayout()
    plan = plan_memory(args, layout, BATCH, MemoryOptions(kv_pool=2e6, micro_batch_tokens=300, prefix_budget=1e5))
    assert (plan.sizes.kv_pool, plan.sizes.micro_batch_tokens, plan.prefix_budget) == (2_000_000, 300, 100_000)
    with pytest.warns(UserWarning, match="phase train needs .* over the .* usable: the sizes set in the config"):
        plan_memory(PRESETS["qwen2.5-vl-7b"], LAYOUT_7B, BATCH_7B, MemoryOptions(activation_checkpointing=True,
                                                                                 micro_batch_tokens=200_000))


# ----------------------------------------------------------------------------- multi-turn


def config_plan(config: dict) -> MemoryPlan:
    """A run's plan from its config, as rollplex.rl.setup.plan_run_memory builds it, for Qwen2.5-VL-7B on 8 GPUs
    of 80 GiB and prompts of 256 text and 1024 vision tokens."""
    cfg = config_from_dict(config)
    options = MemoryOptions.from_config(cfg, build_schedule(cfg).memory_layout, torch.bfloat16, 80 * GiB, "torch")
    batch = BatchShape(cfg.data.batch_size, cfg.rollout.n, 256, cfg.rollout.max_tokens, 1024)
    return plan_memory(PRESETS["qwen2.5-vl-7b"], LAYOUT_7B, batch, options)


# Each run's sizes (KV pool bytes, micro-batch tokens, prefix budget bytes) and phases' totals, as planned before
# multi-turn runs were counted (commit b73b67d).
SINGLE_TURN_PLANS = [
    ({}, (24428544000, 3328, 578557952),
     dict(rollout=55644748288, prefix=53568567808, logprobs=0, train=76730853376, optimizer=41012877312)),
    ({"algorithm": {"kl_coef": 0.001}, "parallel": {"activation_checkpointing": True}},
     (24428544000, 48576, 4200070400),
     dict(rollout=57717789952, prefix=63271631616, logprobs=52362781440, train=74577490688, optimizer=43085918976)),
]


@pytest.mark.parametrize("config,sizes,totals", SINGLE_TURN_PLANS)
def test_a_single_turn_run_plans_as_before(config, sizes, totals):
    plan = config_plan(config)
    assert not plan.options.multi_turn
    assert (plan.sizes.kv_pool, plan.sizes.micro_batch_tokens, plan.prefix_budget) == sizes
    assert {phase: plan.rollplex.total(phase) for phase in PHASES} == totals


def test_a_multi_turn_config_plans_multi_turn():
    """A task with tools of its own makes the run multi-turn (Config.multi_turn), and its plan: the tower over
    the observations in every pass leaves the update a smaller micro-batch."""
    checkpointing = {"parallel": {"activation_checkpointing": True}}
    multi = config_plan({"data": {"task": "look"}, **checkpointing})
    assert multi.options.multi_turn
    assert multi.sizes.micro_batch_tokens < config_plan(checkpointing).sizes.micro_batch_tokens


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_a_multi_turn_plan_counts_observation_images_in_its_passes(freeze_vision):
    """At the same sizes, a multi-turn plan counts, per response token of a micro-batch, one observation's
    merged vision token: spatial_merge_size**2 patches through the vision tower. Its update keeps the tower's
    saved tensors over them (none when the tower is frozen); its logprob passes (suffix passes over kept prompts)
    then peak in the tower's forward over them. Its rollout keeps each sample's observation features, at most a
    full response's, and its engine prefills up to a step's token budget of observations. The prompt work and
    the optimizer step are unchanged."""
    args = small_args()
    single = MemoryOptions(ref_model=True, recompute_old_logprobs=True, schedule="serial-prefix",
                           freeze_vision=freeze_vision, kv_pool=2e6, micro_batch_tokens=300, prefix_budget=1e7)
    plans = [plan_memory(args, ParallelLayout(), BATCH, options)
             for options in (single, dataclasses.replace(single, multi_turn=True))]
    single_phases, multi_phases = (plan.rollplex.phases for plan in plans)
    assert all(plans[0].admitted) and plans[1].admitted == plans[0].admitted
    for phase in ("prefix", "optimizer"):
        assert multi_phases[phase] == single_phases[phase]

    mb = micro_batch(args, BATCH, 300, groups=BATCH.prompts, share_prefix=True, kept=True)
    observed = micro_batch(args, BATCH, 300, groups=BATCH.prompts, share_prefix=True, kept=True,
                           observation_vision=True)
    assert mb.patches == 0 and observed.patches == mb.responses * 4  # a 2 x 2 merge, no prompt in the pass
    assert dataclasses.replace(observed, patches=0) == mb
    tower_saved = 0 if freeze_vision else observed.patches * vision_patch_bytes(args, 2, checkpointing=False)
    assert multi_phases["train"]["activations"] - single_phases["train"]["activations"] == tower_saved
    assert single_phases["logprobs"]["activations"] < multi_phases["logprobs"]["activations"] == \
        observed.patches * _vision_forward_bytes(args, 2) + observed.tokens * HID * 2

    rollout = {c: multi_phases["rollout"][c] - single_phases["rollout"][c] for c in single_phases["rollout"]}
    assert rollout.pop("vision_embeds") == BATCH.prompts * BATCH.n * BATCH.response_tokens * HID * 2
    assert rollout.pop("workspace") > 0
    assert set(rollout.values()) == {0}


def test_cli_multi_turn(capsys):
    """--multi-turn says so, and what it counts; at the same micro-batch its update holds more."""
    run = ["--model", "qwen2.5-vl-7b", "--gpus-per-node", "8", "--activation-checkpointing", "--ref-model",
           "--schedule", "serial-prefix", "--micro-batch-tokens", "40000"]
    peaks = []
    for flag in ("--no-multi-turn", "--multi-turn"):
        memory_plan.main([*run, flag])
        out = capsys.readouterr().out
        peaks.append(float(out.split("peak per GPU, rollplex:")[1].split()[0]))
        assert ("multi-turn: the response tokens above hold the observations" in out) == (flag == "--multi-turn")
    assert peaks[1] > peaks[0]


# ----------------------------------------------------------------------------- the first H200 run


def h200_plan(schedule: str, config: dict):
    """The plan of configs/bench_h200_video.yaml as the first H200 run ran it: Qwen2.5-VL-3B's shapes with 12
    decoder layers, 16 prompts of 28 text + 2048 video tokens, 8 x 256-token responses, on 140.4 GiB."""
    cfg = config_from_dict(config)
    text = dataclasses.replace(PRESETS["qwen2.5-vl-3b"].text, num_hidden_layers=cfg.model.tiny.num_layers)
    args = dataclasses.replace(PRESETS["qwen2.5-vl-3b"], text=text)
    batch = BatchShape(cfg.data.batch_size, cfg.rollout.n, 28, cfg.rollout.max_tokens, 2048)
    options = MemoryOptions.from_config(cfg, build_schedule(cfg).memory_layout, torch.bfloat16, 143_771 * 2**20,
                                        "torch")
    # That run's logprob head computed each micro-batch's logits at once (chunked since, rollplex.train.logprob_head).
    options = dataclasses.replace(options, logits_chunk_tokens=2**31)
    return plan_memory(args, ParallelLayout(), batch, options)


@pytest.mark.parametrize("schedule", ["serial-prefix", "overlap", "serial-naive"])
def test_the_plan_predicts_the_first_h200_runs_peaks(schedule):
    """Each phase's largest measured peak over the run's steps (perf/max_memory_allocated_gb), within 10%.
    Not serial-naive's update: that run's actor counted a unit's prompt once, not once per sample, when prompts
    are not shared, so its micro-batches held 2-3x their 8192-token budget (fixed since: `_Unit.tokens`).
    That run freed its KV pool after rollout (it has been held all run since, for the decode graphs): the
    phases after rollout are compared without it."""
    run = json.loads(H200_REPORT.read_text())["schedules"][schedule]
    steps = [run["warmup"], *run["steps"]]
    plan = h200_plan(schedule, run["config"])
    planned = loop_phase_bytes(plan)
    if schedule == "serial-naive":
        del planned["update_actor"]
    for phase in planned:
        if phase != "gen":
            planned[phase] -= plan.sizes.kv_pool
    for phase, bytes_ in planned.items():
        measured = max(s[f"perf/max_memory_allocated_gb/{phase}"] for s in steps) * GiB
        assert abs(bytes_ / measured - 1) <= 0.1, (phase, bytes_ / GiB, measured / GiB)


# ----------------------------------------------------------------------------- the tool


def test_cli_preset(capsys):
    memory_plan.main(["--model", "qwen2.5-vl-3b", "--gpus-per-node", "4", "--tp", "2", "--prompts", "8",
                      "--ref-model", "--activation-checkpointing", "--offload-optimizer"])
    out = capsys.readouterr().out
    for phase in PHASES:
        assert f"phase {phase}" in out
    assert "peak per GPU, naive" in out and "peak per GPU, rollplex" in out
    assert "trainer dp_shard 2 x tp 2; engine tp 2" in out
    assert "sizes within 72.0 GiB (80.0 GiB less 10% uncounted): KV pool" in out


def test_cli_qwen3_vl_sizes(capsys):
    """Qwen3-VL's named sizes plan like Qwen2.5-VL's."""
    memory_plan.main(["--model", "qwen3-vl-8b", "--gpus-per-node", "8", "--prompts", "64", "--vision-tokens", "2048",
                      "--ref-model", "--activation-checkpointing"])
    out = capsys.readouterr().out
    assert "model qwen3-vl-8b: 8.77B parameters" in out and "36 layers, hidden 4096, 8 kv heads x 128" in out
    assert "peak per GPU, rollplex" in out


H200 = ["--gpus-per-node", "8", "--device-memory-gib", "140.4"]  # one node of 8 H200s
BATCH_H200 = BatchShape(prompts=64, n=8, prompt_tokens=256, response_tokens=1024, vision_tokens=1024)  # the tool's


H200_LAYOUTS = [ParallelLayout(dp_shard=8, gpus_per_node=8, ep=ep) for ep in (1, 8)]
H200_OPTIONS = [MemoryOptions(ref_model=True, activation_checkpointing=True, device_memory=int(140.4 * GiB),
                              **extra) for extra in (
    dict(), dict(schedule="serial-prefix", routing_replay="rollout"),
    dict(schedule="serial-prefix", routing_replay="old", recompute_old_logprobs=True, updates_per_batch=2),
    dict(offload_optimizer=True, max_num_seqs=64, schedule="serial-naive", routing_replay="rollout"))]


@pytest.mark.parametrize("name", ["qwen3-vl-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("layout", H200_LAYOUTS)
@pytest.mark.parametrize("options", H200_OPTIONS)
def test_moe_presets_plan_within_an_h200(name, layout, options):
    """Every size the plan decides for the MoE presets on 8 H200s leaves each phase within the usable memory
    (no warning): the prefix budget leaves room for what admitting prompt work gathers besides its state (the
    reference's root unit and layer, a slice's layer), which an MoE layer makes large."""
    if name == "qwen3.5-35b-a3b":  # its 256 rows of recurrent state do not fit beside its weights on one H200
        options = dataclasses.replace(options, offload_optimizer=True, max_num_seqs=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_memory(PRESETS[name], layout, BATCH_H200, options)
    assert plan.rollplex.peak <= plan.sizes.usable


def test_cli_moe_sizes_on_one_node_of_h200s(capsys):
    """The MoE presets that roll out on one H200 (the engine holds every expert whole at tp 1) print their
    plan, with expert parallelism and routing replay; the larger ones say why they cannot."""
    memory_plan.main(["--model", "qwen3.5-35b-a3b", *H200, "--max-num-seqs", "64", "--offload-optimizer",
                      "--activation-checkpointing", "--ref-model", "--ep", "8", "--schedule", "serial-prefix",
                      "--routing-replay", "rollout"])
    out = capsys.readouterr().out
    assert "experts: 40 MoE layers of 256 experts of width 512, 8 per token, a shared expert of 512" in out
    assert "ep 8 (32 experts a rank, FSDP-sharded over 1 rank)" in out and "routing replay rollout" in out
    experts = expert_counts(PRESETS["qwen3.5-35b-a3b"]).total
    assert f"  engine_experts        {2 * experts / GiB:9.2f}" in out and "  routes " in out
    assert "peak per GPU, rollplex" in out and "(fits in 126.4 GiB usable)" in out
    memory_plan.main(["--model", "qwen3-vl-30b-a3b", *H200, "--activation-checkpointing", "--ref-model"])
    out = capsys.readouterr().out
    assert "experts: 48 MoE layers of 128 experts of width 768, 8 per token: 28.99B" in out
    assert "(fits in 126.4 GiB usable)" in out
    for model in ("qwen3.5-122b-a10b", "qwen3-vl-235b-a22b"):
        with pytest.raises(SystemExit, match=r"the rollout holds every weight whole on each GPU \(engine tp 1\).*"
                                             r"cannot roll out on one GPU of 140.4 GiB"):
            memory_plan.main(["--model", model, *H200, "--offload-optimizer", "--max-num-seqs", "16"])


def test_cli_qwen3_5_sizes(capsys):
    """Qwen3.5-9B's plan: 24 DeltaNet layers of state per decode row (49.1 MiB a sequence), 129 rows; 27B's."""
    memory_plan.main(["--model", "qwen3.5-9b", "--gpus-per-node", "8", "--prompts", "64", "--max-num-seqs", "128",
                      "--ref-model", "--activation-checkpointing"])
    out = capsys.readouterr().out
    assert "32 layers (8 with K/V, 24 Gated DeltaNet: 49.1 MiB of recurrent state per sequence" in out
    state_pool = 129 * qwen3_5.FAMILY.recurrent_state_bytes(PRESETS["qwen3.5-9b"], 1)
    assert f"  state_pool            {state_pool / GiB:9.2f}  {state_pool / GiB:12.2f}" in out
    assert "recurrent layers (Gated DeltaNet)" in out and "(fits in 72.0 GiB usable)" in out
    # 27B at engine tp 1: 256 rows of 146.8 MiB do not fit beside its weights on 80 GiB; 64 rows on 141 GiB do.
    with pytest.raises(SystemExit, match=r"state_pool 36.85 GiB.*To fit: lower rollout.max_num_seqs"):
        memory_plan.main(["--model", "qwen3.5-27b", "--gpus-per-node", "8", "--prompts", "64"])
    memory_plan.main(["--model", "qwen3.5-27b", "--gpus-per-node", "8", "--prompts", "64", "--max-num-seqs", "64",
                      "--ref-model", "--activation-checkpointing", "--offload-optimizer", "--device-memory-gib", "141"])
    assert "64 layers (16 with K/V, 48 Gated DeltaNet: 146.8 MiB" in capsys.readouterr().out


def test_cli_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(small_args())))
    memory_plan.main(["--model", str(tmp_path / "config.json"), "--gpus-per-node", "2", "--kv-pool", str(GiB),
                      "--schedule", "serial-prefix", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "KV pool 1.00 GiB" in out and "schedule serial-prefix" in out


def test_cli_says_what_does_not_fit():
    """Weights the engine cannot hold on one GPU are named first (no batch makes room for them); then what
    leaves no room for one prompt's KV pool."""
    with pytest.raises(SystemExit, match=r"error: the rollout holds every weight whole on each GPU \(engine tp 1\): "
                                         r"136.74 GiB, more than the 72.00 GiB usable.*To fit: split the engine"):
        memory_plan.main(["--model", "qwen2.5-vl-72b", "--gpus-per-node", "1", "--prompts", "8"])
    with pytest.raises(SystemExit, match="error: the KV pool for one prompt's 8 samples needs"):
        memory_plan.main(["--model", "qwen2.5-vl-32b", "--gpus-per-node", "1", "--prompts", "8"])


def test_cli_lora_against_full_fine_tuning(capsys):
    """The issue's case: 7B on one 80 GiB GPU. Full fine-tuning's update does not fit; LoRA's does, and
    the tool says by how much, at the same sizes."""
    memory_plan.main(["--model", "qwen2.5-vl-7b", "--gpus-per-node", "1", "--prompts", "8", "--lora-rank", "16",
                      "--activation-checkpointing"])
    out = capsys.readouterr().out
    assert "lora: rank 16 on 196 linears (all-linear, excluding '.*visual.*'): 40.37M adapter parameters" in out
    assert "params_frozen" in out and "peak per GPU, rollplex" in out
    assert "full fine-tuning:" in out and "does NOT fit in 72.0 GiB usable" in out
    assert "weights and optimizer state 123.56 GiB (params_sharded 30.89, grads 30.89, optimizer_state 61.78)" in out
    assert "saved: 107.44 GiB of weights and optimizer state" in out  # 14 bytes per base weight, less 18 per adapter
    with pytest.raises(SystemExit, match="select no Linear layer"):
        memory_plan.main(["--model", "qwen2.5-vl-3b", "--lora-rank", "8", "--lora-target", "no_such_layer"])


def test_cli_published(capsys):
    memory_plan.main(["--published"])
    out = capsys.readouterr().out
    assert "qwen2.5-vl-32b" in out and "4 node(s) x 8 GPUs" in out and "~165 GiB" in out
