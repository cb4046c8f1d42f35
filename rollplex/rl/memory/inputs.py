"""The memory plan's inputs: where the trainer and the engine live, one step's
batch, and the run's options. (The model shapes of the published sizes,
`PRESETS`, are the families', rollplex.models.registry.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollplex.config.sections import LoRAConfig
from rollplex.models.family import FamilyArgs

GiB = 1 << 30

# What the plan does not count, as a fraction of the device's memory: the caching allocator's
# fragmentation (reserved but not allocated), library workspaces (cuBLAS, NCCL buffers), the CUDA
# context, and the error of the estimates. Sizes are decided within the rest (`usable_bytes`).
UNCOUNTED_FRACTION = 0.1

SCHEDULES = ("overlap", "serial-prefix", "serial-naive")
ROUTING_REPLAYS = ("none", "rollout", "old")  # algorithm.routing_replay's values


@dataclass
class ParallelLayout:
    """Where the trainer and the engine live. The trainer's mesh is dp_shard x tp
    over all GPUs; the engine runs world / engine_tp replicas of engine_tp GPUs.
    `ep` (parallel.ep, MoE models at tp 1): each group of ep dp ranks splits every
    MoE layer's experts ep ways, and FSDP shards each rank's experts over the
    dp_shard / ep ranks holding the same ones (rollplex.models.expert_parallel)."""

    dp_shard: int = 1
    tp: int = 1
    engine_tp: int = 1
    nodes: int = 1
    gpus_per_node: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.dp_shard * self.tp != self.world:
            raise ValueError(f"dp_shard {self.dp_shard} x tp {self.tp} must equal the {self.world} GPUs "
                             f"({self.nodes} nodes x {self.gpus_per_node})")
        if self.world % self.engine_tp:
            raise ValueError(f"engine_tp {self.engine_tp} does not divide the {self.world} GPUs")
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(f"ep {self.ep} does not divide dp_shard {self.dp_shard}: each expert-parallel group is "
                             "ep of the dp ranks")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"ep {self.ep} with tp {self.tp}: expert parallelism runs at tp 1")

    @classmethod
    def of(cls, dims, engine_tp: int) -> "ParallelLayout":
        """A run's layout: its trainer's mesh (rollplex.dist.ParallelDims, parallel.ep among them) on one node of
        all its ranks, and its engine's TP size."""
        return cls(dims.dp_shard, dims.tp, engine_tp, 1, dims.world_size, dims.ep)

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

    def vision_patches(self, args: FamilyArgs) -> int:
        return self.vision_tokens * args.vision.spatial_merge_size ** 2


@dataclass
class MemoryOptions:
    """Dtypes, which optional tensors exist, the schedule, and the sizes (None: the plan decides)."""

    param_dtype: torch.dtype = torch.bfloat16  # gathered weights, KV, activations
    master_dtype: torch.dtype = torch.float32  # the sharded weights the optimizer updates
    grad_dtype: torch.dtype = torch.float32  # sharded gradients (FSDP reduces in fp32)
    optimizer_dtype: torch.dtype = torch.float32  # AdamW's two moments
    ref_model: bool = False  # kl_coef > 0: a frozen reference copy, sharded like the actor (LoRA: `ref_is_base`)
    ref_dtype: torch.dtype = torch.bfloat16  # frozen, so bf16 suffices (the loop loads it in model.dtype)
    recompute_old_logprobs: bool = False  # the old policy's prefix KV is kept too
    offload_optimizer: bool = False  # AdamW moments on the host outside the optimizer step
    activation_checkpointing: bool = False
    # No gradients / moments for the vision tower, no graph through it: parallel.freeze_vision, which the
    # plan's own options (MemoryPlan.options) replace by the run's effective one (with LoRA, `plan_memory`).
    freeze_vision: bool = False
    # The run's lora section: rank > 0 trains adapters on a frozen base (rollplex.train.lora), which the
    # plan counts in the compute dtype, whole on every dp rank, and outside FSDP's gathers.
    lora: LoRAConfig = field(default_factory=LoRAConfig)
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
    # The logprob head's tokens per chunk (rollplex.train.logprob_head); None: the head's own for the vocabulary.
    logits_chunk_tokens: int | None = None
    # MoE models: algorithm.routing_replay (none, rollout: the engine logs every token's experts and the samples
    # carry them to the update, old: the old-logprob pass records them), which the plan counts as `routes`.
    routing_replay: str = "none"
    # Multi-turn rollouts (Config.multi_turn): a response holds observations (tool or environment answers) whose
    # images go through the vision tower in the passes over responses, per response; at most every response token
    # is an observation's vision token (rollout.max_tokens bounds the whole response, observations included).
    multi_turn: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.routing_replay not in ROUTING_REPLAYS:
            raise ValueError(f"routing_replay {self.routing_replay!r}: expected one of {', '.join(ROUTING_REPLAYS)}")
        if self.routing_replay == "old" and not self.recompute_old_logprobs:
            raise ValueError("routing_replay old replays the old-logprob pass's routes: it needs "
                             "recompute_old_logprobs")
        if self.lora.rank > 0 and self.lora.train_vision and self.freeze_vision:
            raise ValueError("lora.train_vision trains the vision tower in full, freeze_vision freezes it: set one")

    @property
    def share_prefix(self) -> bool:
        return self.schedule != "serial-naive"

    @property
    def ref_is_base(self) -> bool:
        """The reference model is LoRA's frozen base itself, on the trainer's tensors (rollplex.train.lora
        .base_model_view): no weights of its own, none gathered. With lora.train_vision it is a copy."""
        return self.ref_model and self.lora.adapters_only

    @classmethod
    def from_config(cls, cfg, schedule: str, param_dtype: torch.dtype, device_memory: int,
                    attention: str) -> "MemoryOptions":
        """A run's options (rollplex.config.Config) under `schedule` (one of SCHEDULES: the run's
        schedule's memory layout): its sizes, where set, override the plan's."""
        s = cfg.schedule
        return cls(param_dtype=param_dtype, ref_model=cfg.algorithm.kl_coef > 0, ref_dtype=param_dtype,
                   recompute_old_logprobs=cfg.algorithm.recompute_old_logprobs,
                   offload_optimizer=cfg.parallel.offload_optimizer,
                   activation_checkpointing=cfg.parallel.activation_checkpointing,
                   freeze_vision=cfg.parallel.freeze_vision, lora=cfg.lora, schedule=schedule,
                   updates_per_batch=cfg.algorithm.updates_per_batch, entropy=cfg.algorithm.entropy_coef > 0,
                   attention=attention, block_size=cfg.rollout.block_size, max_num_seqs=cfg.rollout.max_num_seqs,
                   micro_batch_tokens=cfg.trainer.max_tokens_per_micro_batch or None,
                   kv_pool=cfg.rollout.kv_cache_memory or None, prefix_budget=s.prefix_memory_budget or None,
                   device_memory=device_memory, routing_replay=getattr(cfg.algorithm, "routing_replay", "none"),
                   multi_turn=cfg.multi_turn)


def usable_bytes(options: MemoryOptions) -> int:
    """The memory the plan may fill: the device's, less UNCOUNTED_FRACTION of it."""
    return int(options.device_memory * (1 - UNCOUNTED_FRACTION))
