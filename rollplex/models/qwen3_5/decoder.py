"""Qwen3.5's hybrid text decoder, in plain PyTorch.

Each layer is pre-norm: a token mixer, then the MLP, each added to the
residual. The MLP is the dense family's SwiGLU unless the decoder is given
another factory (rollplex.models.qwen_vl.layers.MlpFactory), as Qwen3.5-MoE
gives its sparse MoE block (rollplex.models.moe.SparseMoE, called with the
forward's `Routing`). The mixer follows `layer_types`: a Gated DeltaNet
(rollplex.models.qwen3_5.deltanet) in "linear_attention" layers,
`GatedAttention` in "full_attention" ones. Every RMSNorm of the decoder (the
layers' two, the final one, q_norm and k_norm) is zero-centred: x * (1 + w),
computed in float32, so a checkpoint's weights start at 0 (the DeltaNet's gated
norm is not: weight * x).

`GatedAttention` is Qwen3's attention (per-head q/k RMSNorm, GQA, no biases)
with two changes: q_proj is twice as wide, [q | gate] per head, and the
attention output is multiplied by sigmoid(gate) before o_proj; and only the
first head_dim * partial_rotary_factor dims of q and k rotate, by interleaved
M-RoPE over that rotary width.

The embedding, the layer-by-layer forward and the final norm are
rollplex.models.qwen_vl.layers.Decoder's. Module names are the checkpoints'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from rollplex.models.moe import SparseMoE, routing_of
from rollplex.models.qwen3_5.args import FULL_ATTENTION, LINEAR_ATTENTION, TextArgs
from rollplex.models.qwen3_5.deltanet import GatedDeltaNet
from rollplex.models.qwen_vl.layers import Decoder, MlpFactory, dense_mlp
from rollplex.models.rope import MRotaryEmbedding, apply_partial_rotary


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back to x's dtype (transformers'
    Qwen3_5RMSNorm). The weight starts at 0: the identity scale."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """A "full_attention" layer's mixer (see the module docstring). Head counts are read
    off the weights (`view(T, -1, head_dim)`), as in the other families."""

    def __init__(self, args: TextArgs, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, 2 * q, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(q, args.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: Any) -> torch.Tensor:
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), cos, sin)
        k = apply_partial_rotary(self.k_norm(self.k_proj(x).view(T, -1, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        out = attn(self.layer, q, k, v) * torch.sigmoid(gate)
        return self.o_proj(out.reshape(T, -1))


class HybridDecoderLayer(nn.Module):
    """Pre-norm layer whose mixer is `linear_attn` (a Gated DeltaNet) or `self_attn` (GatedAttention),
    and whose MLP `mlp` makes (dense: a SwiGLU)."""

    def __init__(self, args: TextArgs, layer: int, mlp: MlpFactory = dense_mlp):
        super().__init__()
        self.kind = args.layer_types[layer]
        if self.kind == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(args, layer)
        elif self.kind == FULL_ATTENTION:
            self.self_attn = GatedAttention(args, layer)
        else:
            raise ValueError(f"layer {layer}: layer type {self.kind!r} is neither {LINEAR_ATTENTION!r} nor "
                             f"{FULL_ATTENTION!r}")
        self.mlp = mlp(args, layer)
        # A sparse MLP routes by the forward's Routing, which the backend carries (rollplex.models.moe.routing_of),
        # so that an activation-checkpoint recompute, given the same backend, routes as its forward did.
        self.routed = isinstance(self.mlp, SparseMoE)
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mixing: Any) -> torch.Tensor:
        """`mixing`: the backend of rollplex.models.qwen3_5.mixing (attention and recurrent state)."""
        h = self.input_layernorm(x)
        if self.kind == LINEAR_ATTENTION:
            x = x + self.linear_attn(h, mixing)
        else:
            x = x + self.self_attn(h, cos, sin, mixing)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, routing_of(mixing)) if self.routed else self.mlp(h))


class HybridDecoder(Decoder):
    """The decoder: `HybridDecoderLayer`s by `layer_types`, each with the MLP `mlp` makes, a
    zero-centred final norm and interleaved M-RoPE over the rotary width."""

    def __init__(self, args: TextArgs, mlp: MlpFactory = dense_mlp):
        if len(args.layer_types) != args.num_hidden_layers:
            raise ValueError(f"layer_types has {len(args.layer_types)} entries for {args.num_hidden_layers} layers")
        super().__init__(args, (HybridDecoderLayer(args, i, mlp) for i in range(args.num_hidden_layers)),
                         ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps),
                         MRotaryEmbedding(args.rotary_dim, args.rope_theta, args.mrope_section, interleaved=True))

    def first_attention_layer(self) -> GatedAttention:
        """The first full-attention layer's mixer (every one has the same K/V heads)."""
        return next(layer.self_attn for layer in self.layers if layer.kind == FULL_ATTENTION)
