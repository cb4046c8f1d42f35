"""Qwen2.5-VL's shape: the args dataclasses, the named sizes (a tiny one for
tests, the hub's 3B, 7B, 32B and 72B) and the parameter counts the memory plan
and FLOP counts read. `ModelArgs`'s fields besides vision and text, and the
decoder's counts, are rollplex.models.qwen_vl.args's."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollplex.models.family import LinearParams, ParamCounts
from rollplex.models.qwen_vl.args import TINY_TOKEN_IDS, QwenVLArgs, decoder_linear_params, param_counts
from rollplex.models.rope import RopeIndexSpec


@dataclass
class VisionArgs:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 2.0
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    hidden_act: str = "silu"
    rope_theta: float = 10000.0


@dataclass
class TextArgs:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class ModelArgs(QwenVLArgs):
    """Everything the model's shape and inputs depend on; built from a HF config.json
    (the token ids and tie_word_embeddings: `QwenVLArgs`)."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    text: TextArgs = field(default_factory=TextArgs)

    @property
    def rope_spec(self) -> RopeIndexSpec:
        return RopeIndexSpec(self.image_token_id, self.video_token_id, self.vision.spatial_merge_size,
                             self.vision.tokens_per_second)


def tiny_args(tie: bool = False, window_size: int = 56) -> ModelArgs:
    """A model of a few hundred thousand parameters for tests: vocabulary 100, the
    vision tokens 90 (image pad), 91 (video pad), 92 and 93 (vision start and end),
    eos 94, bos 95; three vision blocks, the middle one with full attention."""
    return ModelArgs(
        vision=VisionArgs(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          window_size=window_size, fullatt_block_indexes=[1], tokens_per_second=2),
        text=TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3], rope_theta=10000.0),
        tie_word_embeddings=tie, **TINY_TOKEN_IDS)


def _hub_size(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tie: bool,
              vision_inter: int) -> ModelArgs:
    text = TextArgs(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads)
    return ModelArgs(vision=VisionArgs(intermediate_size=vision_inter, out_hidden_size=hidden), text=text,
                     tie_word_embeddings=tie)


# The hub's config.json values of Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct. The vision tower is depth 32,
# width 1280, 16 heads, out_hidden_size = the LM width; its MLP is 3420 wide in 3B/7B and 3456 in 32B/72B.
# Totals: 3,754,622,976 / 8,292,166,656 / 33,452,718,336 / 73,410,777,344 parameters.
PRESETS: dict[str, ModelArgs] = {
    "qwen2.5-vl-3b": _hub_size(151936, 2048, 11008, 36, 16, 2, tie=True, vision_inter=3420),
    "qwen2.5-vl-7b": _hub_size(152064, 3584, 18944, 28, 28, 4, tie=False, vision_inter=3420),
    "qwen2.5-vl-32b": _hub_size(152064, 5120, 27648, 64, 40, 8, tie=False, vision_inter=3456),
    "qwen2.5-vl-72b": _hub_size(152064, 8192, 29568, 80, 64, 8, tie=False, vision_inter=3456),
}


def count_params(args: ModelArgs) -> ParamCounts:
    """Parameter counts from the layer shapes of `model` (the tests check them against a built model and the
    hub's totals). Counted, not built: a meta-device build pulls in torch._dynamo (~5 s)."""
    v = args.vision
    w, inter, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size ** 2
    # two norms, qkv and proj (with biases), gate/up/down (with biases)
    vision_block = 2 * w + (w + 1) * 3 * w + (w + 1) * w + 2 * (w + 1) * inter + (inter + 1) * w
    # patch embedding (no bias), merger norm and its two linears: in the root unit
    vision_root = w * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 + \
        w + (merged + 1) * merged + (merged + 1) * v.out_hidden_size
    # the decoder: q/k/v with biases, no q/k norms
    return param_counts(args, vision_block, vision_root, qkv_bias=True, qk_norm=False)


def linear_params(args: ModelArgs) -> LinearParams:
    """The matmul weights a text token and a patch go through (biases and norms left out).
    The merger runs once per merged token, on merge^2 patches: per patch it counts
    merged * (merged + out) / merge^2 = width * (merged + out)."""
    v = args.vision
    block = 4 * v.hidden_size**2 + 3 * v.hidden_size * v.intermediate_size
    merged = v.hidden_size * v.spatial_merge_size**2
    vision = v.depth * block + v.hidden_size * (merged + v.out_hidden_size) + \
        v.in_channels * v.temporal_patch_size * v.patch_size**2 * v.hidden_size
    return LinearParams(decoder_linear_params(args.text), vision)
