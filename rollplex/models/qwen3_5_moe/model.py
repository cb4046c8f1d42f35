"""Qwen3.5-MoE in plain PyTorch: rollplex.models.qwen3_5's model (Qwen3-VL's tower
without DeepStack, the hybrid Gated DeltaNet / gated attention decoder, its packed,
shared-prefix, engine and kept-prefix passes), each decoder layer's MLP a sparse MoE
block with a shared expert (rollplex.models.moe.SparseMoE), which routes by the
forward's `Routing` when its backend carries one (rollplex.models.moe.with_routing).
"""

from __future__ import annotations

from rollplex.models.moe import SparseMoE
from rollplex.models.qwen3_5.model import Qwen3_5
from rollplex.models.qwen3_5_moe.args import ModelArgs, TextArgs


def sparse_moe(args: TextArgs, layer: int) -> SparseMoE:
    """A decoder layer's MLP (rollplex.models.qwen3_5.decoder.MlpFactory): every layer is sparse."""
    return SparseMoE(args.hidden_size, args.moe, layer)


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5-MoE for causal LM (see the module docstring)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, sparse_moe)
