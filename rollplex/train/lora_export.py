"""LoRA adapters out of Rollplex: as a PEFT adapter folder, or merged into the weights.

`export_peft_adapter` writes what `peft.PeftModel.from_pretrained(base, folder)` loads
onto transformers' model of the base checkpoint (`ModelFamily.hf_architecture`):

    out_dir/adapter_config.json        peft_type LORA, r, lora_alpha, lora_dropout, the adapted modules
    out_dir/adapter_model.safetensors  base_model.model.<module>.lora_A.weight (r, in), .lora_B.weight (out, r)

PEFT computes y = x W^T + (lora_alpha / r) x A^T B^T, as rollplex.train.lora does, so
the tensors go out as trained (float32) and the logits agree to float32 rounding.
Modules are named as transformers' model names its own (the family's
`param_to_hf_module_key`: `model.language_model.*`, `model.visual.*`), not as a
checkpoint may (Qwen2.5-VL's hub files say `model.layers.*`): PEFT matches
target_modules and the tensors' keys against the model's module names.

Transformers fuses a vision block's q, k and v into one `attn.qkv` Linear, which the
models here keep apart (rollplex.models.qwen_vl.hf): their adapters become one
adapter of the fused Linear, exactly. A is the parts' A's stacked (3r, in), B block
diagonal (3 out, 3r), so B A is the three B A's stacked by rows, the fused weight's
row order; a part without an adapter gets zero rows of B. That adapter's rank is 3r,
so the config's rank_pattern gives it 3r and its alpha_pattern 3 alpha: the scaling
stays alpha / r.

`merged_state_dict` gives the weights with each adapter folded in, W + (alpha / r) B A,
for a plain Hugging Face export (rollplex.train.checkpoint.export_hf).

Both are collective on a sharded model (FSDP2, TP: DTensors): every rank gathers
the adapters, a few MB, in the same order. The base stays as each rank holds it: a
merged weight is built in the weight's own layout, each rank cutting its block out
of the whole B A (one layer's, in float32, at a time).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, distribute_tensor

from rollplex.config.sections import LoRAConfig
from rollplex.dist import full_tensor, rank
from rollplex.models.registry import family_of
from rollplex.train.lora import ADAPTER_NAMES, LoRALinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the transformers model as base_model.model


def export_peft_adapter(model: nn.Module, out_dir: str | Path, lora: LoRAConfig,
                        base_model_name_or_path: str | None = None, group: dist.ProcessGroup | None = None) -> Path:
    """Write `model`'s adapters as a PEFT LoRA adapter folder (see the module docstring) and
    return it. Collective: every rank of `group` calls it; global rank 0, which writes, must
    be one. Under lora.train_vision the vision tower's own trained weights are no adapter's:
    that is refused here (a merged export holds them)."""
    if lora.train_vision:
        raise ValueError("lora.train_vision trains the vision tower's own weights, which a PEFT adapter does not "
                         "hold: export the merged model instead (tools/export_hf.py --merged)")
    adapters = hub_adapters(model)
    out_dir = Path(out_dir)
    if rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tensors = {f"{PEFT_PREFIX}{module}.{part}.weight": t.contiguous()
                   for module, (a, b, _) in adapters.items() for part, t in zip(ADAPTER_NAMES, (a, b))}
        save_file(tensors, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        config = peft_config(adapters, lora, base_model_name_or_path)
        (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier(group)  # no rank returns (and, say, reads the folder) before it is written
    return out_dir


def peft_config(adapters: dict[str, tuple[torch.Tensor, torch.Tensor, float]], lora: LoRAConfig,
                base_model_name_or_path: str | None) -> dict:
    """adapter_config.json for `adapters` (hub module -> A, B, scaling): target_modules names each
    module whole, so PEFT adapts exactly these; a module whose rank or alpha is not the config's
    (a fused qkv) gets its own in rank_pattern and alpha_pattern."""
    ranks = {module: a.shape[0] for module, (a, _, _) in adapters.items()}
    scalings = {module: scaling for module, (_, _, scaling) in adapters.items()}
    own = [m for m in adapters if (ranks[m], scalings[m]) != (lora.rank, lora.alpha / lora.rank)]
    return {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model_name_or_path,
        "revision": None, "inference_mode": True,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": list(adapters), "exclude_modules": None,
        "rank_pattern": {m: ranks[m] for m in own}, "alpha_pattern": {m: scalings[m] * ranks[m] for m in own},
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    }  # fmt: skip


def hub_adapters(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Each adapted module of the hub's model, by its name there -> (A, B, scaling), whole, in
    float32; a vision block's q, k and v adapters fused into its qkv's. Collective when sharded."""
    family, linears = family_of(model), named_linears(model)
    keys = {family.param_to_hf_module_key(f"{name}.weight") for name, m in linears.items() if isinstance(m, LoRALinear)}
    adapters = {}
    for key in sorted(keys):  # the same order on every rank: each gathers the same tensors at once
        parts = [linears[p.removesuffix(".weight")] for p in family.hf_key_to_params(key)]
        adapters[key.removesuffix(".weight")] = _fused_adapter(parts, key)
    return adapters


def _fused_adapter(parts: list[nn.Linear], key: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One adapter (A, B, scaling) of the Linear whose weight stacks the parts' by rows (one part:
    its own adapter): A the adapted parts' A's stacked, B their B's on its block diagonal."""
    adapted = [p for p in parts if isinstance(p, LoRALinear)]
    scalings = {p.scaling for p in adapted}
    if len(scalings) > 1:
        raise ValueError(f"{key}: its parts' adapters scale apart ({sorted(scalings)}); one adapter cannot hold them")
    a = torch.cat([full_tensor(p.lora_A.detach()).float() for p in adapted])
    b = a.new_zeros(sum(p.weight.shape[0] for p in parts), a.shape[0])
    row = col = 0
    for p in parts:
        if isinstance(p, LoRALinear):
            p_b = full_tensor(p.lora_B.detach()).float()
            b[row:row + p_b.shape[0], col:col + p_b.shape[1]] = p_b
            col += p_b.shape[1]
        row += p.weight.shape[0]
    return a, b, scalings.pop()


def named_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear (LoRALinear included) of `model` by its parameters' names, as the
    state dict has them: activation checkpointing's wrapper left out of the name."""
    return {name.replace(_CHECKPOINT_PREFIX, ""): m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` (the model's state dict) with every adapted layer's weight replaced by
    W + scaling B A, computed in float32 and rounded to `dtype` once, in the weight's own
    layout, and without the adapters. Collective when sharded (each adapter is gathered)."""
    merged = dict(state)
    for name, layer in named_linears(model).items():
        if isinstance(layer, LoRALinear):
            merged[f"{name}.weight"] = _merged_weight(layer, dtype)
            for part in ADAPTER_NAMES:
                del merged[f"{name}.{part}"]
    return merged


def _merged_weight(layer: LoRALinear, dtype: torch.dtype) -> torch.Tensor:
    """W + scaling B A in `dtype`. The whole B A is built on every rank from the gathered
    adapters, so each rank cuts its own block of it to the weight's layout, without a collective."""
    delta = layer.scaling * (full_tensor(layer.lora_B.detach()).float() @ full_tensor(layer.lora_A.detach()).float())
    weight = layer.weight.detach()
    if isinstance(weight, DTensor):
        delta = distribute_tensor(delta, weight.device_mesh, weight.placements, src_data_rank=None)
    return (weight.float() + delta).to(dtype)
