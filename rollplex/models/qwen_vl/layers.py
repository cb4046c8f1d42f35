"""The building blocks both Qwen VL families' models are made of (rollplex.models.qwen_vl).

Vision: `PatchEmbed` (with a bias in Qwen3-VL only), `VisionAttention` (q, k and
v kept as three Linears for tensor parallelism, 2D rotary in float32) and
`VisionBlock`, the pre-norm block whose norms and MLP each family picks
(Qwen2.5-VL: RMSNorm and a biased SwiGLU; Qwen3-VL: LayerNorm and a GELU(tanh)
MLP). Text: the Qwen2 / Qwen3 decoder, `LanguageModel`, which takes the two
families' differences as arguments: Qwen2's biased q/k/v (`qkv_bias`), Qwen3's
per-head q and k RMSNorm (`qk_norm`), interleaved M-RoPE, what a family adds
to the hidden states inside the decoder (Qwen3-VL's DeepStack: `after_layer`), and
each layer's MLP (`mlp`: the dense SwiGLU, or Qwen3-VL-MoE's sparse MoE block).
`Decoder`, its base, is what every Qwen decoder shares (embedding, the forward
layer by layer, the final norm, M-RoPE); Qwen3.5's hybrid decoder is another.
The vision towers themselves, their mergers and plans, are each family's own.

Attention goes through the backend the caller passes in (rollplex.ops.attention),
and head counts are read off the weight shapes (`view(T, -1, head_dim)`), so a
TP-sharded module runs unchanged. Module names are the checkpoints'.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.models.moe import SparseMoE, routing_of
from rollplex.models.protocol import Positions
from rollplex.models.rope import MRotaryEmbedding, apply_rotary
from rollplex.ops.attention import AttentionBackend, PackedSegments

# (decoder layer index, hidden state after that layer) -> the hidden state the next layer reads.
AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]
# (text args, decoder layer index) -> that layer's MLP: `dense_mlp`, or a family's sparse MoE block.
MlpFactory = Callable[[Any, int], nn.Module]


def boundaries(lengths: list[int]) -> list[int]:
    """Segment lengths -> their boundaries 0, l0, l0 + l1, ... (cu_seqlens, as PackedSegments takes them)."""
    return [0, *itertools.accumulate(lengths)]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Qwen2 and Qwen3 do)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the decoders' MLP, and (with biases) Qwen2.5-VL's vision MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def dense_mlp(args: Any, layer: int) -> SwiGLU:
    """The dense decoders' MLP (`args`: a family's TextArgs): one SwiGLU of intermediate_size, in every layer."""
    return SwiGLU(args.hidden_size, args.intermediate_size)


class TorchLayerOps:
    """A decoder layer's norms, activation and residual adds as torch ops: the training
    forward's arithmetic, op for op. The engine's model calls may hand the layer fused
    kernels with the same signatures instead (rollplex.ops.fused_decode_triton, through
    the attention backend's `layer_ops`): one layer forward serves both."""

    def rms_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(residual + x), and residual + x."""
        total = residual + x
        return norm(total), total

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def add_linear(self, residual: torch.Tensor, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return residual + linear(x)


TORCH_OPS = TorchLayerOps()


def layer_ops(attn: AttentionBackend) -> TorchLayerOps:
    """The ops a layer runs with `attn`: the backend's own (`layer_ops`, the engine's
    fused kernels) where it has them, else the torch ops."""
    return getattr(attn, "layer_ops", None) or TORCH_OPS


# ----------------------------------------------------------------------------- vision


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over (temporal, patch, patch) blocks, with a bias or
    not (`args`: a family's VisionArgs). The processor already cut pixels into
    flattened blocks, so the convolution is a matmul with the flattened kernel (same
    weights, same math, no conv call)."""

    def __init__(self, args: Any, bias: bool):
        super().__init__()
        k = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    """Attention within each segment the tower's plan gives (windows, images, frames).
    The hub checkpoints fuse q, k and v into one `qkv` Linear; here they are three, so
    that tensor parallelism can split each by heads (the loader splits and re-fuses)."""

    def __init__(self, args: Any):
        super().__init__()
        self.head_dim = args.hidden_size // args.num_heads
        self.q = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.k = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.v = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PackedSegments) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (proj(x).view(T, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        # Vision rotary is applied in float32 (as the reference does), then cast back.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        return self.proj(attn(q, k, v).reshape(T, -1))


class VisionBlock(nn.Module):
    """A pre-norm vision block: norm1 then attention, norm2 then the MLP, each added to
    the residual. `norm(width)` builds the family's norms, `mlp(args)` its MLP."""

    def __init__(self, args: Any, norm: Callable[[int], nn.Module], mlp: Callable[[Any], nn.Module]):
        super().__init__()
        self.norm1 = norm(args.hidden_size)
        self.norm2 = norm(args.hidden_size)
        self.attn = VisionAttention(args)
        self.mlp = mlp(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PackedSegments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attn)
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------- language model


class Attention(nn.Module):
    """A decoder layer's attention (`args`: a family's TextArgs), o_proj without a bias.
    Qwen2's q/k/v have biases (`qkv_bias`); Qwen3 RMS-normalises q and k per head
    before the rotary (`qk_norm`), over head_dim with one weight for every head, so a
    TP shard of heads runs them unchanged (the TP plan sums their gradient over the shards)."""

    def __init__(self, args: Any, layer: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer, self.head_dim, self.qk_norm = layer, args.head_dim, qk_norm
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * args.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, args.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        # The engine's backend norms and rotates q and k itself (with the KV write, in one kernel
        # when fused); the training backends take them rotated.
        rotary_attention = getattr(attn, "rotary_attention", None)
        if rotary_attention is not None:
            qk_norm = (self.q_norm, self.k_norm) if self.qk_norm else None
            return self.o_proj(rotary_attention(self.layer, q, k, v, cos, sin, qk_norm).reshape(T, -1))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attn(self.layer, q, k, v).reshape(T, -1))


class DecoderLayer(nn.Module):
    """Pre-norm: attention, then the MLP `mlp` makes for this layer (`dense_mlp`: a SwiGLU)."""

    def __init__(self, args: Any, layer: int, qkv_bias: bool, qk_norm: bool, mlp: MlpFactory = dense_mlp):
        super().__init__()
        self.self_attn = Attention(args, layer, qkv_bias, qk_norm)
        self.mlp = mlp(args, layer)
        # A sparse MLP routes by the forward's Routing, which the backend carries (rollplex.models.moe.routing_of),
        # so that an activation-checkpoint recompute, given the same backend, routes as its forward did.
        self.routed = isinstance(self.mlp, SparseMoE)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """x + attention, then + the MLP, with the ops of `attn` (`layer_ops`): the residual
        add after attention goes with the second norm, the one after a SwiGLU with down_proj
        (a GEMM accumulating into the residual, when fused), so a layer's output is its
        hidden state, as hooks and the layer-by-layer forward read it. A sparse MLP's experts
        have no such fused kernel: its output is added as it is."""
        ops = layer_ops(attn)
        h = self.self_attn(ops.rms_norm(x, self.input_layernorm), cos, sin, attn)
        h, x = ops.add_rms_norm(h, x, self.post_attention_layernorm)
        if self.routed:
            return x + self.mlp(h, routing_of(attn))
        mlp = self.mlp
        return ops.add_linear(x, ops.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)), mlp.down_proj)


