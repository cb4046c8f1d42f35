"""Read and write Hugging Face Qwen2.5-VL checkpoint directories.

Reads config.json in both styles (the hub's flat one with a nested
`vision_config`, and transformers 5's `text_config` / `vision_config`),
single-file or sharded safetensors, and both key styles (`visual.*` /
`model.layers.*` as on the hub, `model.visual.*` / `model.language_model.*` as
transformers 5 saves). The model is built on the meta device and each tensor is
read straight into the target dtype and device, so no full fp32 copy exists on
the side. Saving writes the hub style, which every transformers version and
other tools read.

The hub fuses each vision block's q, k and v projections into one
`attn.qkv` Linear (rows: q, then k, then v); the model keeps them apart so
that tensor parallelism can split each by heads. Loading splits the fused
tensor, saving concatenates the three back.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollplex.models.qwen2_5_vl import ModelArgs, Qwen2_5_VL, TextArgs, VisionArgs

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read: the message says what is wrong and where."""


# ----------------------------------------------------------------------------- config


def read_hf_config(path: str | os.PathLike) -> dict:
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(f"{file} not found: a Qwen2.5-VL checkpoint directory needs a config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e


def args_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a config.json dict of either style."""
    if cfg.get("model_type") not in (None, "qwen2_5_vl"):
        raise CheckpointError(f"{source}: model_type is {cfg.get('model_type')!r}, expected 'qwen2_5_vl'")
    if "vision_config" not in cfg:
        raise CheckpointError(f"{source}: no vision_config; is this a Qwen2.5-VL checkpoint?")
    text = {**cfg, **cfg.get("text_config", {})}  # flat style keeps text fields at the top level
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    vision = cfg["vision_config"]
    vision_rope = vision.get("rope_parameters") or {}
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))

    def pick(d: dict, dataclass_type, **extra):
        names = dataclass_type.__dataclass_fields__
        return dataclass_type(**{k: v for k, v in d.items() if k in names}, **extra)

    try:
        text_args = pick({k: v for k, v in text.items() if k not in ("rope_theta", "mrope_section")}, TextArgs,
                         rope_theta=float(rope.get("rope_theta", text.get("rope_theta", TextArgs.rope_theta))),
                         mrope_section=list(rope.get("mrope_section", [16, 24, 24])))
        vision_args = pick({k: v for k, v in vision.items() if k != "rope_theta"}, VisionArgs,
                           rope_theta=float(vision_rope.get("rope_theta", 10000.0)))
        vision_args.fullatt_block_indexes = list(vision_args.fullatt_block_indexes)
        if "out_hidden_size" not in vision:
            vision_args.out_hidden_size = text_args.hidden_size
        top = {k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id", "eos_token_id", "bos_token_id") if k in cfg}
        for k in ("eos_token_id", "bos_token_id"):
            if k not in top and k in text:
                top[k] = text[k]
        args = ModelArgs(vision=vision_args, text=text_args, tie_word_embeddings=bool(tie), **top)
    except TypeError as e:
        raise CheckpointError(f"{source}: {e}") from e
    if 2 * sum(text_args.mrope_section) != text_args.head_dim:
        raise CheckpointError(f"{source}: mrope_section {text_args.mrope_section} must sum to head_dim/2 = "
                              f"{text_args.head_dim // 2}")
    if vision_args.out_hidden_size != text_args.hidden_size:
        raise CheckpointError(f"{source}: vision out_hidden_size {vision_args.out_hidden_size} != text hidden_size "
                              f"{text_args.hidden_size}")
    return args


def hf_config_from_args(args: ModelArgs) -> dict:
    """config.json in the hub's flat style, readable by transformers 4 and 5."""
    t, v = args.text, args.vision
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "hidden_act": t.hidden_act,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(t.mrope_section)},
        "tie_word_embeddings": args.tie_word_embeddings,
        "image_token_id": args.image_token_id,
        "video_token_id": args.video_token_id,
        "vision_start_token_id": args.vision_start_token_id,
        "vision_end_token_id": args.vision_end_token_id,
        "eos_token_id": args.eos_token_id,
        "bos_token_id": args.bos_token_id,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "vision_config": {
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "in_channels": v.in_channels,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "tokens_per_second": v.tokens_per_second,
            "window_size": v.window_size,
            "out_hidden_size": v.out_hidden_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "hidden_act": v.hidden_act,
        },
    }


# ----------------------------------------------------------------------------- weights


FUSED_QKV = ".attn.qkv."
SPLIT_QKV = (".attn.q.", ".attn.k.", ".attn.v.")


