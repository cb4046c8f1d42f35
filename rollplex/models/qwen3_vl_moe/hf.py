"""Qwen3-VL-MoE's Hugging Face side: config.json <-> `ModelArgs`, and checkpoint keys
<-> parameter names.

config.json is Qwen3-VL's (rollplex.models.qwen3_vl.hf reads, checks and writes all
of it but the experts) under model_type qwen3_vl_moe (its parts qwen3_vl_moe_text and
qwen3_vl_moe_vision), with the experts in text_config: num_experts (transformers 5
saves it as num_local_experts, its attribute's name), num_experts_per_tok,
moe_intermediate_size, norm_topk_prob, router_aux_loss_coef, decoder_sparse_step and
mlp_only_layers.

Keys are Qwen3-VL's, plus each sparse layer's router (`mlp.gate.weight`, a Linear's)
and its experts, one tensor per projection with the experts stacked
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Those come in two layouts:
- the hub's (the Qwen/Qwen3-VL-*-A*B checkpoints, from transformers 4.57, whose experts
  ran as batched matmuls): gate_up_proj (experts, hidden, 2 * inter), gate's columns
  first, and down_proj (experts, inter, hidden). It is the model's own layout
  (rollplex.models.moe.Experts) and the one saving writes;
- transformers 5's, which keeps each expert as a Linear weight (out, in) and saves it
  so: (experts, 2 * inter, hidden) and (experts, hidden, inter). Its loader transposes
  a tensor whose shape is not its own (Transpose(1, 2, check_dims=True)), so it loads both.
Loading here takes both too, by shape (`stacked_tensor`). Where the shape cannot tell
them apart (a square expert: hidden == 2 * inter for gate_up_proj, hidden == inter for
down_proj) the tensor is taken in the hub's layout, the one saving writes, so that
Rollplex's own checkpoints load back right; transformers takes such a tensor in its own
layout, so a checkpoint of that shape does not mean the same to both. The hub's models
are not square (2048 wide with experts of 768, 4096 with 1536).
"""

from __future__ import annotations

import functools

import torch

from rollplex.models.family import StackedTensor
from rollplex.models.moe import MoEArgs
from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen3_vl import hf as dense
from rollplex.models.qwen3_vl.hf import hf_key_to_params, param_to_hf_key
from rollplex.models.qwen3_vl_moe.args import ModelArgs, with_experts
from rollplex.models.qwen_vl.hf import pick_fields

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf_config", "hf_config_from_args", "hf_key_to_params",
           "moe_args", "moe_config", "param_to_hf_key", "stacked_tensor"]

MODEL_TYPE = "qwen3_vl_moe"
ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
# Parameter name endings of a sparse layer's stacked experts (held as `StackedTensor`s).
_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")

# ----------------------------------------------------------------------------- config


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a Qwen3-VL-MoE config.json dict (a CheckpointError naming `source` otherwise)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    # All but the experts is a Qwen3-VL config.json: read and checked as one (which also checks text_config is there).
    args = dense.args_from_hf_config({**cfg, "model_type": dense.MODEL_TYPE}, source)
    return with_experts(args, moe_args(cfg["text_config"], source))


def moe_args(text: dict, source: str = "config.json") -> MoEArgs:
    """The experts of a config.json's text_config (a CheckpointError naming `source` where they are not
    what transformers' Qwen3VLMoeForConditionalGeneration runs)."""
    experts = text.get("num_experts", text.get("num_local_experts", MoEArgs.num_experts))
    try:
        moe = pick_fields(text, MoEArgs, num_experts=int(experts),
                          mlp_only_layers=[int(i) for i in text.get("mlp_only_layers") or []],
                          norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                          # Qwen3-VL-MoE has no shared expert, whatever a config says (transformers builds none).
                          shared_expert_intermediate_size=0)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: text_config: {e}") from e
    problems = []
    if not moe.norm_topk_prob:
        problems.append("norm_topk_prob false is not supported: Qwen3-VL-MoE's router always renormalises its "
                        "top-k probabilities (transformers' ignores the flag)")
    if not 1 <= moe.num_experts_per_tok <= moe.num_experts:
        problems.append(f"num_experts_per_tok {moe.num_experts_per_tok} must be between 1 and num_experts "
                        f"{moe.num_experts}")
    if moe.decoder_sparse_step < 1:
        problems.append(f"decoder_sparse_step {moe.decoder_sparse_step} must be at least 1")
    if problems:
        raise CheckpointError(f"{source}: text_config: " + "; ".join(problems))
    return moe


def hf_config_from_args(args: ModelArgs) -> dict:
    """config.json as the hub's Qwen3-VL-MoE checkpoints have it, which transformers'
    Qwen3VLMoeForConditionalGeneration loads: Qwen3-VL's (its writer reads only what both
    families' args have), made Qwen3-VL-MoE's (`moe_config`)."""
    return moe_config(dense.hf_config_from_args(args), args.text.moe)


def moe_config(config: dict, moe: MoEArgs) -> dict:
    """A Qwen3-VL config.json `config` made Qwen3-VL-MoE's, with `moe`'s experts (in place; returned)."""
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE)
    config["text_config"].update(model_type="qwen3_vl_moe_text", num_experts=moe.num_experts,
                                 num_experts_per_tok=moe.num_experts_per_tok,
                                 moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                                 router_aux_loss_coef=moe.router_aux_loss_coef,
                                 decoder_sparse_step=moe.decoder_sparse_step,
                                 mlp_only_layers=list(moe.mlp_only_layers))
    config["vision_config"]["model_type"] = "qwen3_vl_moe_vision"
    return config


# ----------------------------------------------------------------------------- weight keys


def stacked_tensor(name: str, args: ModelArgs) -> StackedTensor | None:
    """How a checkpoint holds parameter `name` when not as rows of one key: a sparse layer's
    experts, one key each, in the hub's layout or transformers 5's (see the module docstring)."""
    if not name.endswith(_EXPERTS):
        return None
    key = param_to_hf_key(name)
    return StackedTensor(keys=(key,), load=functools.partial(_load_experts, key), save=lambda tensor: [tensor])


def _load_experts(key: str, tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The experts' tensor of checkpoint key `key` in the model's layout (`shape`), from either layout;
    a square expert's is taken as the hub's."""
    (tensor,) = tensors
    if tuple(tensor.shape) == shape:
        return tensor
    if tensor.ndim == 3 and tuple(tensor.transpose(1, 2).shape) == shape:
        return tensor.transpose(1, 2).contiguous()
    transformers_shape = (shape[0], shape[2], shape[1])
    raise CheckpointError(f"tensor {key} has shape {tuple(tensor.shape)}; the model expects {shape} (the hub's "
                          f"layout) or {transformers_shape} (transformers 5's), from config.json")
