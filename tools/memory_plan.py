"""Per-GPU memory by phase (rollout, prefix, logprobs, train, optimizer), naive
colocation against Rollplex, and the sizes the plan decides (KV pool,
micro-batch, prefix budget) where they are not given.

    python tools/memory_plan.py --published          # Qwen2.5-VL-32B, 4 nodes x 8 GPUs, video batch
    python tools/memory_plan.py --model qwen2.5-vl-7b --gpus-per-node 8 --tp 2 --prompts 64 --n 8 \\
        --prompt-tokens 256 --vision-tokens 1024 --response-tokens 1024 --ref-model --activation-checkpointing
    python tools/memory_plan.py --model /path/to/checkpoint/config.json ...
    python tools/memory_plan.py --model qwen2.5-vl-7b --gpus-per-node 1 --prompts 8 --lora-rank 16 \\
        --activation-checkpointing     # LoRA, and its update beside full fine-tuning's at the same sizes
    python tools/memory_plan.py --model qwen3.5-9b --gpus-per-node 8 --prompts 64 --max-num-seqs 128 \\
        --ref-model --activation-checkpointing   # Gated DeltaNet layers: the engine's recurrent-state pool
    python tools/memory_plan.py --model qwen3.5-35b-a3b --gpus-per-node 8 --device-memory-gib 140.4 \\
        --max-num-seqs 64 --offload-optimizer --activation-checkpointing --ref-model --ep 8 \\
        --schedule serial-prefix --routing-replay rollout    # MoE on one node of 8 H200s
    python tools/memory_plan.py --model qwen2.5-vl-7b --schedule serial-prefix --ref-model \\
        --activation-checkpointing --multi-turn   # observations (tool answers, their images) in the responses

Presets: every family's named sizes (their hub config.json values; the list is in
--help), or the config.json of any supported family (or the directory holding
it). The plan comes from
rollplex.rl.memory.plan_memory, as a run's does; the printed notes say which
figures are exact and which are estimates.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from rollplex.config.sections import LoRAConfig  # noqa: E402
from rollplex.models.family import FamilyArgs  # noqa: E402
from rollplex.models.loader import read_model_args  # noqa: E402
from rollplex.models.registry import SIZES_NOT_SUPPORTED, family_of  # noqa: E402
from rollplex.rl.memory import (GiB, PRESETS, SCHEDULES, BatchShape, MemoryOptions, MemoryPlan,  # noqa: E402
                                ParallelLayout, format_lora_saving, format_plan, plan_memory)
from rollplex.rl.memory.inputs import ROUTING_REPLAYS  # noqa: E402

# The published case: Qwen2.5-VL-32B on 4 nodes x 8 GPUs, video RL, reported as ~165 GiB per GPU when
# nothing is freed and under 80 GiB with phase-aware management. Its batch was not published; ours is
# 128 prompts x 8 samples, each prompt a 32-frame 448x448 video (16 temporal patches x 32 x 32 = 16384
# patches -> 4096 merged tokens) plus 256 text tokens, 1024-token responses, with a reference model.
PUBLISHED_NAIVE_GIB, PUBLISHED_PHASE_AWARE_GIB = 165, 80
PUBLISHED_MODEL = "qwen2.5-vl-32b"
PUBLISHED_LAYOUT = ParallelLayout(dp_shard=8, tp=4, engine_tp=4, nodes=4, gpus_per_node=8)
PUBLISHED_BATCH = BatchShape(prompts=128, n=8, prompt_tokens=256, response_tokens=1024, vision_tokens=4096)
PUBLISHED_OPTIONS = MemoryOptions(ref_model=True, activation_checkpointing=True, offload_optimizer=True,
                                  kv_pool=0.4, prefix_budget=16 * GiB, device_memory=80 * GiB)


def load_model_args(model: str) -> FamilyArgs:
    if model in PRESETS:
        return PRESETS[model]
    if model in SIZES_NOT_SUPPORTED:
        raise SystemExit(f"--model {model}: {SIZES_NOT_SUPPORTED[model]}")
    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        return read_model_args(path if path.is_dir() else path.parent)
    raise SystemExit(f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor a config.json or its directory")


def published_comparison(plan: MemoryPlan) -> str:
    o = PUBLISHED_OPTIONS
    return (f"published: ~{PUBLISHED_NAIVE_GIB} GiB per GPU naive, <{PUBLISHED_PHASE_AWARE_GIB} GiB phase-aware; "
            f"this plan: {plan.naive.peak / GiB:.1f} GiB naive, {plan.rollplex.peak / GiB:.1f} GiB Rollplex.\n"
            "Their batch was not published; ours is the batch line above. Our naive is the same tensors as "
            "Rollplex's, never freed, so it is lower than a typical colocated system's: the engine reads the "
            "trainer's gathered weights (an engine with its own copy adds the rollout's params_gathered row again), "
            f"the KV pool is {o.kv_pool:g} x {o.device_memory / GiB:.0f} GiB and the prefix state is capped by the "
            f"same {o.prefix_budget / GiB:.0f} GiB budget. A bigger pool, batch or micro-batch, or no cap on the "
            "prefix state, moves naive toward the published figure; Rollplex's peak is set by the decode window "
            "(KV pool + prefix state) and the train phase (prefix state + activations), each under 80 GiB here.")


def full_fine_tuning(args: FamilyArgs, layout: ParallelLayout, batch: BatchShape, options: MemoryOptions,
                     lora_plan: MemoryPlan) -> MemoryPlan:
    """The same run without adapters, at the LoRA plan's sizes (KV pool, micro-batch, prefix
    budget), so that the two differ by what LoRA changes alone. It may not fit: that is the
    comparison's point, so the plan's warning is not repeated."""
    sized = replace(options, lora=LoRAConfig(), kv_pool=float(lora_plan.sizes.kv_pool),
                    micro_batch_tokens=lora_plan.sizes.micro_batch_tokens, prefix_budget=float(lora_plan.prefix_budget))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return plan_memory(args, layout, batch, sized)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--published", action="store_true",
                   help="print the published Qwen2.5-VL-32B / 32-GPU case (other flags are ignored)")
    p.add_argument("--model", default="qwen2.5-vl-7b",
                   help=f"preset name ({', '.join(PRESETS)}; not supported yet: {', '.join(SIZES_NOT_SUPPORTED)}), "
                        "or a config.json or its directory")
    g = p.add_argument_group("layout")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--tp", type=int, default=1, help="trainer tensor parallel size")
    g.add_argument("--dp-shard", type=int, default=None, help="trainer FSDP size (default: GPUs / tp)")
    g.add_argument("--engine-tp", type=int, default=None, help="engine tensor parallel size (default: --tp)")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallel size (parallel.ep, MoE models at tp 1): each group of ep dp ranks splits "
                        "every MoE layer's experts")
    g = p.add_argument_group("batch")
    g.add_argument("--prompts", type=int, default=64, help="prompts per step, over all GPUs")
    g.add_argument("--n", type=int, default=8, help="samples per prompt")
    g.add_argument("--prompt-tokens", type=int, default=256, help="text tokens per prompt (besides vision tokens)")
    g.add_argument("--vision-tokens", type=int, default=1024, help="merged vision tokens per prompt")
    g.add_argument("--response-tokens", type=int, default=1024, help="tokens per response, at full length")
    g = p.add_argument_group("options")
    g.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--freeze-vision", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--offload-optimizer", action=argparse.BooleanOptionalAction, default=False,
                   help="AdamW moments on the host outside the optimizer step")
    g.add_argument("--ref-model", action=argparse.BooleanOptionalAction, default=False,
                   help="a reference model (kl_coef > 0)")
    g.add_argument("--ref-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--recompute-old-logprobs", action=argparse.BooleanOptionalAction, default=False)
    g.add_argument("--schedule", choices=SCHEDULES, default="overlap")
    g.add_argument("--updates-per-batch", type=int, default=1, help="optimizer steps per batch")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the model's compute dtype")
    g.add_argument("--attention", choices=["torch", "flash"], default="torch",
                   help="training attention kernels (flash: flash-attn, and fla's for Gated DeltaNet layers)")
    g.add_argument("--max-num-seqs", type=int, default=MemoryOptions.max_num_seqs,
                   help="the engine's decode batch (rollout.max_num_seqs): its recurrent-state pool has a row each")
    g.add_argument("--routing-replay", choices=ROUTING_REPLAYS, default="none",
                   help="MoE models: algorithm.routing_replay (rollout: the engine logs every token's experts, the "
                        "samples carry them to the update; old: the old-logprob pass records them)")
    g.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=False,
                   help="multi-turn rollouts (rollout.tools, rollout.environment): observations in the responses, "
                        "their images through the vision tower in every pass over responses (at most every "
                        "response token, within --response-tokens)")
    g = p.add_argument_group("LoRA (the lora config section; rank 0: full fine-tuning)")
    default = LoRAConfig()
    g.add_argument("--lora-rank", type=int, default=default.rank, help="adapter rank r")
    g.add_argument("--lora-target", nargs="+", default=default.target_modules,
                   help="layers that get adapters, by name (all-linear: every Linear but the LM head)")
    g.add_argument("--lora-exclude", default=default.exclude_modules,
                   help="regular expression of layer names that get none")
    g.add_argument("--lora-dropout", type=float, default=default.dropout,
                   help="dropout on the adapters' input (> 0 keeps a dropped copy of it for backward)")
    g.add_argument("--lora-train-vision", action=argparse.BooleanOptionalAction, default=default.train_vision,
                   help="train the vision tower in full beside the adapters")
    g = p.add_argument_group("sizes (default: the plan decides them within --device-memory-gib)")
    g.add_argument("--micro-batch-tokens", type=int, default=None, help="trainer token budget per micro-batch")
    g.add_argument("--kv-pool", type=float, default=None, help="KV pool capacity: <= 1 a fraction of the device, "
                   "else bytes")
    g.add_argument("--prefix-budget", type=float, default=None,
                   help="prompt K/V + prefix graph kept per GPU: <= 1 a fraction of the device, else bytes")
    g.add_argument("--device-memory-gib", type=float, default=80, help="memory per GPU")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.published:
        plan = plan_memory(PRESETS[PUBLISHED_MODEL], PUBLISHED_LAYOUT, PUBLISHED_BATCH, PUBLISHED_OPTIONS,
                           model_name=PUBLISHED_MODEL)
        print(format_plan(plan))
        print()
        print(published_comparison(plan))
        return
    world = a.nodes * a.gpus_per_node
    try:
        layout = ParallelLayout(dp_shard=a.dp_shard or world // a.tp, tp=a.tp, engine_tp=a.engine_tp or a.tp,
                                nodes=a.nodes, gpus_per_node=a.gpus_per_node, ep=a.ep)
        batch = BatchShape(prompts=a.prompts, n=a.n, prompt_tokens=a.prompt_tokens,
                           response_tokens=a.response_tokens, vision_tokens=a.vision_tokens)
        lora = LoRAConfig(rank=a.lora_rank, target_modules=a.lora_target, exclude_modules=a.lora_exclude,
                          dropout=a.lora_dropout, train_vision=a.lora_train_vision)
        options = MemoryOptions(param_dtype=getattr(torch, a.dtype), ref_model=a.ref_model,
                                ref_dtype=getattr(torch, a.ref_dtype), recompute_old_logprobs=a.recompute_old_logprobs,
                                offload_optimizer=a.offload_optimizer,
                                activation_checkpointing=a.activation_checkpointing, freeze_vision=a.freeze_vision,
                                lora=lora, schedule=a.schedule, updates_per_batch=a.updates_per_batch, attention=a.attention,
                                max_num_seqs=a.max_num_seqs, micro_batch_tokens=a.micro_batch_tokens,
                                kv_pool=a.kv_pool, prefix_budget=a.prefix_budget,
                                device_memory=int(a.device_memory_gib * GiB), routing_replay=a.routing_replay,
                                multi_turn=a.multi_turn)
        args = load_model_args(a.model)
        for tp in {layout.tp, layout.engine_tp}:  # a split the family cannot make would fail the run at its start
            family_of(args).check_tp(args, tp)
        plan = plan_memory(args, layout, batch, options, model_name=a.model)
        full = full_fine_tuning(args, layout, batch, options, plan) if lora.rank > 0 else None
    except ValueError as e:  # MemoryPlanError and ConfigError too: the shapes cannot fit, a setting is out of range
        raise SystemExit(f"error: {e}") from e
    print(format_plan(plan))
    if full is not None:
        print()
        print(format_lora_saving(plan, full))

if __name__ == "__main__":
    main()
