"""What the rest of Rollplex may know of a model family, as one object.

A family is a package (rollplex.models.qwen2_5_vl, ...) that exports `FAMILY`, a
`ModelFamily`: how to build its model from a Hugging Face config.json, how its
parameters map to the checkpoint's keys, how tensor parallelism splits it and
which modules FSDP shards and activation checkpointing recomputes, its
parameter counts (the memory plan and FLOPs read them), its named sizes, its
processor and its tiny test checkpoint. As torchtitan's `ModelSpec`: the
engine, the trainer and the RL loop hold a model (the `VisionLanguageModel`
protocol) and reach its family's specifics only through this object, which
rollplex.models.registry finds by config.json's `model_type` or by the model's
args.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


# A family's args dataclass (ModelFamily.args_class): the fields every family's has are listed on ModelFamily.
FamilyArgs = Any


@dataclass(frozen=True)
class ParamCounts:
    """Parameter elements by how tensor parallelism and FSDP treat them
    (rollplex.train.parallelize), counted from a family's layer shapes."""

    total: int
    tp_split: int  # decoder q/k/v/o and MLP linears, embedding and head when untied: 1/tp per rank
    vision: int  # vision tower and merger(s): replicated over tp
    root: int  # FSDP's root unit (all but decoder layers and vision blocks), at tp 1
    root_tp_split: int  # of which split by tp (the embedding and head when untied)
    layer_tp_split: int  # one decoder layer's tp-split elements
    layer_replicated: int  # one decoder layer's elements tp leaves whole (its norms)

    def per_tp_rank(self, tp: int) -> int:
        """Elements one rank holds once gathered over dp_shard."""
        return self.tp_split // tp + self.total - self.tp_split

    def root_per_tp_rank(self, tp: int) -> int:
        """The root unit's elements on one rank once gathered over dp_shard."""
        return self.root_tp_split // tp + self.root - self.root_tp_split

    def layer_per_tp_rank(self, tp: int) -> int:
        """One decoder layer's elements on one rank once gathered over dp_shard."""
        return self.layer_tp_split // tp + self.layer_replicated


@dataclass(frozen=True)
class LinearParams:
    """Weights of the matmuls each token (each patch) goes through, for FLOP counts
    (rollplex.train.flops): 2 FLOPs per weight per token in a forward."""

    decoder: int  # every decoder layer's linears, per text token
    vision: int  # the patch embedding, every vision block and the merger(s), per patch


# Checkpoint key endings of the Qwen VL models' norm scales (RMSNorm and LayerNorm weights, which multiply x).
_SCALE_NORM_KEYS = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")


def unit_norm_scales(key: str) -> float | None:
    """ModelFamily.init_constant of models whose norms all scale by their weight (x * w): 1, the
    identity scale, for each norm's weight; None (drawn at random) for every other tensor."""
    return 1.0 if key.endswith(_SCALE_NORM_KEYS) else None


@dataclass(frozen=True)
class StackedTensor:
    """A parameter the checkpoint holds otherwise than as rows of one key (`hf_key_to_params`):
    an MoE layer's experts stacked in one parameter, which a checkpoint stores one key per
    expert and projection, or transposed."""

    keys: tuple[str, ...]  # the checkpoint keys it is made of
    # (the keys' tensors in `keys` order, the parameter's shape) -> the parameter; a CheckpointError if they
    # cannot make it
    load: Callable[[list[torch.Tensor], tuple[int, ...]], torch.Tensor]
    save: Callable[[torch.Tensor], list[torch.Tensor]]  # the parameter -> the keys' tensors, in `keys` order


