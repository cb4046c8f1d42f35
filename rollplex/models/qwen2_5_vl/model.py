"""Qwen2.5-VL in plain PyTorch: vision tower, Qwen2 language model, M-RoPE.

No parallelism and no scheduling in here. The same module serves the trainer's
packed forward, the engine's prefill and decode, and the shared-prefix passes:
attention goes through the `AttentionBackend` the caller passes in
(rollplex.ops.attention), and tensor/data parallelism is applied from outside
(its plan in `tp_plan`, applied by rollplex.train.parallelize). Head counts are
read off the weight shapes at run time (`view(T, -1, head_dim)`), so a
TP-sharded module runs unchanged.

Module names follow the Hugging Face checkpoint (`visual.*`, `model.*`,
`lm_head`), with `language_model` standing for the hub's `model.` prefix; the
key mapping (`hf`) maps both naming styles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from rollplex.dist import local_tensor
from rollplex.models.inputs import VisionEmbeds, VisionSlots
from rollplex.models.packing import PackedBatch, pack_padded
from rollplex.models.protocol import fsdp_entry
from rollplex.models.qwen2_5_vl.args import ModelArgs, TextArgs, VisionArgs
from rollplex.models.rope import MRotaryEmbedding, apply_rotary, vision_positions, vision_rotary
from rollplex.ops.attention import (AttentionBackend, PackedSegments, SharedPrefixAttention, VarlenAttention,
                                    resolve_backend)


def _check_act(act: str) -> None:
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (Qwen2.5-VL uses silu)")


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as Qwen2 does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- vision tower


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over (temporal, patch, patch) blocks. The
    processor already cut pixels into flattened blocks, so the convolution is a
    matmul with the flattened kernel (same weights, same math, no conv call)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        k = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    """The hub checkpoint fuses q, k and v into one `qkv` Linear; here they are three,
    so that tensor parallelism can split each by heads (the loader splits and re-fuses)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.head_dim = args.hidden_size // args.num_heads
        self.q = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.k = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.v = nn.Linear(args.hidden_size, args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: PackedSegments) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = (proj(x).view(T, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        # Vision rotary is applied in float32 (as the reference does), then cast back.
        q = apply_rotary(q.float(), cos, sin).to(v.dtype)
        k = apply_rotary(k.float(), cos, sin).to(v.dtype)
        return self.proj(attn(q, k, v).reshape(T, -1))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size)
        self.norm2 = RMSNorm(args.hidden_size)
        self.attn = VisionAttention(args)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, bias=True)

    def forward(self, x, cos, sin, attn):
        x = x + self.attn(self.norm1(x), cos, sin, attn)
        return x + self.mlp(self.norm2(x))


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
    return VisionLayout(window_index, _cu(window_lengths), _cu(frame_lengths))


def _cu(lengths: list[int]) -> list[int]:
    return [0, *itertools.accumulate(lengths)]


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
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)
        self.attn_backend = "torch"

    def plan(self, grid_thw: torch.Tensor) -> VisionPlan:
        """The `VisionPlan` of images or videos of grids `grid_thw` (n, 3), on the
        grids' device. Reads the grids on the host."""
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


# ----------------------------------------------------------------------------- language model


