"""The memory plan's exact figures equal hand-computed sizes, and its schedules keep
their invariants: naive (nothing freed) never below Rollplex, offload lowers rollout."""

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from rollplex.models.loader import hf_config_from_args
from rollplex.models.qwen2_5_vl import ModelArgs, Qwen2_5_VL, TextArgs, VisionArgs
from rollplex.rl.memory import (GiB, PHASES, PRESETS, TENSOR_CLASSES, BatchShape, MemoryOptions, ParallelLayout,
                                count_params, kv_bytes_per_token, plan_memory, prefix_state_bytes)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import memory_plan  # noqa: E402

V_HID, V_INTER, V_DEPTH = 32, 48, 3
HID, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 96, 2, 4, 2, 16, 100
BATCH = BatchShape(prompts=6, n=4, prompt_tokens=20, response_tokens=30, vision_tokens=16)
TP_SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # apply_tp's layer plan


def small_args(tie: bool = False) -> ModelArgs:
    return ModelArgs(
        vision=VisionArgs(depth=V_DEPTH, hidden_size=V_HID, intermediate_size=V_INTER, num_heads=2,
                          out_hidden_size=HID, fullatt_block_indexes=[1]),
        text=TextArgs(vocab_size=VOCAB, hidden_size=HID, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, mrope_section=[2, 3, 3]),
        tie_word_embeddings=tie)


@functools.cache
def model_counts(tie: bool = False) -> tuple[int, int, int]:
    """(total, split by tp, vision) parameters of the built model."""
    params = dict(Qwen2_5_VL(small_args(tie)).named_parameters())
    split = sum(p.numel() for name, p in params.items() if name.startswith("language_model.layers.") and
                name.split(".")[-2] in TP_SPLIT)
    if not tie:
        split += params["language_model.embed_tokens.weight"].numel() + params["lm_head.weight"].numel()
    vision = sum(p.numel() for name, p in params.items() if name.startswith("visual."))
    return sum(p.numel() for p in params.values()), split, vision


@pytest.mark.parametrize("tie", [False, True])
def test_param_counts(tie):
    counts = count_params(small_args(tie))
    assert (counts.total, counts.tp_split, counts.vision) == model_counts(tie)


@pytest.mark.parametrize("name,total", [("qwen2.5-vl-3b", 3_754_622_976), ("qwen2.5-vl-7b", 8_292_166_656),
                                        ("qwen2.5-vl-32b", 33_452_718_336)])
def test_presets_match_the_hub_parameter_counts(name, total):
    assert count_params(PRESETS[name]).total == total


LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 2), (2, 2, 2), (2, 2, 1), (4, 1, 2), (1, 2, 1)]


