"""Tiny offline checkpoint folders of a model family: the files, and random weights.

Tests and the tiny default config need a checkpoint directory that loads with
transformers exactly like a real one of its family (config.json, tokenizer, chat
template, image/video preprocessor configs) but is built offline in well under a
second. The family writes its config.json and processor files
(`ModelFamily.tiny_hf_config`, `tiny_processor_files`); the tokenizers and the
chat template, which both Qwen families share, are rollplex.tiny_tokenizer's;
the weights are Rollplex's own model's (`make_tiny_checkpoint`).

Everything is loadable by ``AutoConfig`` / ``AutoTokenizer`` / ``AutoProcessor``
of transformers 5 without torchvision (the PIL image processor is pinned).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollplex.models.family import ModelFamily
from rollplex.models.registry import family_named
from rollplex.tiny_tokenizer import (CHAT_TEMPLATE, ENDOFTEXT, IM_END, IMAGE_PAD, SPECIAL_TOKENS, TAG_TOKENS, UNK,
                                     VIDEO_PAD, VISION_END, VISION_PAD, VISION_START, bytes_tokenizer,
                                     words_tokenizer)

@dataclass
class TinySpec:
    """Shape of a tiny model of a family. Defaults give a ~0.2M-parameter Qwen2.5-VL."""

    family: str = "qwen2_5_vl"  # a model_type of rollplex.models.registry.FAMILIES
    # The family itself, for one being built before it is registered (`TinySpec.of(FAMILY)`), whose name is
    # `family`; None: the registered family named `family`.
    unregistered_family: ModelFamily | None = field(default=None, repr=False, compare=False)
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vision_hidden_size: int = 32
    vision_depth: int = 2
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    # In pixels, as in the HF config: 56 px / 14 px patches / merge 2 = 2x2 merged tokens.
    vision_window_size: int = 56
    fullatt_block_indexes: tuple[int, ...] = (1,)
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    tokens_per_second: int = 2
    mrope_section: tuple[int, ...] | None = None  # None: the family's split of rotary_dim / 2 (t, h, w)
    # The part of head_dim that rotates (Qwen3.5's a quarter; the VL families' all of it).
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    vocab: str = "words"  # "words" or "bytes"
    extra_words: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    # Model vocab size: None pads the tokenizer length up to a multiple of
    # `pad_vocab_multiple` (as real checkpoints pad their embeddings); an int pins it
    # (must be >= the tokenizer length).
    vocab_size: int | None = None
    pad_vocab_multiple: int = 64
    # Image processor pixel budget: a 56x56 image -> 4x4 patches -> 4 merged tokens.
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16
    # Video processor pixel budget (per frame).
    video_min_pixels: int = 56 * 56
    video_max_pixels: int = 28 * 28 * 16
    # Hybrid decoders (Qwen3.5), which the other families ignore: each layer's kind, () for the family's tiny
    # pattern over num_layers; and the Gated DeltaNet layers' sizes (a key head serves a group of value heads).
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 24
    linear_conv_kernel_dim: int = 4
    # MoE decoders (Qwen3-VL-MoE, Qwen3.5-MoE), which the dense families ignore: experts, those each token goes
    # through, each expert's MLP width, and the shared expert's (Qwen3.5-MoE's; 0: none).
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 48
    shared_expert_intermediate_size: int = 32

    @classmethod
    def from_config(cls, section) -> TinySpec:
        """The tiny model a run builds, from its config section (rollplex.config.TinyModelConfig,
        whose fields are some of these, by the same names, plus the weights' seed). A 0 there
        means this spec's rule: a vision MLP twice the vision width, the tokenizer's vocabulary.
        The M-RoPE sections follow the head size, as the family splits it; the rest is the family's (`of`)."""
        shared = {f.name: getattr(section, f.name) for f in dataclasses.fields(cls) if hasattr(section, f.name)}
        return cls.of(**{**shared,
                      "vision_intermediate_size": section.vision_intermediate_size or 2 * section.vision_hidden_size,
                      "vocab_size": section.vocab_size or None})

    @classmethod
    def of(cls, family: str | ModelFamily = "qwen2_5_vl", **fields: Any) -> TinySpec:
        """A spec of `family` (a registered family's model_type, or a family object, registered or not):
        its own tiny shape (`ModelFamily.tiny_spec`, e.g. Qwen3-VL's 16 px patches) under the
        given `fields`."""
        if isinstance(family, ModelFamily):
            return cls(family=family.name, unregistered_family=family, **{**family.tiny_spec, **fields})
        return cls(family=family, **{**family_named(family).tiny_spec, **fields})

    def __post_init__(self) -> None:
        if self.unregistered_family is not None and self.unregistered_family.name != self.family:
            raise ValueError(f"TinySpec.family {self.family!r} is not its unregistered_family's name "
                             f"{self.unregistered_family.name!r}")
        self.fullatt_block_indexes = tuple(self.fullatt_block_indexes)
        self.layer_types = tuple(self.layer_types)
        if self.mrope_section is None:
            self.mrope_section = self.model_family.tiny_mrope_section(self.rotary_dim)
        self.mrope_section = tuple(self.mrope_section)
        self.extra_words = tuple(self.extra_words)
        self.validate()

    @property
    def model_family(self) -> ModelFamily:
        return self.unregistered_family or family_named(self.family)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden_size // self.vision_num_heads

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        positive = (
            "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
            "vision_hidden_size", "vision_depth", "vision_num_heads", "vision_intermediate_size",
            "vision_window_size", "patch_size", "temporal_patch_size", "spatial_merge_size",
            "tokens_per_second", "max_position_embeddings", "pad_vocab_multiple", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"TinySpec.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinySpec.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinySpec.num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"TinySpec.num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_experts "
                             f"({self.num_experts})")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"TinySpec.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(f"TinySpec rotary width (head_dim * partial_rotary_factor = {self.head_dim} * "
                             f"{self.partial_rotary_factor}) must be even and positive for RoPE")
        if sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(
                f"TinySpec.mrope_section {list(self.mrope_section)} must sum to rotary_dim/2 = {self.rotary_dim // 2} "
                f"(head_dim = hidden_size/num_heads = {self.hidden_size}/{self.num_heads}, of which "
                f"{self.partial_rotary_factor} rotates)"
            )
        if len(self.mrope_section) != 3:
            raise ValueError(f"TinySpec.mrope_section must have 3 entries (t, h, w), got {list(self.mrope_section)}")
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(
                f"TinySpec.vision_hidden_size ({self.vision_hidden_size}) must be divisible by "
                f"vision_num_heads ({self.vision_num_heads})"
            )
        if self.vision_head_dim % 4:
            # The vision 2D rope splits head_dim/2 frequencies between h and w.
            raise ValueError(f"TinySpec vision head_dim ({self.vision_head_dim}) must be divisible by 4")
        merged_patch = self.patch_size * self.spatial_merge_size
        if self.vision_window_size % merged_patch:
            raise ValueError(
                f"TinySpec.vision_window_size ({self.vision_window_size} px) must be a multiple of "
                f"patch_size*spatial_merge_size ({merged_patch})"
            )
        for i in self.fullatt_block_indexes:
            if not 0 <= i < self.vision_depth:
                raise ValueError(
                    f"TinySpec.fullatt_block_indexes {list(self.fullatt_block_indexes)} out of range "
                    f"for vision_depth {self.vision_depth}"
                )
        if self.vocab not in ("words", "bytes"):
            raise ValueError(f"TinySpec.vocab must be 'words' or 'bytes', got {self.vocab!r}")
        for pixels in ("min_pixels", "max_pixels", "video_min_pixels", "video_max_pixels"):
            if getattr(self, pixels) < merged_patch * merged_patch:
                raise ValueError(f"TinySpec.{pixels} must be >= {merged_patch}^2 (one merged token)")
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise ValueError("TinySpec min_pixels must not exceed max_pixels")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"TinySpec.layer_types has {len(self.layer_types)} entries for num_layers {self.num_layers}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"TinySpec.linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")
        for word in self.extra_words:
            if not word or any(c.isspace() for c in word):
                raise ValueError(f"TinySpec.extra_words entries must be non-empty and contain no whitespace: {word!r}")


def build_tokenizer(spec: TinySpec):
    """The raw `tokenizers.Tokenizer` for a spec (what tokenizer.json holds)."""
    if spec.vocab == "words":
        return words_tokenizer(spec.extra_words)
    tok = bytes_tokenizer()
    if spec.extra_words:
        # Whole-word tokens on top of bytes (e.g. answer words the benchmark wants
        # as single tokens).
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in spec.extra_words])
    return tok


