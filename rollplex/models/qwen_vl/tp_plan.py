"""The tensor-parallel plan and FSDP units both Qwen VL families share
(rollplex.models.qwen_vl); each family's `tp_plan` adds its vision tower's
(which blocks and mergers split, and when the tower stays replicated).

Each decoder layer is split Megatron-style: q/k/v and gate/up column-parallel
(each rank holds whole heads / a slice of the MLP width), o_proj and down_proj
row-parallel (partial outputs all-reduced on the TP group). Qwen3's q_norm and
k_norm keep their whole weight on every rank: they normalise each head over
head_dim with one weight shared by all heads, so they run unchanged on a rank's
heads. But each rank's gradient of that weight covers its own heads only, so
they are planned as sequence-parallel over the head dimension (torchtitan's
Qwen3 plan): the weight becomes a Replicate DTensor, its input a Shard(heads)
one, and the backward sums the ranks' partial gradients (plain replicated
weights would train on a 1/tp share of the heads, each rank differently). The
embedding is vocab-parallel (row-parallel over the vocabulary) and the LM head
column-parallel over the vocabulary with its logits gathered, when untied; tied,
both stay replicated, since the head reads the embedding's weight. Model code is
unchanged: it reshapes with the local head count (`view(T, -1, head_dim)`).

A vision block's attention splits the same way (attn.q/k/v column-parallel,
attn.proj row-parallel; the models keep q, k and v as three Linears for this,
the loader splits the hub's fused qkv).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


def check_tp(args: Any, tp: int) -> None:
    """Raise before any work starts when the model (a family's ModelArgs) cannot be split `tp` ways."""
    t = args.text
    for name, value in (("num_attention_heads", t.num_attention_heads), ("num_key_value_heads",
                        t.num_key_value_heads), ("intermediate_size", t.intermediate_size),
                        ("vocab_size", t.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {name} ({value})")


def vision_attention_plan() -> dict[str, ParallelStyle]:
    """A vision block's attention: q, k and v column-parallel, proj row-parallel."""
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
    }


def swiglu_plan(prefix: str) -> dict[str, ParallelStyle]:
    """A SwiGLU MLP (the decoders', Qwen2.5-VL's vision blocks'): gate and up column-parallel, down row-parallel."""
    return {
        f"{prefix}.gate_proj": ColwiseParallel(),
        f"{prefix}.up_proj": ColwiseParallel(),
        f"{prefix}.down_proj": RowwiseParallel(),
    }


def decoder_layer_plan(qk_norm: bool) -> dict[str, ParallelStyle]:
    """One decoder layer's plan; `qk_norm`: its attention has q_norm and k_norm (Qwen3)."""
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    if qk_norm:
        # q and k are (tokens, local heads, head_dim) there: heads are the sharded dimension.
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return {**plan, **swiglu_plan("mlp")}


def apply_decoder_tp(model: nn.Module, tp_mesh: DeviceMesh, qk_norm: bool) -> None:
    """Shard every decoder layer of `model` (a QwenVL) over `tp_mesh` in place, and the
    embedding and LM head when they are not tied."""
    layer_plan = decoder_layer_plan(qk_norm)
    for layer in model.language_model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)
    apply_embedding_tp(model, tp_mesh)


def apply_embedding_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the embedding and LM head of `model` (a QwenVL) over `tp_mesh` in place when they are
    not tied (vocab-parallel); tied, both stay replicated."""
    if model.lm_head is not None:
        parallelize_module(model.language_model, tp_mesh,
                           {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def repeated_blocks(model: nn.Module) -> list[nn.ModuleList]:
    """The vision blocks and the decoder layers: each block is an FSDP unit of its own
    and what activation checkpointing recomputes (rollplex.train.parallelize). The
    rest of the tower (patch embedding, mergers, ...) stays in the root unit, which
    `fsdp_entry` methods gather."""
    return [model.visual.blocks, model.language_model.layers]


def vision_tower(model: nn.Module) -> nn.Module:
    """What model.freeze_vision freezes: the tower and its merger(s)."""
    return model.visual
