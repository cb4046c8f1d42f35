"""Low-rank adapters (LoRA) on a frozen base, trained and read where they live.

    y = x W^T + b + (alpha / r) * dropout(x) A^T B^T

(Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3;
the alpha / r scaling and the initialisation, A Kaiming-uniform and B zero, are
PEFT's, so the first step's model is the base model.) A is (r, in), B (out, r).

`apply_lora` turns each selected nn.Linear into a `LoRALinear` in place: the
module object, its weight and bias and any hooks on it (a tensor-parallel
plan's) stay, and two parameters, `lora_A` and `lora_B`, join them. It runs after
tensor parallelism, so each adapter is laid out to match the layer it wraps: a
column-parallel layer (weight Shard(0)) has A whole and B split by output rows,
a row-parallel one (weight Shard(1)) A split by input columns and B whole; the
adapter's partial product then adds into the layer's own partial output, reduced
by the same all-reduce. `freeze_base` then keeps every other parameter in the
compute dtype only, without gradients: the trainer needs no fp32 master copy,
gradients or AdamW moments for it (rollplex.train.parallelize leaves it out of
FSDP, so it is never gathered and the engine reads it in place).

The engine's model gets the same adapters (`mirror_adapters`, on its meta
skeleton, by rollplex.rl.weights) and so runs the same arithmetic as the trainer's forward:
the base is never merged, so no bf16 rounding of W + BA drifts between the two.
"""

from __future__ import annotations

