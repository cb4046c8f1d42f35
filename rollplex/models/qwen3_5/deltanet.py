"""Qwen3.5's Gated DeltaNet layer (its "linear_attention" layers), in plain PyTorch.

Per token: in_proj_qkv, then a depthwise causal convolution over the sequence
(kernel linear_conv_kernel_dim, no bias, SiLU), split into q, k (linear_num_key_heads
heads) and v (linear_num_value_heads heads); q and k L2-normalised in fp32. Per
value head, beta = sigmoid(in_proj_b) is the write strength and
g = -exp(A_log) * softplus(in_proj_a + dt_bias), computed in fp32, the log decay of
the recurrent state; the gated delta rule (rollplex.ops.gated_delta) gives each
value head's output, which `GatedRMSNorm` normalises and gates with silu(in_proj_z)
before out_proj. A key head serves a group of consecutive value heads.

The convolution and the recurrence carry state along a sequence, so they go
through the backend the caller passes in (rollplex.models.qwen3_5.mixing), which
knows where each sequence starts and, in decode, where its state is kept.
Module and parameter names are the checkpoints' (`linear_attn.*`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.dist import local_tensor
from rollplex.models.qwen_vl.layers import RMSNorm
from rollplex.ops.gated_delta import l2norm


class GatedRMSNorm(RMSNorm):
    """RMSNorm of each value head's output (weight * x, the weight starting at 1, not
    zero-centred as the decoder's norms are), times silu(gate) in float32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """A decoder layer's token mixer in "linear_attention" layers (`args`: Qwen3.5's TextArgs)."""

    def __init__(self, args: Any, layer: int):
        super().__init__()
        self.layer = layer
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = args.linear_key_dim, args.linear_value_dim
        heads = args.linear_num_value_heads
        self.in_proj_qkv = nn.Linear(args.hidden_size, args.linear_conv_dim, bias=False)
        self.in_proj_z = nn.Linear(args.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.hidden_size, heads, bias=False)
        self.in_proj_a = nn.Linear(args.hidden_size, heads, bias=False)
        # Depthwise: weight (channels, 1, kernel), as checkpoints store it; the backend's op runs it.
        self.conv1d = nn.Conv1d(args.linear_conv_dim, args.linear_conv_dim, args.linear_conv_kernel_dim,
                                groups=args.linear_conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state on this rank, read off the local weights (a share of the heads
        under tensor parallelism): the convolution's (channels, kernel - 1) and the
        recurrence's (value heads, key head dim, value head dim)."""
        channels, _, kernel = local_tensor(self.conv1d.weight).shape
        value_heads = local_tensor(self.A_log).shape[0]
        return (channels, kernel - 1), (value_heads, self.key_head_dim, self.value_head_dim)

    def forward(self, x: torch.Tensor, mixing: Any) -> torch.Tensor:
        """x (T, hidden) of packed tokens; `mixing` runs the convolution and the recurrence
        along each sequence (`short_convolution`, `gated_delta`)."""
        T = x.shape[0]
        qkv = mixing.short_convolution(self.layer, self.in_proj_qkv(x), self.conv1d.weight.squeeze(1))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(T, -1, self.key_head_dim))
        k = l2norm(k.reshape(T, -1, self.key_head_dim))
        v = v.reshape(T, -1, self.value_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        # In float32: in bf16, exp(A_log) and the softplus lose the small decays that matter over long sequences.
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        out = mixing.gated_delta(self.layer, q, k, v, g, beta)  # (T, value heads, value_head_dim)
        z = self.in_proj_z(x).view(T, -1, self.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(T, -1))
