"""Qwen3-VL (dense) in plain PyTorch: SigLIP-2 style vision tower with DeepStack
mergers, Qwen3 language model, interleaved M-RoPE.

The whole model and the layers it shares with Qwen2.5-VL are
rollplex.models.qwen_vl's (`QwenVL`, and the decoder, RMSNorm, the patch
embedding and the vision attention in `layers`). What is Qwen3-VL's own is here:
- vision tower: LayerNorm and a GELU(tanh) MLP in every block, full attention
  in every block (one segment per image or video frame), a patch embedding with
  a bias, and a learned position grid resampled (bilinearly) to each image's
  grid and added to the patch embeddings, besides the 2D rotary;
- DeepStack: the outputs of some vision blocks (`deepstack_visual_indexes`) go
  through mergers of their own; the decoder adds level i to its hidden states at
  the vision pad tokens after decoder layer i (`Qwen3_VL.layer_additions`);
- decoder settings: Qwen3's attention (no biases, RMSNorm over each head's q and
  k before the rotary, an explicit head_dim) and M-RoPE with interleaved frequencies.

Module names follow the Hugging Face checkpoint (`model.visual.*`,
`model.language_model.*`, `lm_head`), with `visual` and `language_model` at the
top; the key mapping (`hf`) maps both.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.models.inputs import VisionEmbeds, VisionSlots
from rollplex.models.qwen3_vl.args import ModelArgs, VisionArgs
from rollplex.models.qwen_vl import layers
from rollplex.models.qwen_vl.layers import LanguageModel, PatchEmbed, boundaries
from rollplex.models.qwen_vl.model import QwenVL
from rollplex.models.rope import vision_positions, vision_rotary
from rollplex.ops.attention import PackedSegments


def check_acts(args: ModelArgs) -> None:
    if args.text.hidden_act != "silu":
        raise ValueError(f"text hidden_act {args.text.hidden_act!r} is not supported (Qwen3-VL uses silu)")
    if args.vision.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"vision hidden_act {args.vision.hidden_act!r} is not supported "
                         "(Qwen3-VL uses gelu_pytorch_tanh)")


# ----------------------------------------------------------------------------- vision tower


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(layers.VisionBlock):
    """LayerNorm and a GELU(tanh) MLP."""

    def __init__(self, args: VisionArgs):
        super().__init__(args, functools.partial(nn.LayerNorm, eps=1e-6), VisionMLP)


class PatchMerger(nn.Module):
    """Concatenates each m x m block of patch features and projects it to the LM width.
    The main merger normalises each patch before concatenating; a DeepStack merger
    (`norm_merged`) normalises the concatenated row, m^2 times wider. Its GELU is
    the exact (erf) one, unlike the blocks'."""

    def __init__(self, args: VisionArgs, norm_merged: bool):
        super().__init__()
        self.merged_dim = args.hidden_size * args.spatial_merge_size**2
        self.norm_merged = norm_merged
        self.norm = nn.LayerNorm(self.merged_dim if norm_merged else args.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_dim, args.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.norm_merged else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def position_grid_taps(grid_thw: list[list[int]], args: VisionArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling of the learned (side x side) position grid to each image's
    (h, w) patch grid, corners aligned (grid row 0 and side - 1 land on patch rows 0
    and h - 1): per patch, in the processor's patch order (`vision_positions`: m x m
    merge blocks, row-major; every video frame repeats its image's), the 4 grid
    entries it reads (patches, 4) and their weights (patches, 4) float32. On the host."""
    side = args.position_grid_side
    grids = torch.tensor(grid_thw, dtype=torch.long).reshape(-1, 3)
    rows, cols = vision_positions(grids, args.spatial_merge_size).unbind(-1)
    counts = grids.prod(-1)
    heights, widths = grids[:, 1].repeat_interleave(counts), grids[:, 2].repeat_interleave(counts)

    def taps(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        source = index.float() * (side - 1) / (size - 1).clamp(min=1)  # patch index -> grid coordinate
        low = source.floor()
        frac = source - low
        low = low.long()
        return low, (low + 1).clamp(max=side - 1), frac

    r0, r1, fr = taps(rows, heights)
    c0, c1, fc = taps(cols, widths)
    index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=-1)
    weight = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=-1)
    return index, weight


class VisionPlan:
    """What one tower forward reads besides its pixels and weights, on the model's
    device: the position-grid taps and weights of every patch, the rotary tables,
    and the attention (one segment per image / video frame). Built by
    `VisionTransformer.plan`, which reads the grids on the host; the forward that
    takes it then waits on nothing. A plain class, not a dataclass: FSDP2 rebuilds
    (and casts) dataclass arguments of a module call."""

    def __init__(self, grid_index: torch.Tensor, grid_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attention: PackedSegments):
        self.grid_index, self.grid_weight = grid_index, grid_weight
        self.cos, self.sin = cos, sin
        self.attention = attention


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        if args.position_grid_side**2 != args.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {args.num_position_embeddings} is not a square grid")
        self.args = args
        self.patch_embed = PatchEmbed(args, bias=True)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args, norm_merged=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(args, norm_merged=True)
                                                   for _ in args.deepstack_visual_indexes)
        # vision block index -> its DeepStack merger (the i-th of deepstack_visual_indexes takes the i-th merger)
        self.deepstack_merger_of = {block: i for i, block in enumerate(args.deepstack_visual_indexes)}
        self.attn_backend = "torch"

    def plan(self, grid_thw: torch.Tensor, device: torch.device) -> VisionPlan:
        """The `VisionPlan` of images or videos of grids `grid_thw` (n, 3), on `device`.
        Reads the grids on the host and builds every table there, then copies each over."""
        args = self.args
        grids = grid_thw.tolist()
        index, weight = position_grid_taps(grids, args)
        positions = vision_positions(torch.tensor(grids, dtype=torch.long).reshape(-1, 3), args.spatial_merge_size)
        cos, sin = vision_rotary(positions, args.hidden_size // args.num_heads, args.rope_theta)
        frames = boundaries([h * w for t, h, w in grids for _ in range(t)])
        return VisionPlan(index.to(device), weight.to(device), cos.to(device), sin.to(device),
                          PackedSegments(frames, False, self.attn_backend, device))

    def forward(self, pixels: torch.Tensor, plan: VisionPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pixels (patches, C*T*P*P) as the processor returns them, with the plan of their
        grids -> merged embeddings (patches / merge^2, out_hidden_size) and the DeepStack
        levels (levels, patches / merge^2, out_hidden_size), or None without any; both in
        input order. Level i is the merged output of the i-th DeepStack block counted in
        block order; the decoder adds it after its layer i."""
        x = self.patch_embed(pixels)
        # Resampled grid: a weighted sum of 4 entries per patch, in float32 (the weights' dtype).
        grid = (self.pos_embed(plan.grid_index) * plan.grid_weight[..., None]).sum(1)
        x = x + grid.to(x.dtype)
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.attention)
            if i in self.deepstack_merger_of:
                # Levels go in block order whatever the order of the indexes (as transformers stacks them).
                levels.append(self.deepstack_merger_list[self.deepstack_merger_of[i]](x))
        return self.merger(x), torch.stack(levels) if levels else None


# ----------------------------------------------------------------------------- the whole model


class DeepStack:
    """Where a packed input's DeepStack features go: token rows (n,) and the features
    (levels, n, hidden) to add there, level i after decoder layer i (images' rows and
    levels, then videos')."""

    def __init__(self, rows: torch.Tensor, levels: torch.Tensor):
        self.rows, self.levels = rows, levels

    def __call__(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The hidden state after decoder layer `layer` with its level added (levels past the last one add nothing)."""
        if layer >= self.levels.shape[0]:
            return h
        # Out of place, so autograd keeps both h's graph and the features' (into the tower).
        return h.index_add(0, self.rows, self.levels[layer].to(h.dtype))


class Qwen3_VL(QwenVL):
    """Qwen3-VL (dense) for causal LM: rollplex.models.qwen_vl's `QwenVL` with Qwen3-VL's
    tower, the Qwen3 decoder, and the DeepStack levels, which the tower gives besides
    the merged features and the decoder adds after its first layers."""

    def __init__(self, args: ModelArgs):
        check_acts(args)
        super().__init__(args, VisionTransformer(args.vision),
                         LanguageModel(args.text, qkv_bias=False, qk_norm=True,
                                       interleaved_mrope=args.text.mrope_interleaved))

    def vision_embeds(self, image: Any, video: Any) -> VisionEmbeds:
        """Each kind's tower output is its merged features and its DeepStack levels (or None)."""
        (image, image_deepstack), (video, video_deepstack) = ((None, None) if out is None else out
                                                              for out in (image, video))
        return VisionEmbeds(image, video, image_deepstack, video_deepstack)

    def layer_additions(self, vision: VisionEmbeds | None, slots: VisionSlots | None) -> DeepStack | None:
        """DeepStack: the levels of `vision` and the token rows they go to, image levels at
        the image slots, video levels at the video slots; the decoder adds level i after
        its layer i. None when there is nothing to add. Reads shapes only (no host sync)."""
        if vision is None or slots is None:
            return None
        parts = [(rows, levels) for name, rows, levels in (("image", slots.image, vision.image_deepstack),
                                                            ("video", slots.video, vision.video_deepstack))
                 if levels is not None and _check_deepstack(name, rows, levels)]
        if not parts:
            return None
        if len(parts) == 1:
            return DeepStack(*parts[0])
        (image_rows, image_levels), (video_rows, video_levels) = parts
        if image_levels.shape[0] != video_levels.shape[0]:
            raise ValueError(f"image and video DeepStack levels disagree: {image_levels.shape[0]} and "
                             f"{video_levels.shape[0]}")
        return DeepStack(torch.cat([image_rows, video_rows]), torch.cat([image_levels, video_levels], dim=1))


def _check_deepstack(name: str, rows: torch.Tensor, levels: torch.Tensor) -> bool:
    """Whether a kind's DeepStack levels have rows to go to; a count that differs from
    its slots' is an error (as for the main features, see `Qwen3_VL.embed`)."""
    if levels.ndim != 3 or levels.shape[1] != rows.shape[0]:
        raise ValueError(f"{name} DeepStack levels of shape {tuple(levels.shape)} do not match the input's "
                         f"{rows.shape[0]} {name} pad tokens: expected (levels, {rows.shape[0]}, hidden)")
    return rows.shape[0] > 0 and levels.shape[0] > 0

