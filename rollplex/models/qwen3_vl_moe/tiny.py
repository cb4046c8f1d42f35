"""A tiny Qwen3-VL-MoE's shape and config.json: Qwen3-VL's tiny one
(rollplex.models.qwen3_vl.tiny) with experts (rollplex.tiny writes the rest of its
folder: tokenizer, chat template, Qwen3-VL's processor files, weights)."""

from __future__ import annotations

from typing import Any

from rollplex.models.moe import MoEArgs
from rollplex.models.qwen3_vl import TINY_SPEC as QWEN3_VL_TINY_SPEC
from rollplex.models.qwen3_vl import tiny as dense
from rollplex.models.qwen3_vl_moe.hf import moe_config

# The TinySpec fields a tiny Qwen3-VL-MoE changes: Qwen3-VL's, and experts of width 48. TinySpec's 32 would make
# gate_up_proj square at width 64 (2 * 32), where transformers' loader cannot tell the hub's layout of the experts
# from its own (rollplex.models.qwen3_vl_moe.hf); 48 also keeps every grouped-GEMM row a multiple of 16 bytes.
TINY_SPEC = {**QWEN3_VL_TINY_SPEC, "moe_intermediate_size": 48}

mrope_section = dense.mrope_section


def tiny_hf_config(spec: Any, vocab_size: int, ids: dict[str, int], style: str = "nested",
                   dtype: str = "float32") -> dict[str, Any]:
    """config.json of the tiny model `spec` (a rollplex.tiny.TinySpec): Qwen3-VL's with the spec's
    experts (num_experts, num_experts_per_tok, moe_intermediate_size; no shared expert) in every layer."""
    moe = MoEArgs(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                  moe_intermediate_size=spec.moe_intermediate_size)
    return moe_config(dense.tiny_hf_config(spec, vocab_size, ids, style, dtype), moe)
