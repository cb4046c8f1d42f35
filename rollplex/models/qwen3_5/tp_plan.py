"""Qwen3.5's tensor-parallel plan and FSDP units, applied by rollplex.train.parallelize
(the trainer) and rollplex.rl.weights (the engine's own TP mesh), as the other families'.

Qwen3-VL's plan (rollplex.models.qwen3_vl.tp_plan) covers all but the DeltaNet
layers' mixers: the vision tower (blocks and merger split when the TP size divides
their widths, else the whole tower replicated), the embedding and LM head
(vocab-parallel when untied), every layer's MLP (gate/up column-, down
row-parallel) and each full-attention layer's gated attention. Its q_proj is
[q | gate] per head, so a column split by heads keeps each head's gate with it;
k/v column-, o_proj row-parallel; q_norm and k_norm whole on every rank but
sequence-parallel over the heads, so that their gradient sums every rank's heads.

A Gated DeltaNet splits by key heads: each rank takes a contiguous share of the
key heads and the value heads they serve (key head i serves value heads
i*r .. (i+1)*r - 1, so contiguous shares of both line up). in_proj_q, _k, _v
(kept apart from the checkpoints' fused in_proj_qkv for this), _z, _b and _a are
column-parallel, each one's convolution weight (conv1d_q/k/v) and A_log and
dt_bias sharded by rows alike (Shard(0)), out_proj row-parallel. The gated norm
(one weight of value_head_dim shared by the heads) is treated as q_norm:
whole on every rank, its inputs sharded over the heads, its gradient summed.
The layer reads the local head counts off its weights, so its code is the same
whole or split.

Replicated over the TP group: every norm (the decoder layers' two, q_norm,
k_norm, the gated norm, the final norm; the tower's LayerNorms), the embedding
and head when tied, the tower's patch embedding, position grid and row-parallel
biases, and the whole tower when the TP size does not divide it. A TP size that does not divide the key heads, value heads,
attention heads, KV heads, MLP width or vocabulary is refused before any work
starts (`check_tp`). FSDP's units (vision blocks, decoder layers of both kinds)
and the vision tower are rollplex.models.qwen_vl.tp_plan's.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from rollplex.models.qwen3_5.args import LINEAR_ATTENTION
from rollplex.models.qwen3_vl import tp_plan as qwen3_vl_tp_plan
from rollplex.models.qwen_vl import tp_plan as qwen_vl_tp_plan
from rollplex.models.qwen_vl.tp_plan import repeated_blocks, vision_tower

__all__ = ["apply_tp", "check_tp", "repeated_blocks", "vision_tower"]

# The DeltaNet parameters sharded by rows with their heads, outside any Linear.
_HEAD_ROWS = ("conv1d_q", "conv1d_k", "conv1d_v", "A_log", "dt_bias")


def check_tp(args: Any, tp: int) -> None:
    """Raise before any work starts when the model cannot be split `tp` ways."""
    t = args.text
    for name, value in (("linear_num_key_heads", t.linear_num_key_heads),
                        ("linear_num_value_heads", t.linear_num_value_heads)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide the model's {name} ({value})")
    qwen_vl_tp_plan.check_tp(args, tp)  # attention heads, KV heads, MLP width, vocabulary


class HeadParallelNorm(ParallelStyle):
    """A norm over each head's last dimension whose inputs are all (tokens, local heads, dim):
    its weight whole on every rank (a Replicate DTensor), its inputs marked sharded over the
    heads, its output local again. The weight's gradient then sums every rank's heads, as
    SequenceParallel(sequence_dim=1) does for a norm of one input (q_norm); this one also takes
    the gated norm's gate."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        heads = (Shard(1),)
        return distribute_module(
            module, device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(DTensor.from_local(x, mesh, heads, run_check=False)
                                                     for x in inputs),
            output_fn=lambda mod, output, mesh: output.to_local())


def deltanet_plan() -> dict[str, ParallelStyle]:
    """A Gated DeltaNet's Linears and gated norm (see the module docstring)."""
    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in (
        "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a")}
    return {**plan, "out_proj": RowwiseParallel(), "norm": HeadParallelNorm()}


def shard_head_rows(deltanet: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a Gated DeltaNet's own per-head parameters (`_HEAD_ROWS`) by rows over `tp_mesh`,
    from rank 0's values as parallelize_module's styles do."""
    for name in _HEAD_ROWS:
        param = getattr(deltanet, name)
        sharded = distribute_tensor(param.detach(), tp_mesh, (Shard(0),), src_data_rank=0)
        deltanet.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` (a Qwen3_5) over `tp_mesh` in place (parameters become DTensors)."""
    check_tp(model.args, tp_mesh.size())
    qwen3_vl_tp_plan.apply_vision_tp(model, tp_mesh)
    attention_layer = qwen_vl_tp_plan.decoder_layer_plan(qk_norm=True)
    deltanet_layer = {**{f"linear_attn.{name}": style for name, style in deltanet_plan().items()},
                      **qwen_vl_tp_plan.swiglu_plan("mlp")}
    for layer in model.language_model.layers:
        if layer.kind == LINEAR_ATTENTION:
            parallelize_module(layer, tp_mesh, deltanet_layer)
            shard_head_rows(layer.linear_attn, tp_mesh)
        else:
            parallelize_module(layer, tp_mesh, attention_layer)
    qwen_vl_tp_plan.apply_embedding_tp(model, tp_mesh)
    return model
