"""The args both Qwen VL families share (rollplex.models.qwen_vl): the fields of
`ModelArgs` besides the vision and text dataclasses, the tiny test models' token
ids, and the counts of the decoder, which is the same Qwen2 / Qwen3 shape in both
(rollplex.models.qwen_vl.layers). Each family's args module keeps its own
`VisionArgs` and `TextArgs` (their defaults are its hub's), `rope_spec`, named
sizes, and the counts of its vision tower."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollplex.models.family import ParamCounts

# The vision tokens of both families' tiny test models: 90 (image pad), 91 (video pad), 92 and 93 (vision start and
# end), eos 94, bos 95 (of a vocabulary of 100).
TINY_TOKEN_IDS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93,
                      eos_token_id=94, bos_token_id=95)


@dataclass
class QwenVLArgs:
    """The base of a family's `ModelArgs`, which declares `vision` and `text` again with
    its own dataclasses as their types and defaults (the fields keep this order). The
    token ids' defaults are the hub's, the same in both families' checkpoints."""

    vision: Any = None  # the family's VisionArgs
    text: Any = None  # the family's TextArgs
    tie_word_embeddings: bool = False
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    eos_token_id: int | list[int] | None = 151645
    bos_token_id: int | None = 151643


def param_counts(args: QwenVLArgs, vision_block: int, vision_root: int, qkv_bias: bool, qk_norm: bool) -> ParamCounts:
    """A family's `ParamCounts` from its vision tower's counts (one block's elements, and
    those of the tower's parts in the root unit: patch embedding, mergers, ...) and the
    decoder's shape: q/k/v (biased with `qkv_bias`), o and gate/up/down are what apply_tp
    splits; the two norms of a layer (and q_norm / k_norm with `qk_norm`) stay replicated."""
    v, t = args.vision, args.text
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    split_layer = (t.hidden_size + qkv_bias) * (q + 2 * kv) + q * t.hidden_size \
        + 3 * t.hidden_size * t.intermediate_size
    replicated_layer = 2 * t.hidden_size + (2 * t.head_dim if qk_norm else 0)
    embeddings = t.vocab_size * t.hidden_size * (1 if args.tie_word_embeddings else 2)  # + the head when untied
    root_split = 0 if args.tie_word_embeddings else embeddings
    tp_split = t.num_hidden_layers * split_layer + root_split
    root = vision_root + t.hidden_size + embeddings  # the tower's root parts, the final norm, embedding (and head)
    total = v.depth * vision_block + t.num_hidden_layers * (split_layer + replicated_layer) + root
    return ParamCounts(total, tp_split, v.depth * vision_block + vision_root, root, root_split, split_layer,
                       replicated_layer)


def decoder_linear_params(t: Any) -> int:
    """The matmul weights a text token goes through in the decoder (`t`: a family's
    TextArgs): every layer's q/k/v, o and gate/up/down (biases and norms left out)."""
    attn = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim \
        + t.num_attention_heads * t.head_dim * t.hidden_size
    return t.num_hidden_layers * (attn + 3 * t.hidden_size * t.intermediate_size)
