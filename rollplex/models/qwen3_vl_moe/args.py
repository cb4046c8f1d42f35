"""Qwen3-VL-MoE's shape: Qwen3-VL's (the tower, DeepStack, the Qwen3 attention and
M-RoPE) with a mixture of experts as the MLP of its sparse decoder layers; the
args dataclasses, the named sizes (30B-A3B, 235B-A22B), a tiny one for tests, and
the parameter counts the memory plan and FLOP counts read.

`TextArgs` is Qwen3-VL's plus `moe` (rollplex.models.moe.MoEArgs: experts, top-k,
each expert's width, which layers are sparse). Its `intermediate_size` is the
dense SwiGLU's, which only the layers `moe` leaves dense have (`mlp_only_layers`,
layers off `decoder_sparse_step`; none in the hub's models). `ModelArgs` is not
a subclass of Qwen3-VL's: the registry tells families apart by their args' class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rollplex.models.family import LinearParams, ParamCounts
from rollplex.models.moe import MoEArgs
from rollplex.models.qwen3_vl import args as dense
from rollplex.models.qwen3_vl.args import VISION_MLP_WIDTHS, VisionArgs, vision_counts, vision_linear_params
from rollplex.models.qwen_vl.args import QwenVLArgs

__all__ = ["PRESETS", "VISION_MLP_WIDTHS", "ModelArgs", "TextArgs", "VisionArgs", "count_params", "linear_params",
           "tiny_args", "with_experts"]


@dataclass
class TextArgs(dense.TextArgs):
    """Qwen3-VL's text args (their defaults too: a config.json is read as Qwen3-VL's) and the experts."""

    moe: MoEArgs = field(default_factory=MoEArgs)


@dataclass
class ModelArgs(QwenVLArgs):
    """Everything the model's shape and inputs depend on; built from a HF config.json
    (the token ids and tie_word_embeddings: `QwenVLArgs`)."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    text: TextArgs = field(default_factory=TextArgs)

    # Qwen3-VL's (they read the token ids, the merge size and the DeepStack blocks only).
    rope_spec = dense.ModelArgs.rope_spec
    deepstack_levels = dense.ModelArgs.deepstack_levels


def with_experts(args: dense.ModelArgs, moe: MoEArgs) -> ModelArgs:
    """Qwen3-VL's args `args` with `moe`'s experts in its decoder."""
    text = TextArgs(**{f.name: getattr(args.text, f.name) for f in dataclasses.fields(args.text)}, moe=moe)
    return ModelArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "text"},
                     text=text)


def tiny_args(tie: bool = False, layers: int = 2, deepstack: tuple[int, ...] = (0, 1), depth: int = 3,
              experts: int = 8, top_k: int = 2, mlp_only_layers: tuple[int, ...] = (),
              decoder_sparse_step: int = 1) -> ModelArgs:
    """Qwen3-VL's tiny model (rollplex.models.qwen3_vl.args.tiny_args) with `experts` experts of
    width 48 in its sparse layers. 48 keeps the hub's checkpoint layout of the experts apart
    from transformers' (neither 48 nor 2 * 48 is the width 64, see rollplex.models.qwen3_vl_moe.hf),
    and every row of the grouped GEMM a multiple of 16 bytes (torch._grouped_mm's rule)."""
    moe = MoEArgs(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=48,
                  decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers))
    return with_experts(dense.tiny_args(tie=tie, layers=layers, deepstack=deepstack, depth=depth), moe)


def _hub_size(hidden: int, inter: int, layers: int, heads: int, moe_inter: int) -> ModelArgs:
    text = TextArgs(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=4, head_dim=128,
                    moe=MoEArgs(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=moe_inter))
    return ModelArgs(vision=VisionArgs(out_hidden_size=hidden), text=text, tie_word_embeddings=False)