@pytest.mark.parametrize("dp,tp,engine_tp", LAYOUTS)
def test_exact_sizes(dp, tp, engine_tp):
    args = small_args()
    total, split, _ = model_counts()
    layout = ParallelLayout(dp_shard=dp, tp=tp, engine_tp=engine_tp, nodes=1, gpus_per_node=dp * tp)
    plan = plan_memory(args, layout, BATCH, MemoryOptions(ref_model=True))
    shard = math.ceil((split // tp + total - split) / dp)
    kv_token = 2 * LAYERS * (KV_HEADS // engine_tp) * HEAD_DIM * 2
    prompt_len = BATCH.prompt_tokens + BATCH.vision_tokens
    prompts_per_engine = math.ceil(BATCH.prompts / (dp * tp // engine_tp))
    prompts_per_rank = math.ceil(BATCH.prompts / dp)
    expected = {
        "params_sharded": 4 * shard,
        "optimizer_state": 2 * 4 * shard,
        "ref_params": 2 * shard,
        "params_unsharded_bf16": 2 * (split // engine_tp + total - split),
        "kv_pool": prompts_per_engine * (prompt_len + BATCH.n * BATCH.response_tokens) * kv_token,
        "vision_embeds": prompts_per_rank * BATCH.vision_tokens * HID * 2,
    }
    rollout = plan.rollplex.phases["rollout"]
    assert {k: rollout[k] for k in expected} == expected
    train = plan.rollplex.phases["train"]
    assert train["grads"] == 4 * shard
    assert train["params_unsharded_bf16"] == 2 * (split // tp + total - split)
    # actor and ref prompt KV, once per prompt (not per sample), at the trainer's tp
    assert train["prompt_kv"] == prompts_per_rank * 2 * prompt_len * (2 * LAYERS * (KV_HEADS // tp) * HEAD_DIM * 2)
    assert kv_bytes_per_token(args, torch.bfloat16, engine_tp) == kv_token


def test_frozen_vision_has_no_gradients_or_moments():
    args, layout = small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    total, _, vision = model_counts()
    plan = plan_memory(args, layout, BATCH, MemoryOptions(freeze_vision=True))
    assert plan.rollplex.phases["optimizer"]["grads"] == 4 * math.ceil((total - vision) / 2)
    assert plan.rollplex.phases["optimizer"]["optimizer_state"] == 8 * math.ceil((total - vision) / 2)
    assert plan.rollplex.phases["rollout"]["params_sharded"] == 4 * math.ceil(total / 2)


def test_prefix_state_bytes():
    args = small_args()
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    assert prefix_state_bytes(args, 20, 16, {"actor"}) == 36 * per_token
    assert prefix_state_bytes(args, 20, 16, ["ref", "actor", "old"], tp=2) == 3 * 36 * per_token // 2
    assert prefix_state_bytes(args, 20, 0, {"ref"}, dtype=torch.float32) == 20 * 2 * per_token
    with pytest.raises(ValueError, match="unknown prefix kinds"):
        prefix_state_bytes(args, 20, 16, {"critic"})
    with pytest.raises(ValueError, match="does not divide"):
        kv_bytes_per_token(args, tp=4)


@pytest.mark.parametrize("dp,tp,engine_tp", LAYOUTS)
@pytest.mark.parametrize("options", [MemoryOptions(), MemoryOptions(ref_model=True, activation_checkpointing=True),
                                     MemoryOptions(offload_optimizer=True, freeze_vision=True, kv_pool=0.01,
                                                   recompute_old_logprobs=True)])
def test_naive_holds_everything_at_once(dp, tp, engine_tp, options):
    layout = ParallelLayout(dp_shard=dp, tp=tp, engine_tp=engine_tp, nodes=1, gpus_per_node=dp * tp)
    plan = plan_memory(small_args(), layout, BATCH, options)
    assert plan.naive.peak >= plan.rollplex.peak
    assert plan.naive.peak >= max(plan.rollplex.total(p) for p in PHASES)
    everything = sum(max(plan.rollplex.phases[p].get(c, 0) for p in PHASES) for c in TENSOR_CLASSES)
    assert all(plan.naive.total(p) == everything for p in PHASES)
    # lifetimes: no KV pool in training, no activations or prefix state in rollout, only weights and
    # optimizer state in the optimizer step
    assert "kv_pool" not in plan.rollplex.phases["train"]
    assert plan.rollplex.phases["rollout"].keys().isdisjoint({"activations", "prompt_kv", "prefix_graph"})
    assert plan.rollplex.phases["optimizer"].keys() <= {"params_sharded", "grads", "optimizer_state", "ref_params"}


def test_optimizer_offload_lowers_rollout():
    args, layout = small_args(), ParallelLayout(dp_shard=2, gpus_per_node=2)
    kept, offloaded = (plan_memory(args, layout, BATCH, MemoryOptions(offload_optimizer=off)).rollplex
                       for off in (False, True))
    moments = kept.phases["optimizer"]["optimizer_state"]
    assert moments > 0
    for phase in ("rollout", "prefix", "train"):
        assert offloaded.total(phase) == kept.total(phase) - moments
    assert offloaded.total("optimizer") == kept.total("optimizer")


def test_prefix_budget_caps_kept_prompts():
    args, layout = small_args(), ParallelLayout()
    full = plan_memory(args, layout, BATCH, MemoryOptions())
    per_prompt = (full.rollplex.phases["prefix"]["prompt_kv"] + full.rollplex.phases["prefix"]["prefix_graph"]) // 6
    capped = plan_memory(args, layout, BATCH, MemoryOptions(prefix_budget=2 * per_prompt + 1))
    assert (full.prefix_prompts, capped.prefix_prompts, capped.prompts_per_rank) == (6, 2, 6)
    assert capped.rollplex.phases["prefix"]["prompt_kv"] == full.rollplex.phases["prefix"]["prompt_kv"] // 3


def test_layout_must_cover_the_gpus():
    with pytest.raises(ValueError, match="must equal"):
        ParallelLayout(dp_shard=2, tp=2, nodes=1, gpus_per_node=8)
    with pytest.raises(ValueError, match="engine_tp"):
        ParallelLayout(dp_shard=3, gpus_per_node=3, engine_tp=2)


def test_cli_preset(capsys):
    memory_plan.main(["--model", "qwen2.5-vl-3b", "--gpus-per-node", "4", "--tp", "2", "--prompts", "8",
                      "--ref-model", "--activation-checkpointing", "--offload-optimizer"])
    out = capsys.readouterr().out
    for phase in PHASES:
        assert f"phase {phase}" in out
    assert "peak per GPU, naive" in out and "peak per GPU, rollplex" in out
    assert "trainer dp_shard 2 x tp 2; engine tp 2" in out


def test_cli_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_args(small_args())))
    memory_plan.main(["--model", str(tmp_path / "config.json"), "--gpus-per-node", "2", "--kv-pool", str(GiB)])
    out = capsys.readouterr().out
    assert "kv_pool                    1.00" in out


def test_cli_published(capsys):
    memory_plan.main(["--published"])
    out = capsys.readouterr().out
    assert "qwen2.5-vl-32b" in out and "4 node(s) x 8 GPUs" in out and "~165 GiB" in out
