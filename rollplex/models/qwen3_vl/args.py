"""Qwen3-VL's shape (the dense models): the args dataclasses, the named sizes (a
tiny one for tests, the hub's 2B, 4B, 8B and 32B) and the parameter counts the
memory plan and FLOP counts read.

Field names are Qwen2.5-VL's wherever the meaning is the same (the rest of
Rollplex reads `text.hidden_size`, `vision.depth`, ... of any family).
`ModelArgs`'s fields besides vision and text, and the decoder's counts, are
rollplex.models.qwen_vl.args's."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollplex.models.family import LinearParams, ParamCounts
from rollplex.models.qwen_vl.args import TINY_TOKEN_IDS, QwenVLArgs, decoder_linear_params, param_counts
from rollplex.models.rope import RopeIndexSpec

# Intermediate-width tensors per patch of a vision block's MLP (ModelFamily.vision_mlp_widths): kept for
# backward, linear_fc1's output (GELU's input) and GELU's output (linear_fc2's input); live at once in a
# forward, the same two.
VISION_MLP_WIDTHS = (2, 2)


@dataclass
class VisionArgs:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 4096
    # The learned position embedding: a square grid of this many entries, resampled to each image's grid.
    num_position_embeddings: int = 2304
    # Vision blocks whose output goes, through a DeepStack merger each, into decoder layers 0, 1, ...
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def position_grid_side(self) -> int:
        return round(self.num_position_embeddings**0.5)


@dataclass
class TextArgs:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128  # explicit: not hidden_size / num_attention_heads (the 4B's is 128, not 80)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144
    hidden_act: str = "silu"


@dataclass
class ModelArgs(QwenVLArgs):
    """Everything the model's shape and inputs depend on; built from a HF config.json
    (the token ids and tie_word_embeddings: `QwenVLArgs`)."""

    vision: VisionArgs = field(default_factory=VisionArgs)
    text: TextArgs = field(default_factory=TextArgs)

    @property
    def rope_spec(self) -> RopeIndexSpec:
        # Every frame group of a video is its own block of t = 1 (timestamps between them), so
        # temporal positions do not follow seconds: tokens_per_second goes unread.
        return RopeIndexSpec(self.image_token_id, self.video_token_id, self.vision.spatial_merge_size,
                             tokens_per_second=1.0, split_video_frames=True)

    @property
    def deepstack_levels(self) -> int:
        return len(self.vision.deepstack_visual_indexes)


def vision_feature_levels(args: ModelArgs) -> int:
    """Feature rows the tower gives each vision token (VisionEmbeds): the merged one and one per DeepStack level."""
    return 1 + args.deepstack_levels


def tiny_args(tie: bool = False, layers: int = 2, deepstack: tuple[int, ...] = (0, 1), depth: int = 3,
              num_position_embeddings: int = 36) -> ModelArgs:
    """A model of a few hundred thousand parameters for tests, with Qwen2.5-VL's tiny
    token ids: vocabulary 100, the vision tokens 90 (image pad), 91 (video pad), 92
    and 93 (vision start and end), eos 94, bos 95. head_dim 24 is not hidden / heads
    (16), as in the 4B, and mrope_section [6, 3, 3] leaves the last frequencies to t
    as [24, 20, 20] does; a 6 x 6 position grid is resampled up and down."""
    return ModelArgs(
        vision=VisionArgs(depth=depth, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                          num_position_embeddings=num_position_embeddings, deepstack_visual_indexes=list(deepstack)),
        text=TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, mrope_section=[6, 3, 3],
                      rope_theta=10000.0, max_position_embeddings=4096),
        tie_word_embeddings=tie, **TINY_TOKEN_IDS)


# The SigLIP-2 towers: the 2B and 4B take a 24-block, 1024-wide one; the 8B and 32B a 27-block, 1152-wide one.
_SMALL_TOWER = dict(depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17])
_LARGE_TOWER = dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24])


def _hub_size(hidden: int, inter: int, layers: int, heads: int, tie: bool, tower: dict) -> ModelArgs:
    text = TextArgs(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=8, head_dim=128)
    return ModelArgs(vision=VisionArgs(**tower, out_hidden_size=hidden), text=text, tie_word_embeddings=tie)


# The hub's config.json values of Qwen/Qwen3-VL-{2B,4B,8B,32B}-Instruct, written from memory (no hub access
# here): the text sizes are the Qwen3 1.7B / 4B / 8B / 32B decoders (vocabulary 151936, 8 KV heads,
# head_dim 128, rope_theta 5e6, mrope_section [24, 20, 20] interleaved, 262144 positions; 2B and 4B tie
# their embeddings). Least sure: the 2B/4B tower (depth 24, width 1024, MLP 4096, DeepStack [5, 11, 17]);
# the 8B/32B tower (27, 1152, 4304, [8, 16, 24]) is also transformers' default. Check against config.json
# before relying on a number. Totals from `count_params`: 2,127,532,032 / 4,437,815,808 / 8,767,123,696 /
# 33,357,390,064 parameters (the model cards' 2.13B / 4.44B / 8.77B / 33.4B, as remembered).
PRESETS: dict[str, ModelArgs] = {
    "qwen3-vl-2b": _hub_size(2048, 6144, 28, 16, tie=True, tower=_SMALL_TOWER),
    "qwen3-vl-4b": _hub_size(2560, 9728, 36, 32, tie=True, tower=_SMALL_TOWER),
    "qwen3-vl-8b": _hub_size(4096, 12288, 36, 32, tie=False, tower=_LARGE_TOWER),
    "qwen3-vl-32b": _hub_size(5120, 25600, 64, 64, tie=False, tower=_LARGE_TOWER),
}


def _merger_params(v: VisionArgs, norm_width: int) -> int:
    """A patch merger: its LayerNorm (weight and bias), linear_fc1 and linear_fc2 (with biases)."""
    merged = v.hidden_size * v.spatial_merge_size**2
    return 2 * norm_width + (merged + 1) * merged + (merged + 1) * v.out_hidden_size


def vision_counts(v: VisionArgs) -> tuple[int, int]:
    """The tower's elements: one block's, and those of its parts in FSDP's root unit (patch
    embedding, learned position grid, main merger, DeepStack mergers)."""
    w, inter = v.hidden_size, v.intermediate_size
    # two LayerNorms (weight and bias), q/k/v and proj, linear_fc1 and linear_fc2, all with biases
    block = 4 * w + 3 * (w + 1) * w + (w + 1) * w + (w + 1) * inter + (inter + 1) * w
    # patch embedding (with bias), position grid, main merger (norm over a patch), DeepStack mergers (norm over a
    # merged token)
    merged = w * v.spatial_merge_size**2
    root = (w * v.in_channels * v.temporal_patch_size * v.patch_size**2 + w) + v.num_position_embeddings * w \
        + _merger_params(v, w) + len(v.deepstack_visual_indexes) * _merger_params(v, merged)
    return block, root


def count_params(args: ModelArgs) -> ParamCounts:
    """Parameter counts from the layer shapes of `model` (the tests check them against a
    built model). Counted, not built: a meta-device build pulls in torch._dynamo (~5 s)."""
    # the decoder: q/k/v without biases, q_norm and k_norm
    return param_counts(args, *vision_counts(args.vision), qkv_bias=False, qk_norm=True)


def vision_linear_params(v: VisionArgs) -> int:
    """The matmul weights a patch goes through (biases, norms and the position-grid lookup
    left out). A merger runs once per merged token, on merge^2 patches: per patch it counts
    merged * (merged + out) / merge^2 = width * (merged + out)."""
    block = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size
    merged = v.hidden_size * v.spatial_merge_size**2
    mergers = (1 + len(v.deepstack_visual_indexes)) * v.hidden_size * (merged + v.out_hidden_size)
    return v.depth * block + mergers + v.in_channels * v.temporal_patch_size * v.patch_size**2 * v.hidden_size


def linear_params(args: ModelArgs) -> LinearParams:
    """The matmul weights a text token and a patch go through (`vision_linear_params`)."""
    return LinearParams(decoder_linear_params(args.text), vision_linear_params(args.vision))
