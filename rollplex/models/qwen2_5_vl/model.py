"""Qwen2.5-VL in plain PyTorch: vision tower with windowed attention, the Qwen2
language model, M-RoPE.

The whole model and the layers it shares with Qwen3-VL are
rollplex.models.qwen_vl's (`QwenVL`, and the decoder, RMSNorm, SwiGLU, the patch
embedding and the vision attention in `layers`). What is Qwen2.5-VL's own is
here: its vision tower (RMSNorm and a biased SwiGLU in every block, windowed
attention in all blocks but `fullatt_block_indexes`, patches reordered so that
each window is contiguous), its patch merger, and the decoder's settings:
biased q/k/v, no q/k norms, plain (not interleaved) M-RoPE.

Module names follow the Hugging Face checkpoint (`visual.*`, `model.*`,
`lm_head`), with `language_model` standing for the hub's `model.` prefix; the
key mapping (`hf`) maps both naming styles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.models.qwen2_5_vl.args import ModelArgs, VisionArgs
from rollplex.models.qwen_vl import layers
from rollplex.models.qwen_vl.layers import LanguageModel, PatchEmbed, RMSNorm, SwiGLU, boundaries
from rollplex.models.qwen_vl.model import QwenVL
from rollplex.models.rope import vision_positions, vision_rotary
from rollplex.ops.attention import PackedSegments


def _check_act(act: str) -> None:
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Qwen2.5-VL uses silu)")


# ----------------------------------------------------------------------------- vision tower


class VisionBlock(layers.VisionBlock):
    """RMSNorm and a SwiGLU MLP with biases."""

    def __init__(self, args: VisionArgs):
        super().__init__(args, RMSNorm, lambda a: SwiGLU(a.hidden_size, a.intermediate_size, bias=True))


class PatchMerger(nn.Module):
    """Concatenates each m x m block of patch features and projects it to the LM width."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.merged_dim = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 nn.Linear(self.merged_dim, args.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


@dataclass
class VisionLayout:
    """Index bookkeeping of one vision forward: patches reordered so every
    attention window is contiguous, and the window / full-attention segments."""

    window_index: torch.Tensor  # merged-token order with windows contiguous
    cu_window: list[int]  # patch boundaries of the windows, in that order
    cu_full: list[int]  # one segment per image / video frame


def vision_layout(grid_thw: torch.Tensor, args: VisionArgs) -> VisionLayout:
    merge = args.spatial_merge_size
    unit = merge * merge
    win = args.window_size // merge // args.patch_size  # window side in merged tokens
    index, window_lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = -(-gh // win), -(-gw // win)
        padded = F.pad(ids, (0, nw * win - gw, 0, nh * win - gh), value=-1)
        windows = padded.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
        members = windows >= 0
        index.append(windows[members] + offset)
        sizes = members.sum(1)
        window_lengths += (sizes[sizes > 0] * unit).tolist()  # windows fully in the padding hold nothing
        offset += t * gh * gw
    window_index = torch.cat(index).to(grid_thw.device)
    frame_lengths = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
    return VisionLayout(window_index, boundaries(window_lengths), boundaries(frame_lengths))


class VisionPlan:
    """What one tower forward reads besides its pixels and weights, on the
    model's device: the window order of the merged tokens and its inverse, the
    rotary tables in that order, and the windowed and full attention. Built by
    `VisionTransformer.plan`, which reads the grids on the host; the forward that
    takes it then waits on nothing. A plain class, not a dataclass: FSDP2 rebuilds
    (and casts) dataclass arguments of a module call."""

    def __init__(self, window_index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 window_attention: PackedSegments, full_attention: PackedSegments):
        self.window_index = window_index
        self.restore_index = torch.empty_like(window_index)
        self.restore_index[window_index] = torch.arange(window_index.numel(), device=window_index.device)
        self.cos, self.sin = cos, sin
        self.window_attention, self.full_attention = window_attention, full_attention


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        _check_act(args.hidden_act)
        self.args = args
        self.patch_embed = PatchEmbed(args, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)
        self.attn_backend = "torch"

    def plan(self, grid_thw: torch.Tensor, device: torch.device | None = None) -> VisionPlan:
        """The `VisionPlan` of images or videos of grids `grid_thw` (n, 3), on `device`
        (the grids' own when None). Reads the grids on the host."""
        if device is not None:
            grid_thw = grid_thw.to(device)
        args = self.args
        layout = vision_layout(grid_thw, args)
        # Positions are put in window order before the tables are computed: 2 ints a patch to gather, not 2 tables.
        positions = self._windowed(vision_positions(grid_thw, args.spatial_merge_size), layout.window_index)
        cos, sin = vision_rotary(positions, args.hidden_size // args.num_heads, args.rope_theta)
        device = grid_thw.device
        return VisionPlan(layout.window_index, cos, sin,
                          PackedSegments(layout.cu_window, False, self.attn_backend, device),
                          PackedSegments(layout.cu_full, False, self.attn_backend, device))

    def forward(self, pixels: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        """pixels (patches, C*T*P*P) as the processor returns them, with the plan
        of their grids -> merged embeddings (patches / merge^2, out_hidden_size), in
        input order."""
        x = self._windowed(self.patch_embed(pixels), plan.window_index)
        for i, block in enumerate(self.blocks):
            full = i in self.args.fullatt_block_indexes
            x = block(x, plan.cos, plan.sin, plan.full_attention if full else plan.window_attention)
        return self.merger(x)[plan.restore_index]

    def _windowed(self, t: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        """Per-patch rows with the m*m patches of a merged token together, merged tokens in window order."""
        unit = self.args.spatial_merge_size**2
        return t.view(-1, unit, t.shape[-1])[window_index].view(-1, t.shape[-1])


# ----------------------------------------------------------------------------- the whole model


class Qwen2_5_VL(QwenVL):
    """Qwen2.5-VL for causal LM: rollplex.models.qwen_vl's `QwenVL` with Qwen2.5-VL's
    tower and the Qwen2 decoder; nothing is added inside the decoder."""

    def __init__(self, args: ModelArgs):
        visual = VisionTransformer(args.vision)
        _check_act(args.text.hidden_act)
        super().__init__(args, visual, LanguageModel(args.text, qkv_bias=True, qk_norm=False))
