"""What a Qwen3.5 decoder's layers mix tokens through: the backend object a packed
forward passes to every layer, as the other families pass an AttentionBackend.

Full-attention layers call it as an AttentionBackend (`backend(layer, q, k, v)`);
Gated DeltaNet layers call `short_convolution` and `gated_delta`. `PackedHybridAttention`
serves packed sequences that each start from nothing (the training and logprob
passes over whole sequences): attention within each sequence, and every
sequence's convolution and recurrence from a zero state, so no state crosses a
sequence boundary. The engine's decode and the kept-prefix passes will pass
objects with the same three calls that read and write each sequence's state slot.
"""

from __future__ import annotations

import torch

from rollplex.ops.attention import VarlenAttention
from rollplex.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule


class PackedHybridAttention:
    """Packed sequences of boundaries `cu_seqlens` (0, l0, l0 + l1, ...), each from a zero
    state. A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments of a module call."""

    def __init__(self, cu_seqlens: list[int], device: torch.device | str, backend: str = "torch"):
        self.attention = VarlenAttention(cu_seqlens, device, backend=backend)
        self.cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.long, device=device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.attention(layer, q, k, v)

    def short_convolution(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (T, channels) through the depthwise causal convolution `weight` (channels, kernel), then SiLU."""
        return causal_conv1d(x, weight, self.cu_seqlens)[0]

    def gated_delta(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> torch.Tensor:
        """The gated delta rule over each sequence (rollplex.ops.gated_delta.chunk_gated_delta_rule's shapes)."""
        return chunk_gated_delta_rule(q, k, v, g, beta, self.cu_seqlens)[0]
