"""Read and write Hugging Face checkpoint directories of every model family.

Single-file or sharded safetensors; the family comes from config.json's
`model_type` (rollplex.models.registry), and config.json and the key names are
converted by the family's functions (rollplex.models.family). The
model is built on the meta device and each tensor is read straight into the
target dtype and device, so no full fp32 copy exists on the side. Saving writes
the hub layout. A model folder is only ever read from disk: `check_model_folder`
turns a wrong model.path into one error before anything reads it.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollplex.dist import full_tensor, rank
from rollplex.models.family import FamilyArgs, ModelFamily, StackedTensor
from rollplex.models.protocol import CheckpointError, VisionLanguageModel
from rollplex.models.registry import family_of, family_of_config

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# org/name, as the hub spells a model id; a folder by that name, where one exists, is used instead.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_SHOWN_ENTRIES = 8  # of a folder that is not a model folder, the entries listed to show what it is


def check_model_folder(path: str | os.PathLike, needs: Mapping[str, Callable[[Path], bool]]) -> Path:
    """`path` as a Path, once it is a local folder holding each of `needs` ({what: test of the folder});
    else one CheckpointError naming model.path, the path and what is wrong. Nothing is looked up on the hub:
    a hub id gets the command that downloads it."""
    folder = Path(path)
    if folder.is_dir():
        if lacking := [what for what, present in needs.items() if not present(folder)]:
            raise CheckpointError(f"model.path {folder}: no {', no '.join(lacking)}{_holding(folder)}")
        return folder
    if folder.exists():
        raise CheckpointError(f"model.path {folder}: a file, not a folder; give the folder that holds it "
                              f"({folder.parent}), with config.json, the tokenizer and the weights")
    if _HUB_ID.fullmatch(str(path)):
        raise CheckpointError(f"model.path {path}: no local folder of that name, and it looks like a Hugging Face "
                              f"hub id; a run loads only local folders and never downloads: download it first, "
                              f"e.g. huggingface-cli download {path} --local-dir models/{folder.name}, and set "
                              f"model.path to that folder (models/{folder.name})")
    relative = "" if folder.is_absolute() else f" (a relative path starts from the working folder, {Path.cwd()})"
    raise CheckpointError(f"model.path {folder}: no such folder{relative}")


def _holding(folder: Path) -> str:
    """What a folder that is not a model folder holds, to tell which folder it is (e.g. the model's parent)."""
    entries = sorted(f"{e.name}/" if e.is_dir() else e.name for e in folder.iterdir())
    if not entries:
        return " (the folder is empty)"
    more = ", ..." if len(entries) > _SHOWN_ENTRIES else ""
    return f" (it holds: {', '.join(entries[:_SHOWN_ENTRIES])}{more})"


def has_file(name: str) -> Callable[[Path], bool]:
    """check_model_folder's test for the file `name`."""
    return lambda folder: (folder / name).is_file()


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors"))


# What from_pretrained reads of a model folder (the processor's files: rollplex.data.processor.PROCESSOR_FILES).
WEIGHT_FILES = {
    CONFIG_NAME: has_file(CONFIG_NAME),
    f"safetensors weights ({SINGLE_NAME} or model-*.safetensors)": _has_weights,
}


def read_hf_config(path: str | os.PathLike) -> dict:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file} not found: a checkpoint directory needs a config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """checkpoint key -> file holding it."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: path / f for k, f in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index} names {f.name}, which is missing from {path}")
        return files
    single = path / SINGLE_NAME
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {path} (expected {SINGLE_NAME} or {INDEX_NAME})")
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update({k: file for k in f.keys()})
    return out


def load_weights(model: VisionLanguageModel, path: str | os.PathLike, dtype: torch.dtype,
                 device: torch.device | str, family: ModelFamily | None = None) -> None:
    """Read every tensor of the checkpoint into `model` (on meta or materialised),
    converted to `dtype` on `device` one parameter at a time. `family`: the model's
    (by default the registered family of its args). Tensors under the family's
    `dropped_keys` are skipped, with one warning per prefix. A parameter the family
    stacks from several keys (`StackedTensor`: an MoE layer's experts) is made
    from all of them."""
    path = Path(path)
    family = family or family_of(model)
    files = _weight_files(path)
    dropped = {prefix: [key for key in files if key.startswith(prefix)] for prefix in family.dropped_keys}
    for prefix, keys in dropped.items():
        if keys:
            warnings.warn(f"{path}: {len(keys)} tensor(s) under {prefix}* not loaded: {family.dropped_keys[prefix]}",
                          stacklevel=2)
    skipped = {key for keys in dropped.values() for key in keys}
    expected = dict(model.named_parameters())
    stacked = {name: spec for name in expected if (spec := family.stacked_tensor(name, model.args)) is not None}
    stacked_keys = {key for spec in stacked.values() for key in spec.keys}
    by_file: dict[Path, list[tuple[str, list[str]]]] = {}
    unexpected = []
    for key, file in files.items():
        if key in skipped or key in stacked_keys:
            continue
        names = family.hf_key_to_params(key)
        if not names:
            continue
        if names == ["lm_head.weight"] and model.lm_head is None:
            continue  # tied embeddings: some checkpoints still store the head
        if any(n not in expected or n in stacked for n in names):
            unexpected.append(key)
            continue
        by_file.setdefault(file, []).append((key, names))
    found = {n for pairs in by_file.values() for _, names in pairs for n in names}
    missing = sorted({family.param_to_hf_key(n) for n in set(expected) - found - set(stacked)}
                     | (stacked_keys - set(files)))
    if missing:
        shown = ", ".join(missing[:5])
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}"
                              + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        raise CheckpointError(f"checkpoint {path} holds tensors this model does not have: {unexpected[:5]} "
                              "(does config.json match the weights?)")
    state = {}
    for file, pairs in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for key, names in pairs:
                tensor = f.get_tensor(key)
                rows = [expected[n].shape[0] for n in names]
                shape = (sum(rows), *expected[names[0]].shape[1:])
                if tuple(tensor.shape) != shape:
                    raise CheckpointError(f"{file.name}: tensor {key} has shape {tuple(tensor.shape)}, the model "
                                          f"expects {shape} (from config.json)")
                # Split parts are copied, so that no parameter is a view into another one's storage.
                for name, part in zip(names, tensor.split(rows)):
                    state[name] = part.to(device=device, dtype=dtype, copy=len(names) > 1)
    for name, spec in stacked.items():
        state[name] = _load_stacked(name, spec, files, tuple(expected[name].shape)).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)


def _load_stacked(name: str, spec: StackedTensor, files: dict[str, Path], shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter `name` of `shape`, made from its keys' tensors (`StackedTensor.load`)."""
    tensors = []
    for key in spec.keys:
        with safe_open(files[key], framework="pt", device="cpu") as f:
            tensors.append(f.get_tensor(key))
    tensor = spec.load(tensors, shape)
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"parameter {name}: its checkpoint tensors ({spec.keys[0]}, ...) make shape "
                              f"{tuple(tensor.shape)}, the model expects {shape} (from config.json)")
    return tensor


