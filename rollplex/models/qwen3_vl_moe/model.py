"""Qwen3-VL-MoE in plain PyTorch: Qwen3-VL (rollplex.models.qwen3_vl.model: the
tower with its learned position grid, DeepStack, the Qwen3 attention and
interleaved M-RoPE) whose decoder layers take a sparse MoE block as their MLP
(rollplex.models.moe.SparseMoE: router, top-k experts renormalised, no shared
expert) where `moe.is_sparse(layer)`, and the dense SwiGLU elsewhere.

A sparse layer routes by the `Routing` its forward's attention backend carries
(rollplex.models.moe.with_routing), which records, replays and counts the routes;
without one it routes live. Module names are the checkpoints'
(`mlp.gate`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
"""

from __future__ import annotations

import torch.nn as nn

from rollplex.models.moe import SparseMoE
from rollplex.models.qwen3_vl.model import Qwen3_VL, VisionTransformer, check_acts
from rollplex.models.qwen3_vl_moe.args import ModelArgs, TextArgs
from rollplex.models.qwen_vl.layers import LanguageModel, dense_mlp
from rollplex.models.qwen_vl.model import QwenVL


def sparse_or_dense_mlp(args: TextArgs, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: the sparse MoE block where the experts' args make it sparse, else the dense SwiGLU
    of intermediate_size (as transformers' Qwen3VLMoeTextDecoderLayer chooses)."""
    return SparseMoE(args.hidden_size, args.moe, layer) if args.moe.is_sparse(layer) else dense_mlp(args, layer)


class Qwen3_VL_MoE(Qwen3_VL):
    """Qwen3-VL-MoE for causal LM: Qwen3-VL with `sparse_or_dense_mlp`'s MLPs in its decoder."""

    def __init__(self, args: ModelArgs):
        check_acts(args)
        # Qwen3_VL.__init__ would build the dense decoder; the rest of Qwen3_VL (the tower's embeddings and
        # DeepStack's additions) is this model's as it is.
        QwenVL.__init__(self, args, VisionTransformer(args.vision),
                        LanguageModel(args.text, qkv_bias=False, qk_norm=True,
                                      interleaved_mrope=args.text.mrope_interleaved, mlp=sparse_or_dense_mlp))
