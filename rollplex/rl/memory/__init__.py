"""Memory plan: per-GPU bytes of every large tensor class, phase by phase, and
the sizes it decides.

Every large tensor has a lifetime, from its first use to its last (see
shared/DESIGN.md, "Memory by phase"). A colocated system that frees nothing
holds the rollout's state (KV pool, the engine's gathered weights) and the
trainer's (master weights, gradients, AdamW moments) at once, so its peak is
their sum. Rollplex holds each class only within its lifetime, so each phase
pays only for what it uses. This package computes both, for a model shape, a
parallel layout and a batch:
    inputs     the parallel layout, the batch and the options (the model shapes of
               the published sizes, PRESETS, are every family's, rollplex.models.registry)
    estimates  one estimator per tensor class, used by the plan and by the run
               itself (the prompt-work scheduler admits prompt work by them)
    plan       each phase's bytes, the sizes the plan decides, the loop's phases
    report     the plan as text
    measure    what the tensors hold on CPU: live bytes, each phase's peak
"""

from rollplex.rl.memory.estimates import (LoRACounts, admitted, count_lora, count_params, kv_bytes_per_token,
                                          micro_batch, kept_prompt_state)
from rollplex.models.registry import PRESETS
from rollplex.rl.memory.inputs import GiB, SCHEDULES, UNCOUNTED_FRACTION, BatchShape, MemoryOptions, ParallelLayout
from rollplex.rl.memory.measure import PHASE_MARK, CpuPhasePeaks, live_tensor_bytes
from rollplex.rl.memory.plan import (PHASES, TENSOR_CLASSES, MemoryPlan, MemoryPlanError, effective_options,
                                     loop_phase_bytes, plan_memory)
from rollplex.rl.memory.report import format_lora_saving, format_plan

__all__ = [
    "GiB", "PHASES", "PHASE_MARK", "PRESETS", "SCHEDULES", "TENSOR_CLASSES", "UNCOUNTED_FRACTION", "BatchShape",
    "CpuPhasePeaks", "LoRACounts", "MemoryOptions", "MemoryPlan", "MemoryPlanError", "ParallelLayout", "admitted",
    "count_lora", "count_params", "effective_options", "format_lora_saving", "format_plan", "kv_bytes_per_token",
    "live_tensor_bytes", "loop_phase_bytes", "micro_batch", "plan_memory", "kept_prompt_state",
]