def hub_tensors(family: ModelFamily, args: FamilyArgs, ours: dict[str, torch.Tensor],
                whole: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameters by name -> tensors by checkpoint key, in the hub layout: the parts of a fused key
    concatenated and stacked parameters split into their keys, each of those made `whole` first
    (a DTensor gathered); other parameters as they are."""
    tensors, rows = {}, []
    for name, tensor in ours.items():
        if (spec := family.stacked_tensor(name, args)) is None:
            rows.append(name)
        else:
            tensors.update(zip(spec.keys, spec.save(whole(tensor))))
    for key in sorted({family.param_to_hf_key(name) for name in rows}):
        parts = [ours[name] for name in family.hf_key_to_params(key)]
        tensors[key] = torch.cat([whole(p) for p in parts]) if len(parts) > 1 else parts[0]
    return tensors


def build_model(args: FamilyArgs, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                seed: int | None = None, init_std: float | None = 0.02,
                family: ModelFamily | None = None) -> VisionLanguageModel:
    """A randomly initialised model (for tests, tiny checkpoints and benchmarks),
    built on the meta device and materialised once in `dtype` on `device`.

    Default: as transformers initialises the Qwen VL models, weights ~ N(0, init_std),
    biases 0, norm scales at the identity (the family's `init_constant`: 1 for
    x * w, 0 for a zero-centred x * (1 + w)), and what transformers draws its own
    way as it does (the family's `init_draw`: a Gated DeltaNet's decay rates); small
    weights give a near-uniform first policy, which a model trained from scratch by
    RL needs in order to explore. init_std=None: weights ~ N(0, 1/fan_in) and random
    biases (init_draw's tensors drawn as those too), so every layer moves the output:
    what parity tests need to catch a wrong layer.

    The values are drawn on `device` (a 3B model's weights take minutes with CPU
    randn), so a seed gives the same weights on every device of one type, not
    across types. `family`: the args' (by default their registered family), as
    from_pretrained's."""
    family = family or family_of(args)
    with torch.device("meta"):
        model = family.model_class(args)
    model = model.to(dtype=dtype).to_empty(device=device)
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0 if seed is None else seed)
    params = dict(model.named_parameters())
    stacked = [name for name in params if family.stacked_tensor(name, args) is not None]
    with torch.no_grad():
        # Stacked (experts, in, out): each expert's weight drawn as a Linear's of fan-in `in`.
        for name in stacked:
            std = params[name].shape[-2] ** -0.5 if init_std is None else init_std
            params[name].copy_(torch.randn(params[name].shape, generator=gen, device=device) * std)
        # Drawn per hub tensor (a vision qkv as one), so a seed gives the weights it gave a fused model.
        for key in dict.fromkeys(family.param_to_hf_key(name) for name in params if name not in stacked):
            parts = [params[name] for name in family.hf_key_to_params(key)]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if (constant := family.init_constant(key)) is not None:
                value = torch.full(shape, constant, device=device)
            elif init_std is not None and (drawn := family.init_draw(key, shape, gen)) is not None:
                value = drawn
            elif key.endswith("bias"):
                value = torch.randn(shape, generator=gen, device=device) * 0.02 if init_std is None else \
                    torch.zeros(shape, device=device)
            else:
                std = math.prod(shape[1:]) ** -0.5 if init_std is None else init_std
                value = torch.randn(shape, generator=gen, device=device) * std
            for p, part in zip(parts, value.split([p.shape[0] for p in parts])):
                p.copy_(part)
    return model


def read_model_args(path: str | os.PathLike, family: ModelFamily | None = None) -> FamilyArgs:
    """The model args of a checkpoint directory's config.json, read by its family (by default
    the registered one of its model_type)."""
    cfg, source = read_hf_config(path), str(Path(path) / CONFIG_NAME)
    return (family or family_of_config(cfg, source)).args_from_hf_config(cfg, source)


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", attn_backend: str = "auto",
                    family: ModelFamily | None = None) -> VisionLanguageModel:
    """Load a Hugging Face checkpoint directory of any supported family (config.json's
    model_type picks it) into a Rollplex model (a path that is not one: a CheckpointError
    saying what it lacks, see `check_model_folder`). `family` names one instead: a family
    being built, before it is registered, loads this way."""
    check_model_folder(path, WEIGHT_FILES)
    args = read_model_args(path, family)
    family = family or family_of(args)
    with torch.device("meta"):
        model = family.model_class(args)
    load_weights(model, path, dtype, device, family)
    model.set_attn_backend(attn_backend)
    return model.eval()


