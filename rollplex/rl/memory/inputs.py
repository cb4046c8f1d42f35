"""The memory plan's inputs: the model shapes of the published sizes, where the
trainer and the engine live, one step's batch, and the run's options."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs

GiB = 1 << 30

# What the plan does not count, as a fraction of the device's memory: the caching allocator's
# fragmentation (reserved but not allocated), library workspaces (cuBLAS, NCCL buffers), the CUDA
# context, and the error of the estimates. Sizes are decided within the rest (`usable_bytes`).
UNCOUNTED_FRACTION = 0.1

SCHEDULES = ("overlap", "serial-prefix", "serial-naive")


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