def model_vocab_size(spec: TinySpec, tokenizer_len: int) -> int:
    """Embedding rows for a tokenizer of `tokenizer_len` tokens (padded, or spec.vocab_size)."""
    if spec.vocab_size is not None:
        if spec.vocab_size < tokenizer_len:
            raise ValueError(
                f"TinySpec.vocab_size ({spec.vocab_size}) is smaller than the tokenizer length ({tokenizer_len})"
            )
        return spec.vocab_size
    m = spec.pad_vocab_multiple
    return -(-tokenizer_len // m) * m


def _special_token_ids(tok) -> dict[str, int]:
    ids = {}
    for t in (*SPECIAL_TOKENS, *TAG_TOKENS):
        i = tok.token_to_id(t)
        assert i is not None, t
        ids[t] = i
    return ids


def write_tokenizer_and_processor(out_dir: str | os.PathLike, spec: TinySpec) -> dict[str, Any]:
    """Write tokenizer, chat template and image/video preprocessor configs to `out_dir`.

    Returns ``{"vocab_size": tokenizer length, "model_vocab_size": padded embedding rows,
    "special_token_ids": {token: id}}``; pass it (or its parts) to `hf_config_dict`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec)
    tok.save(str(out / "tokenizer.json"))
    ids = _special_token_ids(tok)
    vocab_len = tok.get_vocab_size(with_added_tokens=True)

    added_tokens_decoder = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in (*SPECIAL_TOKENS, *TAG_TOKENS)
    }
    tokenizer_config = {
        # The generic fast tokenizer loads tokenizer.json as is. Naming Qwen2Tokenizer
        # here would make transformers 5 rebuild a BPE model from vocab/merges.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "processor_class": spec.model_family.hf_processor,
        "model_max_length": spec.max_position_embeddings,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": UNK if spec.vocab == "words" else None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "errors": "replace",
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "extra_special_tokens": {},
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})
    # transformers 5 reads the template from this file for both tokenizer and processor.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})

    for name, content in spec.model_family.tiny_processor_files(spec).items():
        _write_json(out / name, content)
    return {
        "vocab_size": vocab_len,
        "model_vocab_size": model_vocab_size(spec, vocab_len),
        "special_token_ids": ids,
    }


# --------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------
def _resolve_ids(special_token_ids: dict[str, Any]) -> dict[str, int]:
    """The tokenizer's ids by the config.json key that holds each (image_token_id, ..., eos_token_id)."""
    # Accept the whole dict write_tokenizer_and_processor returned, or its "special_token_ids" part.
    ids = special_token_ids.get("special_token_ids", special_token_ids)
    missing = [t for t in SPECIAL_TOKENS if t not in ids]
    if missing:
        raise ValueError(f"special_token_ids lacks {missing}")
    return {key: int(ids[token]) for key, token in (
        ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD), ("vision_start_token_id", VISION_START),
        ("vision_end_token_id", VISION_END), ("vision_pad_token_id", VISION_PAD), ("bos_token_id", ENDOFTEXT),
        ("eos_token_id", IM_END), ("pad_token_id", ENDOFTEXT))}