def save_pretrained(model: VisionLanguageModel, path: str | os.PathLike, max_shard_bytes: int = 4 << 30,
                    hf_config: dict | None = None, family: ModelFamily | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`)
    in the hub layout. `hf_config` replaces the config.json generated from the
    model's args (to keep a source checkpoint's own file); `family`: the model's (by
    default its registered family), as from_pretrained's. DTensor parameters are
    gathered first, so every rank must call this; only rank 0 (or a
    non-distributed process) writes."""
    path = Path(path)
    family = family or family_of(model)
    ours = {}
    for name, p in model.state_dict().items():
        ours[name] = full_tensor(p).detach().to("cpu").contiguous()  # collective for a DTensor
    tensors = {key: t.contiguous() for key, t in hub_tensors(family, model.args, ours, lambda t: t).items()}
    if rank() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config if hf_config is not None else family.hf_config_from_args(model.args)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    index = hub_file_index({key: tensors[key] for key in sorted(tensors)}, max_shard_bytes)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(max(index.values()))]
    for key, file in index.items():
        shards[file - 1][key] = tensors[key]
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_NAME, metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata=metadata)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2) + "\n")


def hub_file_index(tensors: dict[str, torch.Tensor], max_file_bytes: int) -> dict[str, int]:
    """{key: its file's number, from 1}: keys in order, a new file when the next
    tensor would take the current one past `max_file_bytes` (a tensor larger than
    that gets a file of its own; a DTensor counts its whole size)."""
    index, file, size = {}, 1, 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > max_file_bytes:
            file, size = file + 1, 0
        index[key], size = file, size + nbytes
    return index