class Decoder(nn.Module):
    """A Qwen text decoder: token embedding, `layers` (each called as layer(h, cos, sin, attn)),
    the final `norm` and the M-RoPE tables `rotary`; its forward, whole or layer by layer.
    What the layers and norms are is the subclass's (`LanguageModel`; Qwen3.5's hybrid decoder)."""

    def __init__(self, args: Any, layers: Iterable[nn.Module], norm: nn.Module, rotary: MRotaryEmbedding):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = rotary

    def forward(self, h: torch.Tensor, position_ids: Positions, attn: AttentionBackend,
                after_layer: AfterLayer | None = None) -> torch.Tensor:
        for h in self.layer_by_layer(h, position_ids, attn, after_layer):
            pass
        return h

    def layer_by_layer(self, h: torch.Tensor, position_ids: Positions, attn: AttentionBackend,
                       after_layer: AfterLayer | None = None) -> Iterator[torch.Tensor]:
        """The forward one decoder layer at a time: yields the hidden state after each
        layer (`after_layer` applied, when given), then the final normed state. The
        prompt-work scheduler (rollplex.rl.prompt_work) advances it between two decode steps of
        the engine. position_ids (3, T), or the rotary cos, sin (T, head_dim) they
        give, read off `rotary.text_table` by the engine's decode steps."""
        cos, sin = position_ids if isinstance(position_ids, tuple) else self.rotary(position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn)
            if after_layer is not None:
                h = after_layer(i, h)
            yield h
        yield self.norm(h)


class LanguageModel(Decoder):
    """The Qwen2 / Qwen3 decoder: `DecoderLayer`s (their attention as `Attention` takes
    `qkv_bias` and `qk_norm`, their MLPs as `mlp` makes them), RMSNorm and M-RoPE
    (interleaved or not)."""

    def __init__(self, args: Any, qkv_bias: bool, qk_norm: bool, interleaved_mrope: bool = False,
                 mlp: MlpFactory = dense_mlp):
        super().__init__(args, (DecoderLayer(args, i, qkv_bias, qk_norm, mlp) for i in range(args.num_hidden_layers)),
                         RMSNorm(args.hidden_size, args.rms_norm_eps),
                         MRotaryEmbedding(args.head_dim, args.rope_theta, args.mrope_section,
                                          interleaved=interleaved_mrope))
