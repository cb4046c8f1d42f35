"""Qwen3.5-MoE's shape: Qwen3.5's (rollplex.models.qwen3_5.args: the tower and the
hybrid Gated DeltaNet / gated attention decoder) with a sparse MoE block
(rollplex.models.moe) in place of every decoder layer's SwiGLU; its named sizes, and
the parameter counts the memory plan (every expert) and FLOP counts (the experts a
token goes through) read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from rollplex.models.family import LinearParams, ParamCounts
from rollplex.models.moe import MoEArgs
from rollplex.models.qwen3_5 import args as qwen3_5
from rollplex.models.qwen3_5.args import (FULL_ATTENTION, LINEAR_ATTENTION, HybridArgs, VisionArgs, kv_layers,
                                          recurrent_state_bytes, vision_args)

__all__ = ["PRESETS", "ModelArgs", "TextArgs", "count_params", "default_moe", "kv_layers", "linear_params",
           "recurrent_state_bytes", "tiny_args", "with_experts"]


def default_moe() -> MoEArgs:
    """transformers' Qwen3_5MoeTextConfig defaults (Qwen3.5-35B-A3B's): 256 experts of 512, 8 per
    token, a shared expert of 512. Every layer is sparse and the top-k weights renormalised, as
    transformers' model always has them (MoEArgs' own defaults for those)."""
    return MoEArgs(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512)


@dataclass
class TextArgs(qwen3_5.TextArgs):
    """Qwen3.5's text args with the experts' shape (`moe`); the other defaults changed are
    transformers' Qwen3_5MoeTextConfig's (the 35B-A3B's), so a config.json that leaves a field
    out means what it means to transformers.

    `intermediate_size` is no config.json field here: no layer has a dense MLP. It is derived,
    the SwiGLU width one token's activations span (its k experts' and the shared expert's),
    which is what the memory plan reads it as (rollplex.rl.memory)."""

    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_key_value_heads: int = 2
    intermediate_size: int = field(init=False, default=0)
    moe: MoEArgs = field(default_factory=default_moe)

    def __post_init__(self) -> None:
        super().__post_init__()
        m = self.moe
        self.intermediate_size = m.num_experts_per_tok * m.moe_intermediate_size + m.shared_expert_intermediate_size


@dataclass
class ModelArgs(HybridArgs):
    """Everything the model's shape and inputs depend on; built from a HF config.json."""

    text: TextArgs = field(default_factory=TextArgs)


def with_experts(dense: qwen3_5.ModelArgs, moe: MoEArgs) -> ModelArgs:
    """The MoE model of `dense`'s shape (Qwen3.5's args: tower, token ids, decoder), every
    layer's MLP a sparse MoE block of `moe` instead of its SwiGLU."""
    text = {f.name: getattr(dense.text, f.name) for f in fields(TextArgs) if f.init and f.name != "moe"}
    top = {f.name: getattr(dense, f.name) for f in fields(dense) if f.name != "text"}
    return ModelArgs(**top, text=TextArgs(**text, moe=moe))


def tiny_args(tie: bool = False, layer_types: tuple[str, ...] = (LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION),
              depth: int = 2, top_k: int = 2) -> ModelArgs:
    """Qwen3.5's tiny_args with 8 experts of 16, `top_k` per token, and a shared expert of 24
    (widths multiples of 8: torch._grouped_mm wants every row 16-byte aligned in bf16)."""
    return with_experts(qwen3_5.tiny_args(tie, layer_types, depth),
                        MoEArgs(num_experts=8, num_experts_per_tok=top_k, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24))


def _hub_size(hidden: int, layers: int, heads: int, value_heads: int, expert: int) -> ModelArgs:
    """256 experts, 8 per token, the shared expert as wide as each routed one; the tower Qwen3-VL-8B's."""
    moe = MoEArgs(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=expert,
                  shared_expert_intermediate_size=expert)
    text = TextArgs(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                    linear_num_value_heads=value_heads, moe=moe)
    return ModelArgs(vision=vision_args(out_hidden_size=hidden), text=text, tie_word_embeddings=False)


# Qwen/Qwen3.5-35B-A3B and Qwen/Qwen3.5-122B-A10B, written without hub access (check config.json before relying on
# a number). Both: vocabulary 248320, head_dim 256 with a quarter rotating, DeltaNet heads of 128 with 16 key heads,
# 3 DeltaNet layers then 1 full attention, untied embeddings, 27 vision blocks of 1152 (remembered).
# - 35B-A3B: transformers' Qwen3_5MoeTextConfig defaults (its docstring names this checkpoint): hidden 2048,
#   40 layers, 16 / 2 attention heads, 32 value heads, 256 experts of 512, 8 per token, a shared expert of 512.
# - 122B-A10B: remembered, not checked: hidden 3072, 48 layers, 32 / 2 attention heads, 64 value heads, 256 experts
#   of 1024, 8 per token, a shared expert of 1024.
PRESETS: dict[str, ModelArgs] = {
    "qwen3.5-35b-a3b": _hub_size(2048, 40, 16, 32, expert=512),
    "qwen3.5-122b-a10b": _hub_size(3072, 48, 32, 64, expert=1024),
}


def _shared_expert(t: TextArgs) -> int:
    """The shared expert's SwiGLU and its sigmoid gate (a Linear to one output)."""
    width = t.moe.shared_expert_intermediate_size
    return 3 * t.hidden_size * width + t.hidden_size if width else 0


def moe_params(t: TextArgs) -> int:
    """One layer's MoE block, every expert: the router, the experts' gate_up_proj and down_proj, the shared expert."""
    m = t.moe
    return t.hidden_size * m.num_experts + m.num_experts * 3 * t.hidden_size * m.moe_intermediate_size \
        + _shared_expert(t)


def moe_linear_params(t: TextArgs) -> int:
    """The matmul weights one token goes through in a layer's MoE block: the router, its k experts, the shared
    expert and its gate (not the experts it does not go to)."""
    m = t.moe
    return t.hidden_size * m.num_experts + m.num_experts_per_tok * 3 * t.hidden_size * m.moe_intermediate_size \
        + _shared_expert(t)


def count_params(args: ModelArgs) -> ParamCounts:
    """Qwen3.5's counts (rollplex.models.qwen3_5.args.count_params) with every expert in each layer's
    MLP: what memory holds. The MoE block counts with the elements tensor parallelism would split,
    as the dense MLP does; the family runs at TP 1 (tp_plan), where the split is moot."""
    return qwen3_5.count_params(args, moe_params)


def linear_params(args: ModelArgs) -> LinearParams:
    """Qwen3.5's FLOP weights with each layer's MLP the k active experts, the router and the shared expert."""
    return qwen3_5.linear_params(args, moe_linear_params)
