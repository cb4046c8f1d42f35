"""The Hugging Face side both Qwen VL families share (rollplex.models.qwen_vl):
checkpoint keys <-> parameter names, and the pieces their config.json readers
have in common. Each family's `hf` keeps its config.json reading and writing
(Qwen2.5-VL's flat style, Qwen3-VL's nested one) and says which key style it writes.

Parameter names are `visual.*`, `language_model.*` (the decoder) and `lm_head.*`.
Checkpoint keys come in two styles, and both families read both: the flat one of
the hub's Qwen2.5-VL files (`visual.*`, `model.layers.*`) and the nested one that
transformers 5 and the hub's Qwen3-VL files write (`model.visual.*`,
`model.language_model.*`); `lm_head.*` is the same in both.

Both checkpoints fuse each vision block's q, k and v projections into one
`attn.qkv` Linear (rows: q, then k, then v); the models keep them apart so that
tensor parallelism can split each by heads. A fused key names the three
parameters it holds, in row order: loading splits the tensor, saving
concatenates the three back (rollplex.models.loader).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollplex.models.protocol import CheckpointError

FUSED_QKV = ".attn.qkv."
SPLIT_QKV = (".attn.q.", ".attn.k.", ".attn.v.")
# checkpoint prefix -> ours, the first matching one wins (the nested style first)
_PREFIXES = (("model.visual.", "visual."), ("model.language_model.", "language_model."),
             ("visual.", "visual."), ("model.", "language_model."))
_DECODER = "language_model."


def hf_key_to_params(key: str) -> list[str]:
    """Checkpoint key (either style) -> the parameter names it holds, in row order:
    none for keys we do not keep, three for a vision block's fused qkv."""
    if key.endswith("rotary_emb.inv_freq"):
        return []
    for prefix, ours in _PREFIXES:
        if key.startswith(prefix):
            name = ours + key[len(prefix):]
            if name.startswith("visual.blocks.") and FUSED_QKV in name:
                return [name.replace(FUSED_QKV, part) for part in SPLIT_QKV]
            return [name]
    return [key]  # lm_head.weight


def _fused(name: str) -> str:
    """A vision block's q, k or v parameter -> the name of the fused qkv one (others unchanged)."""
    if name.startswith("visual.blocks."):
        for part in SPLIT_QKV:
            name = name.replace(part, FUSED_QKV)
    return name


def param_to_flat_key(name: str) -> str:
    """Our parameter name -> its key in the flat style (q, k and v of a vision block share one)."""
    if name.startswith(_DECODER):
        return "model." + name[len(_DECODER):]
    return _fused(name)


def param_to_nested_key(name: str) -> str:
    """Our parameter name -> its key in the nested style (q, k and v of a vision block share one)."""
    if name.startswith(_DECODER):
        return "model." + name
    if name.startswith("visual."):
        return "model." + _fused(name)
    return name


# ----------------------------------------------------------------------------- config.json


def nested_config_top(args: Any, architecture: str, model_type: str) -> dict[str, Any]:
    """The top level of a nested config.json (Qwen3-VL's, Qwen3.5's) as the hub writes it: the
    architecture, model type, tied embeddings, vision token ids and dtype; each family adds its
    text_config and vision_config."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "tie_word_embeddings": args.tie_word_embeddings,
        "image_token_id": args.image_token_id,
        "video_token_id": args.video_token_id,
        "vision_start_token_id": args.vision_start_token_id,
        "vision_end_token_id": args.vision_end_token_id,
        "dtype": "bfloat16",
    }


def pick_fields(d: dict, dataclass_type: type, **extra: Any) -> Any:
    """`dataclass_type` from the entries of `d` that are its fields, `extra` taking the place of `d`'s own."""
    names = dataclass_type.__dataclass_fields__
    return dataclass_type(**{k: v for k, v in d.items() if k in names and k not in extra}, **extra)


def token_ids(cfg: dict, text: dict, keep_null: bool = False) -> dict:
    """The vision token ids (config.json's top level), eos and bos (the top level, else
    the text config's, as the hub has them), as ModelArgs fields. A key whose value is
    null counts as absent (the field keeps its default) unless `keep_null`."""
    def given(d: dict, k: str) -> bool:
        return k in d if keep_null else d.get(k) is not None

    ids = {k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                               "eos_token_id", "bos_token_id") if given(cfg, k)}
    for k in ("eos_token_id", "bos_token_id"):
        if k not in ids and given(text, k):
            ids[k] = text[k]
    return ids



def nested_model_args(cfg: dict, source: str, label: str, build: Callable[..., Any]) -> Any:
    """The model args of a config.json in the nested style (`text_config` / `vision_config`: Qwen3-VL's and
    Qwen3.5's): `build(text, vision, **shared)` makes them from the two parts, `shared` being what the top level
    and the text part give alike (tie_word_embeddings, the token ids). A missing part, or a field of the wrong
    type or value, is a CheckpointError naming `source`; `label` names the family in it."""
    for part in ("text_config", "vision_config"):
        if not isinstance(cfg.get(part), dict):
            raise CheckpointError(f"{source}: no {part}; a {label} config.json nests its text and vision configs")
    text, vision = cfg["text_config"], cfg["vision_config"]
    tied = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    try:
        return build(text, vision, tie_word_embeddings=tied, **token_ids(cfg, text))
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:  # a field of the wrong type or an unknown value
        raise CheckpointError(f"{source}: {e}") from e