import math
import re
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from rollplex.config.sections import LoRAConfig
from rollplex.models.moe import SparseMoE
from rollplex.models.registry import family_of

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter beside its (frozen) weight; see the module docstring."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    scaling: float
    lora_dropout: float

    @classmethod
    def adapt(cls, linear: nn.Linear, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
              dropout: float) -> "LoRALinear":
        """`linear`, in place, as a LoRALinear with these adapter tensors. The object is kept,
        not replaced: its parameters, its name in the model and the hooks parallelism put on it stay."""
        linear.__class__ = cls
        linear.lora_A = nn.Parameter(lora_A)
        linear.lora_B = nn.Parameter(lora_B)
        linear.scaling, linear.lora_dropout = scaling, dropout
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Dropout wherever gradients flow (the actor's passes, its prompt forwards in the rollout's eval mode
        # too), nowhere else: logprob passes and the engine see the adapter as it is.
        dropped = F.dropout(x, self.lora_dropout, training=torch.is_grad_enabled()) if self.lora_dropout else x
        return F.linear(x, self.weight, self.bias) + self.scaling * F.linear(F.linear(dropped, self.lora_A),
                                                                             self.lora_B)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def is_adapter(name: str) -> bool:
    """Whether a parameter's dotted name is an adapter's (lora_A / lora_B)."""
    return name.rpartition(".")[2] in ADAPTER_NAMES


def has_adapters(model: nn.Module) -> bool:
    """Whether `model` has LoRA adapters (apply_lora ran on it)."""
    return any(isinstance(m, LoRALinear) for m in model.modules())


def selected_layers(model: nn.Module, config: LoRAConfig,
                    skip: nn.Module | None = None) -> Iterator[tuple[str, nn.Linear]]:
    """The (name, nn.Linear) pairs that get adapters: named by config.target_modules (a name
    matches a target it equals or ends with after a dot; all-linear: every Linear but the LM
    head and MoE routers, as PEFT's all-linear, whose transformers models hold no Linear there),
    not matched whole by config.exclude_modules and not inside `skip` (the vision tower
    parallel.freeze_vision freezes)."""
    targets = config.target_modules
    exclude = re.compile(config.exclude_modules)
    skipped = set() if skip is None else {id(m) for m in skip.modules()}
    routers = {id(m.gate) for m in model.modules() if isinstance(m, SparseMoE)}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or exclude.fullmatch(name) or id(module) in skipped:
            continue
        if "all-linear" in targets and name != "lm_head" and id(module) not in routers or any(name == t or name.endswith("." + t)
                                                                 for t in targets if t != "all-linear"):
            yield name, module


def apply_lora(model: nn.Module, config: LoRAConfig, seed: int = 0, skip: nn.Module | None = None) -> None:
    """Put adapters on the selected layers of `model` (none inside `skip`) in place, after
    tensor parallelism: each adapter takes its layer's layout. A is drawn from a generator
    seeded by `seed` and the layer's place in the model, so every rank and every parallel
    layout starts from the same adapters; B is zero. On the meta device nothing is drawn."""
    layers = list(selected_layers(model, config, skip))
    if not layers:
        raise ValueError(f"lora.target_modules {config.target_modules} select no Linear layer outside "
                         f"lora.exclude_modules {config.exclude_modules!r}")
    for index, (name, linear) in enumerate(layers):
        a = None
        if not linear.weight.is_meta:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            a = nn.init.kaiming_uniform_(torch.empty(config.rank, linear.in_features), a=math.sqrt(5),
                                         generator=generator)
        _add_adapter(linear, name, config.rank, config.alpha / config.rank, config.dropout, a)


def mirror_adapters(source: nn.Module, target: nn.Module) -> None:
    """Give `target`, a model of `source`'s family (the engine's meta skeleton, maybe split
    over another TP layout), an adapter of the same rank and scaling on each layer where
    `source` has one, laid out as `target`'s layer; its values come from `source` later."""
    for name, layer in source.named_modules():
        if isinstance(layer, LoRALinear):
            name = name.replace(_CHECKPOINT_PREFIX, "")
            _add_adapter(target.get_submodule(name), name, layer.lora_A.shape[0], layer.scaling, layer.lora_dropout)


def _add_adapter(linear: nn.Linear, name: str, rank: int, scaling: float, dropout: float,
                 a: torch.Tensor | None = None) -> None:
    """`linear` as a LoRALinear with an fp32 adapter of `rank`: A = `a` (the whole tensor; else
    left unset), B zero, each laid out to match the layer's weight."""
    weight = linear.weight
    lora_a = torch.empty(rank, weight.shape[1], dtype=torch.float32, device=weight.device)
    lora_b = torch.zeros(weight.shape[0], rank, dtype=torch.float32, device=weight.device)
    if a is not None:
        lora_a.copy_(a)
    if isinstance(weight, DTensor):
        a_layout, b_layout = _adapter_layouts(weight, name)
        # Every rank holds the same whole tensors: each keeps its block, no collective.
        lora_a = distribute_tensor(lora_a, weight.device_mesh, a_layout, src_data_rank=None)
        lora_b = distribute_tensor(lora_b, weight.device_mesh, b_layout, src_data_rank=None)
    LoRALinear.adapt(linear, lora_a, lora_b, scaling, dropout)


def _adapter_layouts(weight: DTensor, name: str) -> tuple[list, list]:
    """A's and B's placements for a layer whose weight (out, in) is laid out as `weight`."""
    a_layout, b_layout = [], []
    for p in weight.placements:
        if p == Shard(0):  # column-parallel: output rows split; B (out, r) splits with them
            a_layout.append(Replicate())
            b_layout.append(Shard(0))
        elif p == Shard(1):  # row-parallel: input columns split; A (r, in) splits with them
            a_layout.append(Shard(1))
            b_layout.append(Replicate())
        elif isinstance(p, Replicate):
            a_layout.append(Replicate())
            b_layout.append(Replicate())
        else:
            raise ValueError(f"{name}: no adapter layout for a weight placed {weight.placements}")
    return a_layout, b_layout


def add_lora(model: nn.Module, config: LoRAConfig, compute_dtype: torch.dtype, seed: int = 0,
             freeze_vision: bool = False) -> set[nn.Parameter]:
    """LoRA as a run holds it (rollplex.train.parallelize, tools/export_hf.py): adapters on the
    selected layers (none in the vision tower when `freeze_vision`), then the base frozen in
    `compute_dtype` (the tower trained in full under config.train_vision); the frozen parameters."""
    vision = family_of(model).vision_tower(model)
    apply_lora(model, config, seed, skip=vision if freeze_vision else None)
    return freeze_base(model, compute_dtype, train=(vision,) if config.train_vision else ())


def freeze_base(model: nn.Module, compute_dtype: torch.dtype, train: tuple[nn.Module, ...] = ()) -> set[nn.Parameter]:
    """Freeze every parameter of `model` but the adapters and those of the `train` modules
    (lora.train_vision's tower), holding each frozen one in `compute_dtype` only; return
    the frozen parameters (which FSDP leaves alone)."""
    trained = {id(p) for m in train for p in m.parameters()}
    held: dict[int, nn.Parameter] = {}  # by the original's id: a parameter two modules share stays shared
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or name in ADAPTER_NAMES and isinstance(module, LoRALinear) or id(param) in trained:
                continue
            if id(param) not in held:
                held[id(param)] = nn.Parameter(param.detach().to(compute_dtype), requires_grad=False)
            module._parameters[name] = held[id(param)]
    return set(held.values())


def base_model_view(model: nn.Module, tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """The frozen base of a LoRA `model` (parallelised, its vision tower frozen) as a model of
    its own on the same tensors, no copy: the reference model of a KL-regularised run. Built on
    the meta device and split over `tp_mesh` as the trainer is, then given the trainer's frozen
    parameters themselves; it has no FSDP (the base is outside it) and no adapters."""
    family = family_of(model)
    with torch.device("meta"):
        base = family.model_class(model.args).eval()
    if tp_mesh is not None and tp_mesh.size() > 1:
        family.apply_tp(base, tp_mesh)
    for path, param in model.named_parameters():
        if is_adapter(path):
            continue
        if param.requires_grad:
            raise ValueError(f"{path} trains: the base model is not frozen, so it cannot serve as the reference")
        module_path, _, name = path.replace(_CHECKPOINT_PREFIX, "").rpartition(".")
        setattr(base.get_submodule(module_path), name, param)
    base.set_attn_backend(model.attn_backend)
    return base.requires_grad_(False)