class Attention(nn.Module):
    def __init__(self, args: TextArgs, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_attention_heads * args.head_dim, bias=True)
        self.k_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=True)
        self.v_proj = nn.Linear(args.hidden_size, args.num_key_value_heads * args.head_dim, bias=True)
        self.o_proj = nn.Linear(args.num_attention_heads * args.head_dim, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(T, -1, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(T, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        return self.o_proj(attn(self.layer, q, k, v).reshape(T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, args: TextArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size, bias=False)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LanguageModel(nn.Module):
    def __init__(self, args: TextArgs):
        super().__init__()
        _check_act(args.hidden_act)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = MRotaryEmbedding(args.head_dim, args.rope_theta, args.mrope_section)

    def forward(self, h: torch.Tensor, position_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend) -> torch.Tensor:
        for h in self.layer_by_layer(h, position_ids, attn):
            pass
        return h

    def layer_by_layer(self, h: torch.Tensor, position_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                       attn: AttentionBackend) -> Iterator[torch.Tensor]:
        """The forward one decoder layer at a time: yields the hidden state after
        each layer, then the final normed state. The prefix scheduler
        (rollplex.rl.prefix) advances it between two decode steps of the engine.
        position_ids (3, T), or the rotary cos, sin (T, head_dim) they give, read off
        `rotary.text_table` by the engine's decode steps."""
        cos, sin = position_ids if isinstance(position_ids, tuple) else self.rotary(position_ids, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
            yield h
        yield self.norm(h)


# ----------------------------------------------------------------------------- the whole model


class VisionInputs:
    """What the vision tower reads for a batch's images and videos, on the
    model's device: each kind's pixels and `VisionPlan`, or None
    (`Qwen2_5_VL.prepare_vision` makes it). A plain class, not a dataclass: FSDP2
    would rebuild it, casting its pixels and rotary tables, at the model's entry."""

    def __init__(self, image: tuple[torch.Tensor, VisionPlan] | None = None,
                 video: tuple[torch.Tensor, VisionPlan] | None = None):
        self.image, self.video = image, video


class Qwen2_5_VL(nn.Module):
    """Qwen2.5-VL for causal LM.

    Main forward: packed tokens (no padding) -> final hidden states. Logits are a
    separate step (`logits`), so that callers who need only a few positions
    (decode) or per-token logprobs in chunks (training) never build the full
    (tokens, vocab) tensor at once.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.visual = VisionTransformer(args.vision)
        self.language_model = LanguageModel(args.text)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.text.hidden_size, args.text.vocab_size,
                                                                       bias=False)
        self.attn_backend = "torch"

    def set_attn_backend(self, name: str) -> None:
        """auto / torch / flash, resolved for the model's device."""
        self.attn_backend = self.visual.attn_backend = resolve_backend(name, self.device)

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def text_rotary_table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos | sin (num_positions, 2 * head_dim) of text positions 0, 1, ...: decode steps read its rows."""
        return self.language_model.rotary.text_table(num_positions, device, dtype)

    def decoder_stages(self) -> dict[str, nn.Module]:
        """The text decoder's modules in order, by name ("embedding", "decoder layer i", "final norm")."""
        lm = self.language_model
        return {"embedding": lm.embed_tokens, **{f"decoder layer {i}": layer for i, layer in enumerate(lm.layers)},
                "final norm": lm.norm}

    def encode_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                      pixel_values_videos: torch.Tensor | None = None,
                      video_grid_thw: torch.Tensor | None = None) -> VisionEmbeds:
        """Run the vision tower on a prompt's (or batch's) images and videos,
        wherever they are (they are moved to the model's device)."""
        return self.encode_prepared(self.prepare_vision(pixel_values, image_grid_thw, pixel_values_videos,
                                                        video_grid_thw))

    def prepare_vision(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                       pixel_values_videos: torch.Tensor | None = None,
                       video_grid_thw: torch.Tensor | None = None) -> VisionInputs:
        """The first half of `encode_vision`: checks the inputs and builds every
        device tensor the tower reads (host reads and host-to-device copies), so
        that `encode_prepared` issues none."""
        inputs = VisionInputs()
        if pixel_values is not None:
            check_pixels(pixel_values, image_grid_thw, self.args.vision, "image")
            inputs.image = (pixel_values.to(self.device), self.visual.plan(image_grid_thw.to(self.device)))
        if pixel_values_videos is not None:
            check_pixels(pixel_values_videos, video_grid_thw, self.args.vision, "video")
            inputs.video = (pixel_values_videos.to(self.device), self.visual.plan(video_grid_thw.to(self.device)))
        return inputs

    @fsdp_entry
    def encode_prepared(self, inputs: VisionInputs) -> VisionEmbeds:
        """The vision tower on inputs from `prepare_vision`."""
        return VisionEmbeds(*(None if kind is None else self.visual(*kind) for kind in (inputs.image, inputs.video)))

    def embed(self, input_ids: torch.Tensor, vision: VisionEmbeds | None = None,
              prompt_mask: torch.Tensor | None = None, slots: VisionSlots | None = None) -> torch.Tensor:
        """Token embeddings with vision features written at their pad tokens.

        Only prompt tokens carry vision features: a pad token id that a policy
        *generated* is embedded as plain text. `prompt_mask` (T,) marks the prompt
        tokens; None means every token is part of a prompt. The slots are found
        here (reading the ids on the host) unless given (`VisionSlots.find`).
        """
        h = self.language_model.embed_tokens(input_ids)
        if slots is None:
            slots = VisionSlots.find(self.args, input_ids, prompt_mask)
        for name, rows, feats in (("image", slots.image, vision.image if vision else None),
                                  ("video", slots.video, vision.video if vision else None)):
            n_tokens = rows.shape[0]
            n_feats = 0 if feats is None else feats.shape[0]
            if n_tokens != n_feats:
                raise ValueError(
                    f"{name} features and {name} pad tokens disagree: {n_tokens} <|{name}_pad|> tokens in the input "
                    f"but {n_feats} {name} feature rows (from the {name} grids). A prompt truncated through an "
                    f"{name}, or a grid that does not belong to this prompt, causes this."
                )
            if n_feats:
                h = h.index_copy(0, rows, feats.to(h.dtype))
        return h

    @fsdp_entry
    def embed_prompts(self, input_ids: torch.Tensor, vision: VisionEmbeds | None,
                      slots: VisionSlots) -> torch.Tensor:
        """`embed` as an entry of its own (FSDP2 gathers the root's parameters
        there, see `fsdp_entry`): a prompt forward
        (rollplex.train.kept_prefix) may start here, with cached vision features,
        and its last slice reads the root's final norm."""
        return self.embed(input_ids, vision, slots=slots)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attn: AttentionBackend,
                vision: VisionEmbeds | None = None, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (T,) packed, position_ids (3, T) -> final hidden states (T, hidden)."""
        return self.language_model(self.embed(input_ids, vision, prompt_mask), position_ids, attn)

    def layer_by_layer(self, h: torch.Tensor, position_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                       attn: AttentionBackend, vision: VisionEmbeds | None = None,
                       slots: VisionSlots | None = None) -> Iterator[torch.Tensor]:
        """`LanguageModel.layer_by_layer` of embedded tokens `h` (see `embed_prompts`);
        Qwen2.5-VL adds no vision features inside the decoder, so `vision` and `slots` go unread."""
        return self.language_model.layer_by_layer(h, position_ids, attn)

    def kv_heads_per_rank(self) -> int:
        """The KV heads of this rank's attention layers, read off k_proj's rows: under
        tensor parallelism it holds this rank's heads only."""
        weight = self.language_model.layers[0].self_attn.k_proj.weight
        return local_tensor(weight).shape[0] // self.args.text.head_dim

    @fsdp_entry
    def forward_generated(self, input_ids: torch.Tensor,
                          position_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                          attn: AttentionBackend) -> torch.Tensor:
        """Forward of generated tokens only (decode): plain embeddings, no vision
        bookkeeping and no host synchronisation, so it can run in a CUDA graph.
        position_ids as `LanguageModel.layer_by_layer` takes them."""
        return self.language_model(self.language_model.embed_tokens(input_ids), position_ids, attn)

    @fsdp_entry
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.language_model.embed_tokens.weight)
        return self.lm_head(hidden)  # through the module, so a parallel plan's hooks apply

    def forward_packed(self, batch: PackedBatch, vision: VisionEmbeds | None = None) -> torch.Tensor:
        """Hidden states of a packed batch; encodes its images/videos unless `vision` is given."""
        if vision is None:
            vision = self.encode_vision(batch.pixel_values, batch.image_grid_thw, batch.pixel_values_videos,
                                        batch.video_grid_thw)
        if batch.groups is not None:
            attn = SharedPrefixAttention(batch.groups, self.attn_backend)
        else:
            attn = VarlenAttention(batch.cu_seqlens, batch.max_seqlen, causal=True, backend=self.attn_backend)
        return self(batch.input_ids, batch.position_ids, attn, vision, batch.prompt_mask)

    @torch.no_grad()
    def hf_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                   pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                   second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, L, vocab) for exactly what the transformers processor returns
        for a left- or right-padded batch. Pad positions get zero logits."""
        batch = pack_padded(self.args, input_ids, attention_mask, pixel_values, image_grid_thw,
                            pixel_values_videos, video_grid_thw, second_per_grid_ts)
        logits = self.logits(self.forward_packed(batch))
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        out[mask] = logits
        return out


def check_pixels(pixels: torch.Tensor, grid_thw: torch.Tensor | None, args: VisionArgs, kind: str) -> None:
    if grid_thw is None:
        raise ValueError(f"{kind} pixels were given without their {kind}_grid_thw")
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"{kind}_grid_thw must have shape (n, 3), got {tuple(grid_thw.shape)}")
    patches = int(grid_thw.prod(-1).sum())
    row = args.in_channels * args.temporal_patch_size * args.patch_size**2
    if pixels.ndim != 2 or pixels.shape[0] != patches or pixels.shape[1] != row:
        raise ValueError(
            f"{kind} pixel tensor of shape {tuple(pixels.shape)} does not match its grids "
            f"{grid_thw.tolist()}: expected ({patches}, {row})"
        )
    m = args.spatial_merge_size
    if bool(((grid_thw[:, 1:] % m) != 0).any()):
        raise ValueError(f"{kind} grid {grid_thw.tolist()} has a height or width not divisible by the merge size {m}")
