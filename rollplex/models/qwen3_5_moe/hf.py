"""Qwen3.5-MoE's Hugging Face side: config.json <-> `ModelArgs`, and checkpoint keys <->
parameter names.

config.json is Qwen3.5's (rollplex.models.qwen3_5.hf) with the model types
qwen3_5_moe / qwen3_5_moe_text / qwen3_5_moe_vision and, in the text config, the
experts' shape in place of the dense MLP's width (`_MOE_FIELDS`).

Keys are Qwen3.5's, the MoE block's one to one (`mlp.gate.weight`, the router;
`mlp.shared_expert.{gate,up,down}_proj.weight`; `mlp.shared_expert_gate.weight`),
but for the experts: the hub's checkpoints and transformers' save_pretrained store
one key per expert and projection,
`model.language_model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight` (inter,
hidden) and `...{e}.down_proj.weight` (hidden, inter), where the model holds them
stacked as its grouped GEMM reads them (rollplex.models.moe.Experts):
`mlp.experts.gate_up_proj` (experts, hidden, 2 * inter), gate's columns first, and
`mlp.experts.down_proj` (experts, inter, hidden): each expert's weights transposed.
`stacked_tensor` says so to the family-generic loader, which stacks at load and
splits at save (rollplex.models.family.StackedTensor).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from rollplex.models.family import StackedTensor
from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen3_5 import hf as qwen3_5_hf
from rollplex.models.qwen3_5.hf import DROPPED_KEYS, hf_key_to_params, init_constant, init_draw, param_to_hf_key
from rollplex.models.qwen3_5_moe.args import ModelArgs, TextArgs, default_moe
from rollplex.models.qwen3_vl.hf import vision_args_from_config
from rollplex.models.qwen_vl.hf import nested_model_args

__all__ = ["ARCHITECTURE", "DROPPED_KEYS", "MODEL_TYPE", "args_from_hf_config", "check_args", "hf_config_from_args",
           "hf_key_to_params", "init_constant", "init_draw", "param_to_hf_key", "stacked_tensor"]

MODEL_TYPE = "qwen3_5_moe"
ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
# The text config's MoE fields (rollplex.models.moe.MoEArgs' names). transformers' Qwen3.5-MoE routes every layer
# and renormalises the top-k weights whatever a config.json says of decoder_sparse_step, mlp_only_layers or
# norm_topk_prob, so those are neither read nor written.
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "router_aux_loss_coef")
_GATE_UP, _DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a Qwen3.5-MoE config.json dict (a CheckpointError naming `source` otherwise)."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{source}: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r}")
    args = nested_model_args(cfg, source, "Qwen3.5-MoE", lambda text, vision, **shared: ModelArgs(
        vision=vision_args_from_config(vision, deepstack=False), text=_text_args(text, source), **shared))
    check_args(args, source)
    return args


def _text_args(text: dict, source: str) -> TextArgs:
    """Qwen3.5's text fields and the MoE ones; an intermediate_size there is no layer's and is left out
    (TextArgs derives its own)."""
    moe = replace(default_moe(), **{k: text[k] for k in _MOE_FIELDS if k in text})
    dense = {k: v for k, v in text.items() if k != "intermediate_size"}
    return qwen3_5_hf.text_args(dense, source, TextArgs, moe=moe)


def check_args(args: ModelArgs, source: str = "config.json") -> None:
    """Qwen3.5's checks (rollplex.models.qwen3_5.hf.check_args), then the experts' (a CheckpointError)."""
    qwen3_5_hf.check_args(args, source)
    m = args.text.moe
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        raise CheckpointError(f"{source}: num_experts_per_tok {m.num_experts_per_tok} must be between 1 and "
                              f"num_experts ({m.num_experts})")
    if m.moe_intermediate_size <= 0 or m.shared_expert_intermediate_size < 0:
        raise CheckpointError(f"{source}: moe_intermediate_size ({m.moe_intermediate_size}) must be positive and "
                              f"shared_expert_intermediate_size ({m.shared_expert_intermediate_size}) not negative")


def hf_config_from_args(args: ModelArgs) -> dict[str, Any]:
    """config.json in the nested style, which transformers' Qwen3_5MoeForConditionalGeneration loads."""
    config = qwen3_5_hf.hf_config_from_args(args, ARCHITECTURE, MODEL_TYPE)
    text = config["text_config"]
    del text["intermediate_size"]  # derived here (TextArgs), and no field of transformers' config
    text.update({name: getattr(args.text.moe, name) for name in _MOE_FIELDS})
    return config


def stacked_tensor(name: str, args: ModelArgs) -> StackedTensor | None:
    """How the checkpoint holds parameter `name` when not as rows of one key: an MoE layer's
    stacked experts, as one key per expert and projection (see the module docstring)."""
    if not name.endswith((_GATE_UP, _DOWN)):
        return None
    experts = param_to_hf_key(name).rpartition(".")[0]  # model.language_model.layers.{i}.mlp.experts
    count = args.text.moe.num_experts
    if name.endswith(_GATE_UP):
        keys = tuple(f"{experts}.{e}.{proj}.weight" for e in range(count) for proj in ("gate_proj", "up_proj"))
        return StackedTensor(keys, _load_gate_up, _save_gate_up)
    return StackedTensor(tuple(f"{experts}.{e}.down_proj.weight" for e in range(count)), _load_down, _save_down)


def _check_shapes(tensors: list[torch.Tensor], each: tuple[int, int], what: str) -> None:
    for tensor in tensors:
        if tuple(tensor.shape) != each:
            raise CheckpointError(f"an expert's {what} has shape {tuple(tensor.shape)}, the model expects {each} "
                                  "(from config.json)")


def _load_gate_up(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """[gate_proj, up_proj] of each expert in turn, (inter, hidden) each -> (experts, hidden, 2 * inter)."""
    _, hidden, width = shape
    _check_shapes(tensors, (width // 2, hidden), "gate_proj or up_proj weight")
    return torch.stack([torch.cat(pair).T for pair in zip(tensors[0::2], tensors[1::2])])


def _save_gate_up(param: torch.Tensor) -> list[torch.Tensor]:
    return [part for expert in param for part in expert.T.contiguous().chunk(2)]


def _load_down(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """down_proj of each expert, (hidden, inter) each -> (experts, inter, hidden)."""
    _, inter, hidden = shape
    _check_shapes(tensors, (hidden, inter), "down_proj weight")
    return torch.stack([tensor.T for tensor in tensors])


def _save_down(param: torch.Tensor) -> list[torch.Tensor]:
    return [expert.T.contiguous() for expert in param]