@dataclass(frozen=True)
class ModelFamily:
    """One model family, as the rest of Rollplex sees it (see the module docstring).

    `args` is the family's own args dataclass; every family's has `text` with
    vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps and
    max_position_embeddings, `vision` with depth, hidden_size, intermediate_size,
    num_heads, in_channels, patch_size, temporal_patch_size, spatial_merge_size
    and out_hidden_size, and at the top tie_word_embeddings, the vision token
    ids, eos_token_id and `rope_spec` (rollplex.models.rope)."""

    name: str  # config.json's model_type, and model.tiny.family's value
    hf_architecture: str  # config.json's architectures entry: the transformers class that loads an export
    hf_processor: str  # the transformers processor class a checkpoint's tokenizer_config.json names
    args_class: type
    model_class: type[nn.Module]  # model_class(args) builds the model (on the meta device when loading)
    args_from_hf_config: Callable[[dict, str], Any]  # (config.json dict, its path for errors) -> args
    hf_config_from_args: Callable[[Any], dict]  # args -> config.json that transformers loads
    hf_key_to_params: Callable[[str], list[str]]  # checkpoint key -> the parameters it holds, in row order
    param_to_hf_key: Callable[[str], str]  # parameter name -> its checkpoint key (the hub's style)
    # parameter name -> its name in transformers' model (nested: model.language_model.*), which peft matches
    param_to_hf_module_key: Callable[[str], str]
    check_tp: Callable[[Any, int], None]  # (args, tp): raise when the model cannot be split tp ways
    apply_tp: Callable[[nn.Module, DeviceMesh], nn.Module]  # the TP plan, applied in place
    repeated_blocks: Callable[[nn.Module], list[nn.ModuleList]]  # FSDP's units, activation checkpointing's too
    vision_tower: Callable[[nn.Module], nn.Module]  # what parallel.freeze_vision freezes
    count_params: Callable[[Any], ParamCounts]
    linear_params: Callable[[Any], LinearParams]
    # Feature rows the tower gives each vision token (VisionEmbeds): 1, plus one per DeepStack level.
    vision_feature_levels: Callable[[Any], int]
    # Intermediate-width tensors per patch of a vision block's MLP: (kept for backward, live at once in a forward).
    vision_mlp_widths: tuple[int, int]
    presets: dict[str, Any]  # named sizes (memory_plan --model NAME): the hub's config.json values
    tiny_args: Callable[..., Any]  # a model of a few hundred thousand parameters for tests
    tiny_spec: dict[str, Any]  # the rollplex.tiny.TinySpec fields whose default this family's tiny model changes
    # A tiny model's M-RoPE split of half its rotary width (head_dim, or the part of it that rotates).
    tiny_mrope_section: Callable[[int], tuple[int, int, int]]
    # (TinySpec, vocab size, {config key: token id}, style, dtype) -> the tiny model's config.json
    tiny_hf_config: Callable[[Any, int, dict[str, int], str, str], dict]
    tiny_processor_files: Callable[[Any], dict[str, dict]]  # TinySpec -> {file name: JSON} of its processor
    load_processor: Callable[..., Any]  # (folder, **budgets) -> the processor (rollplex.data.processor)
    # Checkpoint key prefixes no parameter takes -> why: the loader skips their tensors and says so once.
    dropped_keys: dict[str, str] = field(default_factory=dict)
    # Checkpoint key -> the constant build_model fills that tensor with (a norm's identity scale), None: drawn at
    # random. Not every family's norms are x * w: a zero-centred one, x * (1 + w), is the identity at w = 0.
    init_constant: Callable[[str], float | None] = unit_norm_scales
    # (checkpoint key, shape, generator) -> the tensor build_model draws for it as transformers initialises it when
    # that is no weight's or bias's draw (a Gated DeltaNet's A_log and dt_bias), on the generator's device; None:
    # drawn as a weight or a bias. build_model(init_std=None), the parity tests' init, draws them as those too.
    init_draw: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor | None] = lambda key, shape, gen: None
    # The decoder layers that keep K/V in the engine's paged pool and the kept-prefix passes, ascending (args -> them).
    kv_layers: Callable[[Any], list[int]] = lambda args: list(range(args.text.num_hidden_layers))
    # (args, tp) -> bytes of one sequence's recurrent state on one TP rank, every layer that keeps one (a
    # Gated DeltaNet's convolution tail and fp32 recurrent state): the engine's state pool holds one per row.
    recurrent_state_bytes: Callable[[Any, int], int] = lambda args, tp: 0
    # (parameter name, args) -> how the checkpoint holds it when not as rows of one key (`StackedTensor`), or None
    stacked_tensor: Callable[[str, Any], StackedTensor | None] = lambda name, args: None
    relatives_not_supported: dict[str, str] = field(default_factory=dict)  # model_type -> what loading it needs
    sizes_not_supported: dict[str, str] = field(default_factory=dict)  # named sizes of those relatives -> the same

    def transformers_class(self) -> type:
        """transformers' class for this family's checkpoints (the parity oracle of the tests and tools)."""
        import transformers

        return getattr(transformers, self.hf_architecture)