def hf_key_to_params(key: str) -> list[str]:
    """Checkpoint key (either style) -> the parameter names it holds, in row order:
    none for keys we do not keep, three for a vision block's fused qkv."""
    if key.endswith("rotary_emb.inv_freq"):
        return []
    for prefix, ours in (("model.visual.", "visual."), ("model.language_model.", "language_model."),
                         ("visual.", "visual."), ("model.", "language_model.")):
        if key.startswith(prefix):
            name = ours + key[len(prefix):]
            if name.startswith("visual.blocks.") and FUSED_QKV in name:
                return [name.replace(FUSED_QKV, part) for part in SPLIT_QKV]
            return [name]
    return [key]  # lm_head.weight


def param_to_hf_key(name: str) -> str:
    """Our parameter name -> hub-style checkpoint key (q, k and v of a vision block share one)."""
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    if name.startswith("visual.blocks."):
        for part in SPLIT_QKV:
            name = name.replace(part, FUSED_QKV)
    return name


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


def load_weights(model: Qwen2_5_VL, path: str | os.PathLike, dtype: torch.dtype, device: torch.device | str) -> None:
    """Read every tensor of the checkpoint into `model` (on meta or materialised),
    converted to `dtype` on `device` one tensor at a time."""
    path = Path(path)
    files = _weight_files(path)
    expected = dict(model.named_parameters())
    by_file: dict[Path, list[tuple[str, list[str]]]] = {}
    unexpected = []
    for key, file in files.items():
        names = hf_key_to_params(key)
        if not names:
            continue
        if names == ["lm_head.weight"] and model.lm_head is None:
            continue  # tied embeddings: some checkpoints still store the head
        if any(n not in expected for n in names):
            unexpected.append(key)
            continue
        by_file.setdefault(file, []).append((key, names))
    found = {n for pairs in by_file.values() for _, names in pairs for n in names}
    missing = sorted({param_to_hf_key(n) for n in set(expected) - found})
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
    model.load_state_dict(state, strict=True, assign=True)


def build_model(args: ModelArgs, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                seed: int | None = None, init_std: float | None = 0.02) -> Qwen2_5_VL:
    """A randomly initialised model (for tests, tiny checkpoints and benchmarks),
    built on the meta device and materialised once in `dtype` on `device`.

    Default: as transformers initialises Qwen2.5-VL, weights ~ N(0, init_std),
    biases 0, norm scales 1 (small weights give a near-uniform first policy,
    which a model trained from scratch by RL needs in order to explore).
    init_std=None: weights ~ N(0, 1/fan_in) and random biases, so every layer
    moves the output: what parity tests need to catch a wrong layer.

    The values are drawn on `device` (a 3B model's weights take minutes with CPU
    randn), so a seed gives the same weights on every device of one type, not
    across types."""
    with torch.device("meta"):
        model = Qwen2_5_VL(args)
    model = model.to(dtype=dtype).to_empty(device=device)
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0 if seed is None else seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        # Drawn per hub tensor (a vision qkv as one), so a seed gives the weights it gave a fused model.
        for key in dict.fromkeys(param_to_hf_key(name) for name in params):
            parts = [params[name] for name in hf_key_to_params(key)]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if key.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")):
                value = torch.ones(shape, device=device)
            elif key.endswith("bias"):
                value = torch.randn(shape, generator=gen, device=device) * 0.02 if init_std is None else \
                    torch.zeros(shape, device=device)
            else:
                std = math.prod(shape[1:]) ** -0.5 if init_std is None else init_std
                value = torch.randn(shape, generator=gen, device=device) * std
            for p, part in zip(parts, value.split([p.shape[0] for p in parts])):
                p.copy_(part)
    return model


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", attn_backend: str = "auto") -> Qwen2_5_VL:
    """Load a Hugging Face Qwen2.5-VL directory into a Rollplex model."""
    args = args_from_hf_config(read_hf_config(path), str(Path(path) / CONFIG_NAME))
    with torch.device("meta"):
        model = Qwen2_5_VL(args)
    load_weights(model, path, dtype, device)
    model.set_attn_backend(attn_backend)
    return model.eval()


def save_pretrained(model: Qwen2_5_VL, path: str | os.PathLike, max_shard_bytes: int = 4 << 30,
                    hf_config: dict | None = None) -> None:
    """Write config.json and safetensors (sharded with an index past `max_shard_bytes`)
    in the hub layout. `hf_config` replaces the config.json generated from the
    model's args (to keep a source checkpoint's own file). DTensor parameters are
    gathered first, so every rank must call this; only rank 0 (or a
    non-distributed process) writes."""
    path = Path(path)
    ours = {}
    for name, p in model.state_dict().items():
        if hasattr(p, "full_tensor"):  # DTensor: gather the full parameter
            p = p.full_tensor()
        ours[name] = p.detach().to("cpu").contiguous()
    tensors = {}
    for key in {param_to_hf_key(name) for name in ours}:
        parts = [ours.pop(name) for name in hf_key_to_params(key)]
        tensors[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config if hf_config is not None else hf_config_from_args(model.args)
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
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
