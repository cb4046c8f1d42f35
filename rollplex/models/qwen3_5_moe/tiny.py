"""A tiny Qwen3.5-MoE's shape and config.json: a tiny Qwen3.5's (rollplex.models.qwen3_5.tiny),
each layer's MLP the spec's experts (rollplex.tiny.TinySpec's num_experts,
num_experts_per_tok, moe_intermediate_size and shared_expert_intermediate_size, whose
defaults are widths that are multiples of 8, as torch._grouped_mm's 16-byte row
strides need in bf16)."""

from __future__ import annotations

from typing import Any

from rollplex.models.moe import MoEArgs
from rollplex.models.qwen3_5 import tiny as qwen3_5_tiny
from rollplex.models.qwen3_5.tiny import TINY_SPEC, mrope_section
from rollplex.models.qwen3_5_moe.args import ModelArgs, with_experts
from rollplex.models.qwen3_5_moe.hf import hf_config_from_args

__all__ = ["TINY_SPEC", "args_of_spec", "mrope_section", "tiny_hf_config"]


def args_of_spec(spec: Any, vocab_size: int, ids: dict[str, int]) -> ModelArgs:
    """The args of the tiny model `spec` (see rollplex.models.qwen3_5.tiny.args_of_spec) with its experts."""
    moe = MoEArgs(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                  moe_intermediate_size=spec.moe_intermediate_size,
                  shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    return with_experts(qwen3_5_tiny.args_of_spec(spec, vocab_size, ids), moe)


def tiny_hf_config(spec: Any, vocab_size: int, ids: dict[str, int], style: str = "nested",
                   dtype: str = "float32") -> dict[str, Any]:
    """config.json of the tiny model `spec`, as hf_config_from_args writes a Qwen3.5-MoE's (nested only)."""
    return qwen3_5_tiny.tiny_config(args_of_spec(spec, vocab_size, ids), ids, style, dtype, hf_config_from_args)