def hf_config_dict(spec: TinySpec, vocab_size: int, special_token_ids: dict[str, Any], dtype: str = "float32",
                   style: str = "nested") -> dict[str, Any]:
    """config.json of the tiny model, as its family writes it (`ModelFamily.tiny_hf_config`;
    style "nested" as transformers 5 writes it, "flat" as the hub's Qwen2.5-VL files).

    `vocab_size` is the tokenizer length; the config gets `model_vocab_size(spec, vocab_size)`
    rows (padded to spec.pad_vocab_multiple, or spec.vocab_size).
    """
    return spec.model_family.tiny_hf_config(spec, model_vocab_size(spec, vocab_size), _resolve_ids(special_token_ids),
                                            style, dtype)


def generation_config_dict(special_token_ids: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as Qwen2.5-VL-Instruct ships it (ids remapped)."""
    ids = _resolve_ids(special_token_ids)
    return {
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": [ids["eos_token_id"], ids["pad_token_id"]],
        "pad_token_id": ids["pad_token_id"],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def write_config(
    out_dir: str | os.PathLike, spec: TinySpec, info: dict[str, Any], style: str = "nested", dtype: str = "float32"
) -> dict[str, Any]:
    """Write config.json (style "nested" or "flat") and generation_config.json; return the config dict."""
    cfg = hf_config_dict(spec, info["vocab_size"], info, dtype=dtype, style=style)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json", generation_config_dict(info))
    return cfg


def write_tiny_files(
    out_dir: str | os.PathLike, spec: TinySpec | None = None, style: str = "nested", dtype: str = "float32"
) -> dict[str, Any]:
    """Everything of a tiny checkpoint directory except the weights.

    Returns the `write_tokenizer_and_processor` info plus "config" (the config dict).
    """
    spec = spec or TinySpec()
    info = write_tokenizer_and_processor(out_dir, spec)
    info["config"] = write_config(out_dir, spec, info, style=style, dtype=dtype)
    return info


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def make_tiny_checkpoint(out_dir: str | os.PathLike, spec: TinySpec | None = None, seed: int = 0,
                         style: str = "nested") -> Path:
    """A complete tiny random directory of the spec's family (by default Qwen2.5-VL), fully
    offline: config, random fp32 weights (built by Rollplex's own model), tokenizer with
    the Qwen special tokens and chat template, and the image/video preprocessor configs."""
    from rollplex.models.loader import build_model, save_pretrained

    spec = spec or TinySpec()
    family = spec.model_family
    info = write_tiny_files(out_dir, spec, style=style)
    # Fan-in init: with transformers' N(0, 0.02) the first policy is so uniform that the
    # tiny RL demo saw no reward in 185 steps; with fan-in it learns the answer format.
    model = build_model(family.args_from_hf_config(info["config"], str(out_dir)), seed=seed, init_std=None,
                        family=family)
    save_pretrained(model, out_dir, hf_config=info["config"], family=family)
    return Path(out_dir)