# The hub's config.json values of Qwen/Qwen3-VL-30B-A3B-Instruct and Qwen/Qwen3-VL-235B-A22B-Instruct, written from
# memory (no hub access here): the text sizes are the Qwen3-30B-A3B / 235B-A22B decoders (128 experts, 8 per token,
# 4 KV heads, head_dim 128, no shared expert, every layer sparse, untied embeddings) with Qwen3-VL's vocabulary,
# rotary (rope_theta 5e6, mrope_section [24, 20, 20] interleaved, 262144 positions) and tower (transformers' default:
# 27 blocks of 1152, MLP 4304, DeepStack [8, 16, 24]). intermediate_size (6144, 12288) is the dense MLP width no
# layer of theirs uses. Check against config.json before relying on a number. Totals from `count_params`:
# 31,070,754,032 / 235,670,022,896 parameters (the model cards' 31B / 236B, as remembered); per text token, the
# decoder's matmul weights with the active experts (`linear_params`): 2.73B / 20.9B.
PRESETS: dict[str, ModelArgs] = {
    "qwen3-vl-30b-a3b": _hub_size(2048, 6144, 48, 32, 768),
    "qwen3-vl-235b-a22b": _hub_size(4096, 12288, 94, 64, 1536),
}


def _layer_counts(t: TextArgs) -> dict[bool, tuple[int, int]]:
    """One decoder layer's elements, sparse (True) or dense, as (split by tensor parallelism,
    left whole) under Qwen3-VL's plan: q/k/v/o and a dense SwiGLU split; the norms (two,
    q_norm, k_norm) whole, and so are the router and the experts, which no TP plan splits
    (rollplex.models.qwen3_vl_moe.tp_plan runs at tp 1; experts go over ranks by expert parallelism)."""
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attention = t.hidden_size * (q + 2 * kv) + q * t.hidden_size
    norms = 2 * t.hidden_size + 2 * t.head_dim
    m = t.moe
    experts = m.num_experts * t.hidden_size + m.num_experts * 3 * t.hidden_size * m.moe_intermediate_size
    return {True: (attention, norms + experts), False: (attention + 3 * t.hidden_size * t.intermediate_size, norms)}


def count_params(args: ModelArgs) -> ParamCounts:
    """Parameter counts from the layer shapes of `model` (the tests check them against a built
    model), every expert counted: memory holds them all. The per-layer figures are the
    largest layer's (a sparse one in the hub's models): the largest FSDP unit a pass gathers."""
    t, v = args.text, args.vision
    vision_block, vision_root = vision_counts(v)
    per_kind = _layer_counts(t)
    kinds = [t.moe.is_sparse(i) for i in range(t.num_hidden_layers)]
    embeddings = t.vocab_size * t.hidden_size * (1 if args.tie_word_embeddings else 2)
    root_split = 0 if args.tie_word_embeddings else embeddings
    root = vision_root + t.hidden_size + embeddings  # the tower's root parts, the final norm, embedding (and head)
    layer_split, layer_whole = max((per_kind[kind] for kind in set(kinds)), key=sum)
    return ParamCounts(total=v.depth * vision_block + sum(sum(per_kind[kind]) for kind in kinds) + root,
                       tp_split=sum(per_kind[kind][0] for kind in kinds) + root_split,
                       vision=v.depth * vision_block + vision_root, root=root, root_tp_split=root_split,
                       layer_tp_split=layer_split, layer_replicated=layer_whole)


def linear_params(args: ModelArgs) -> LinearParams:
    """The matmul weights a text token and a patch go through (biases and norms left out): every
    layer's q/k/v and o, and its MLP as a token runs it: in a sparse layer the router and its
    top-k experts only (FLOPs follow the active experts, memory all of them: `count_params`)."""
    t = args.text
    m = t.moe
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attention = t.hidden_size * (q + 2 * kv) + q * t.hidden_size
    sparse = m.num_experts * t.hidden_size + m.num_experts_per_tok * 3 * t.hidden_size * m.moe_intermediate_size
    mlp = {True: sparse, False: 3 * t.hidden_size * t.intermediate_size}
    decoder = sum(attention + mlp[t.moe.is_sparse(i)] for i in range(t.num_hidden_layers))
    return LinearParams(decoder, vision_linear_params(args.vision))
