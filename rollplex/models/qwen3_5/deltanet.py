"""Qwen3.5's Gated DeltaNet layer (its "linear_attention" layers), in plain PyTorch.

Per token: the q, k and v projections (one `in_proj_qkv` in the checkpoints),
then a depthwise causal convolution over the sequence (kernel
linear_conv_kernel_dim, no bias, SiLU) of their channels side by side, split
back into q, k (linear_num_key_heads heads) and v (linear_num_value_heads heads);
q and k L2-normalised in fp32. Per value head, beta = sigmoid(in_proj_b) is the
write strength and g = -exp(A_log) * softplus(in_proj_a + dt_bias), computed in
fp32, the log decay of the recurrent state; the gated delta rule
(rollplex.ops.gated_delta) gives each value head's output, which `GatedRMSNorm`
normalises and gates with silu(in_proj_z) before out_proj. A key head serves a
group of consecutive value heads.

The checkpoints fuse q, k and v (rows [q | k | v] of `in_proj_qkv`, channels of
`conv1d` in the same order); the layer keeps each projection, and each one's
convolution weight, as a parameter of its own (rollplex.models.qwen3_5.hf maps
the fused tensors to them in row order), so that tensor parallelism can split
each by heads: a rank's share of all six is then its key heads with the value
heads they serve (rollplex.models.qwen3_5.tp_plan). The layer reads every size
off its local weights, so the same code runs whole or split.

The convolution and the recurrence carry state along a sequence, so they go
through the backend the caller passes in (rollplex.models.qwen3_5.mixing), which
knows where each sequence starts and, in decode, where its state is kept.
Parameter names are the checkpoints' (`linear_attn.*`) but for the split ones:
`in_proj_q/k/v.weight` (the checkpoints' `in_proj_qkv.weight`) and
`conv1d_q/k/v` (their `conv1d.weight`).
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


def _depthwise_conv_weight(channels: int, kernel: int) -> nn.Parameter:
    """A depthwise convolution's weight, (channels, 1, kernel) as the checkpoints store conv1d.weight,
    drawn as nn.Conv1d draws its own: U(-1/sqrt(kernel), 1/sqrt(kernel))."""
    bound = kernel**-0.5
    return nn.Parameter(torch.empty(channels, 1, kernel).uniform_(-bound, bound))


class GatedDeltaNet(nn.Module):
    """A decoder layer's token mixer in "linear_attention" layers (`args`: Qwen3.5's TextArgs)."""

    def __init__(self, args: Any, layer: int):
        super().__init__()
        self.layer = layer
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        heads, hidden, kernel = args.linear_num_value_heads, args.hidden_size, args.linear_conv_kernel_dim
        key_dim, value_dim = args.linear_key_dim, args.linear_value_dim
        self.in_proj_q = nn.Linear(hidden, key_dim, bias=False)
        self.in_proj_k = nn.Linear(hidden, key_dim, bias=False)
        self.in_proj_v = nn.Linear(hidden, value_dim, bias=False)
        self.conv1d_q = _depthwise_conv_weight(key_dim, kernel)
        self.conv1d_k = _depthwise_conv_weight(key_dim, kernel)
        self.conv1d_v = _depthwise_conv_weight(value_dim, kernel)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.norm = GatedRMSNorm(self.value_head_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, hidden, bias=False)

    def conv_weight(self) -> torch.Tensor:
        """The convolution's weight over this rank's channels, (channels, kernel): q's, then
        k's, then v's, the order of the projections' outputs side by side."""
        return torch.cat([local_tensor(w) for w in self._conv_weights()]).squeeze(1)

    def _conv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q's, k's and v's convolution weights, in the checkpoints' row order."""
        return self.conv1d_q, self.conv1d_k, self.conv1d_v

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One sequence's state on this rank, read off the local weights (a share of the heads
        under tensor parallelism): the convolution's (channels, kernel - 1) and the
        recurrence's (value heads, key head dim, value head dim)."""
        channels = sum(local_tensor(w).shape[0] for w in self._conv_weights())
        kernel = self.conv1d_q.shape[-1]
        value_heads = local_tensor(self.A_log).shape[0]
        return (channels, kernel - 1), (value_heads, self.key_head_dim, self.value_head_dim)

    def forward(self, x: torch.Tensor, mixing: Any) -> torch.Tensor:
        """x (T, hidden) of packed tokens; `mixing` runs the convolution and the recurrence
        along each sequence (`short_convolution`, `gated_delta`)."""
        T = x.shape[0]
        qkv = [self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)]
        mixed = mixing.short_convolution(self.layer, torch.cat(qkv, dim=-1), self.conv_weight())
        q, k, v = mixed.split([part.shape[-1] for part in qkv], dim=-1)
        q = l2norm(q.reshape(T, -1, self.key_head_dim))
        k = l2norm(k.reshape(T, -1, self.key_head_dim))
        v = v.reshape(T, -1, self.value_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        # The local value heads' A_log and dt_bias (tensor parallelism shards both by value head, as in_proj_a's
        # output). In float32: in bf16, exp(A_log) and the softplus lose the small decays that matter over long
        # sequences.
        a_log, dt_bias = local_tensor(self.A_log).float(), local_tensor(self.dt_bias).float()
        g = -a_log.exp() * F.softplus(self.in_proj_a(x).float() + dt_bias)
        out = mixing.gated_delta(self.layer, q, k, v, g, beta)  # (T, value heads, value_head_dim)
        z = self.in_proj_z(x).view(T, -1, self.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(T, -1))
