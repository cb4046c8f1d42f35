"""Rotary position embeddings of the Qwen VL families.

Two kinds:
- multimodal RoPE (M-RoPE) for the language model: every token has three
  position ids (temporal, height, width). Text tokens use the same id on all
  three axes; vision tokens use their grid coordinates. Qwen2.5-VL splits the
  rotary frequencies into `mrope_section` chunks, chunk i rotated by axis i;
  Qwen3-VL interleaves them (frequency j takes axis j % 3, while that axis has
  frequencies left), so every axis spans low and high frequencies.
- 2D rotary for the vision tower: each patch rotated by its (row, column).

Inverse frequencies are always computed in float32 and kept outside the
module's buffers, so casting the model to bf16 never rounds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_frequencies(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """1 / theta^(2i/dim) for i < dim/2, in float32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


class MRotaryEmbedding:
    """cos/sin tables of M-RoPE for given (3, tokens) position ids.

    A plain object, not an nn.Module: it holds no parameters and must not be
    cast with the model.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: list[int], interleaved: bool = False):
        if 2 * sum(mrope_section) != head_dim:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        self.head_dim, self.theta, self.mrope_section = head_dim, theta, list(mrope_section)
        self.interleaved = interleaved
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._axes: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = inv_frequencies(self.head_dim, self.theta, device)
        return self._inv_freq[device]

    def frequency_axes(self, device: torch.device) -> torch.Tensor:
        """(head_dim/2,) the position axis (0 t, 1 h, 2 w) each interleaved frequency
        rotates by: frequency j takes axis 1 when j % 3 == 1 and j < 3 * section[1],
        axis 2 when j % 3 == 2 and j < 3 * section[2], else axis 0 (Qwen3-VL's layout:
        [24, 20, 20] gives t, h, w, t, h, w, ..., then t for the last four)."""
        if device not in self._axes:
            j = torch.arange(self.head_dim // 2)
            axes = torch.zeros_like(j)
            for axis in (1, 2):
                axes[(j % 3 == axis) & (j < 3 * self.mrope_section[axis])] = axis
            self._axes[device] = axes.to(device)
        return self._axes[device]

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids (3, T) -> cos, sin of shape (T, head_dim) in `dtype`."""
        freqs = position_ids[..., None].float() * self.inv_freq(position_ids.device)  # (3, T, D/2)
        if self.interleaved:
            # Each frequency picks its axis's angle (a selection: the same products as the chunked layout).
            axes = self.frequency_axes(position_ids.device)
            freqs = torch.where(axes == 1, freqs[1], torch.where(axes == 2, freqs[2], freqs[0]))
        else:
            # Chunk i of the frequency axis takes its angle from axis i % 3 (t, h, w).
            freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(freqs.split(self.mrope_section, dim=-1))],
                              dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def text_table(self, num_positions: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """cos | sin (num_positions, 2 * head_dim) of text positions 0, 1, ... (the same on
        all three axes), the values this object gives them: generated tokens are text,
        so a decode step can read its rows instead of computing the trig again. With the
        three axes equal, which axis a frequency takes does not matter: chunked and
        interleaved layouts give the same table, that of plain 1D RoPE."""
        return torch.cat(self(torch.arange(num_positions, device=device).expand(3, -1), dtype), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D), cos/sin (T, D)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D), cos/sin (T, R) with R <= D: the first R dims of each head rotate,
    the rest pass through (Qwen3.5's partial_rotary_factor)."""
    rotary_dim = cos.shape[-1]
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def vision_positions(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(patches, 2) (row, column) of the vision tower's patches, in the processor's
    patch order (spatial-merge blocks of m x m patches, row-major); every frame of
    a video repeats its image's positions."""
    device = grid_thw.device
    rows = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        block = (h // spatial_merge_size, spatial_merge_size, w // spatial_merge_size, spatial_merge_size)
        hpos = hpos.reshape(block).transpose(1, 2).flatten()
        wpos = wpos.reshape(block).transpose(1, 2).flatten()
        rows.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    return torch.cat(rows)


def vision_rotary(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (patches, head_dim) in float32 of patches at `positions` (patches, 2)
    (`vision_positions`, in any order). Half of the rotary dims rotate by the patch
    row, half by the column."""
    inv_freq = inv_frequencies(head_dim // 2, theta, positions.device)  # (head_dim/4,)
    freqs = (positions[..., None].float() * inv_freq).flatten(1)  # (patches, head_dim/2): [row freqs | col freqs]
    cos, sin = freqs.cos(), freqs.sin()  # each half of the table repeats: take the trig once
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


@dataclass(frozen=True)
class RopeIndexSpec:
    """The config values M-RoPE position ids depend on.

    `split_video_frames`: each temporal patch (frame group) of a video is a block
    of its own, of grid (1, h, w), as Qwen3-VL lays videos out (its processor writes
    a timestamp and a vision start/end around every frame group, so text lies
    between them); `tokens_per_second` and the seconds per grid then go unread.
    False (Qwen2.5-VL): a video is one block whose temporal positions follow time."""

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    tokens_per_second: float
    split_video_frames: bool = False


def mrope_positions(
    input_ids: torch.Tensor,
    spec: RopeIndexSpec,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """M-RoPE position ids (3, L) of one unpadded sequence, and its rope delta.

    Text tokens count up by one on all three axes. An image or video takes its
    grid coordinates (after spatial merging) offset by the position where it
    starts; a video's temporal coordinate is frame-group index x
    `second_per_grid_t * tokens_per_second`, so positions follow real time.
    Text after a vision block continues from the largest position so far + 1,
    as the reference Qwen2.5-VL implementation (and vLLM) do.

    The rope delta is (largest position + 1) - L: a token generated at index
    L + i (0-based, after the prompt) gets position L + i + delta on all axes
    (`generated_positions`).

    `image_grid_thw` / `video_grid_thw` hold the grids of this sequence's images
    and videos in order; a mismatch between pad tokens and grids is an error.

    With `spec.split_video_frames` (Qwen3-VL), every frame group of a video is a
    block of t = 1 of its own (its pad run follows the previous one's timestamp
    text), and a block's text continues from its start + max(h, w) / merge, which
    is the rule above for t = 1.
    """
    ids = input_ids.tolist()
    merge, device = spec.spatial_merge_size, input_ids.device
    blocks = _blocks(spec, image_grid_thw, video_grid_thw, second_per_grid_ts)
    used = {spec.image_token_id: 0, spec.video_token_id: 0}
    chunks: list[torch.Tensor] = []
    next_pos, i, text_start = 0, 0, 0

    def flush_text(end: int) -> None:
        nonlocal next_pos
        if end > text_start:
            chunks.append(torch.arange(next_pos, next_pos + end - text_start, device=device).expand(3, -1))
            next_pos += end - text_start

    while i < len(ids):
        tok = ids[i]
        if tok not in blocks:
            i += 1
            continue
        flush_text(i)
        t, h, w, interval = _next_block(spec, blocks, used, tok)
        gh, gw = h // merge, w // merge
        n_tokens = t * gh * gw
        if ids[i:i + n_tokens] != [tok] * n_tokens:
            kind = "image" if tok == spec.image_token_id else "video"
            name = "video frame group" if spec.split_video_frames and kind == "video" else kind
            raise ValueError(
                f"{name} {used[tok] - 1} has grid (t={t}, h={h}, w={w}) = {n_tokens} tokens after merging, but the "
                f"sequence holds {_run_length(ids, i, tok)} {kind} pad tokens there (was the prompt truncated "
                f"through the {kind}?)")
        tpos = (torch.arange(t, device=device) * interval).long()
        grid = torch.stack(torch.meshgrid(tpos, torch.arange(gh, device=device), torch.arange(gw, device=device),
                                          indexing="ij")).reshape(3, -1)
        chunks.append(grid + next_pos)
        next_pos = int(chunks[-1].max()) + 1
        i += n_tokens
        text_start = i
    flush_text(len(ids))
    _check_all_used(spec, blocks, used)
    positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long, device=device)
    return positions, next_pos - len(ids)


# A vision block as positions see it: (t, h, w) and the temporal step between its frame groups, or None where
# a video's seconds per frame group are missing.
_Block = tuple[int, int, int, float | None]


def _blocks(spec: RopeIndexSpec, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
            second_per_grid_ts: torch.Tensor | list[float] | None) -> dict[int, list[_Block]]:
    """The sequence's vision blocks in order, by pad token: its images, and its videos, or
    with `spec.split_video_frames` each video's frame groups as blocks of t = 1."""
    videos = _grid_list(video_grid_thw)
    if spec.split_video_frames:
        video_blocks = [(1, h, w, 0.0) for t, h, w in videos for _ in range(t)]
    else:
        seconds = [float(s) for s in (second_per_grid_ts if second_per_grid_ts is not None else [])]
        video_blocks = [(t, h, w, None if seconds and k >= len(seconds) else
                         (seconds[k] if seconds else 1.0) * spec.tokens_per_second)
                        for k, (t, h, w) in enumerate(videos)]
    images = [(t, h, w, 0.0) for t, h, w in _grid_list(image_grid_thw)]
    return {spec.image_token_id: images, spec.video_token_id: video_blocks}


def _next_block(spec: RopeIndexSpec, blocks: dict[int, list[_Block]], used: dict[int, int], tok: int) -> _Block:
    """The next unused block of pad token `tok` (counted in `used`); an error when none is left."""
    kind, k = ("image" if tok == spec.image_token_id else "video"), used[tok]
    if k >= len(blocks[tok]):
        if spec.split_video_frames and kind == "video":
            raise ValueError(f"the sequence has more video blocks than the video grids' {len(blocks[tok])} frame "
                             f"groups (each frame group is a block of its own)")
        raise ValueError(f"the sequence has more {kind} blocks than {kind} grids ({len(blocks[tok])} given)")
    used[tok] += 1
    t, h, w, interval = blocks[tok][k]
    if interval is None:
        raise ValueError(f"second_per_grid_ts has {k} entries for more videos")
    return t, h, w, interval


def _check_all_used(spec: RopeIndexSpec, blocks: dict[int, list[_Block]], used: dict[int, int]) -> None:
    for tok, name in ((spec.image_token_id, "image"), (spec.video_token_id, "video")):
        if used[tok] != len(blocks[tok]):
            given = f"{len(blocks[tok])} {name} grids given"
            if spec.split_video_frames and name == "video":
                given = f"the video grids hold {len(blocks[tok])} frame groups (each a block of its own)"
            raise ValueError(f"{given} but the sequence holds {used[tok]} {name} blocks")


def generated_positions(start: int, end: int, rope_delta: int,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """M-RoPE positions (3, end - start) of the tokens at indices [start, end)
    after a prompt whose rope delta is `rope_delta`: generated tokens are text,
    so each one's position is its index + the delta, the same on all three axes."""
    return (torch.arange(start, end, device=device) + rope_delta).expand(3, -1)


def response_positions(n_prompt: int, rope_delta: int, length: int, observations: Sequence,
                       device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """M-RoPE positions (3, length) of a response's first `length` tokens after a prompt of
    `n_prompt` tokens whose rope delta is `rope_delta`, and the rope delta after them. A sampled
    token is text (`generated_positions`, with the delta so far); an observation
    (rollplex.models.inputs.Observation) takes its own positions shifted to the position where it
    starts, after which the delta grows by its own. The same positions as `mrope_positions` gives
    the whole trajectory (text after vision continues from the largest position + 1), computed
    a piece at a time, as the engine continues an episode."""
    parts, index, end = [], n_prompt, n_prompt + length
    for o in observations:
        start = n_prompt + o.start
        if start >= end:
            break
        parts.append(generated_positions(index, start, rope_delta, device))
        parts.append((o.positions.to(device) + start + rope_delta)[:, :end - start])
        rope_delta += o.rope_delta
        index = start + len(o)
    if index < end:
        parts.append(generated_positions(index, end, rope_delta, device))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long, device=device), rope_delta
    return torch.cat(parts, dim=1), rope_delta


def _grid_list(grid_thw: torch.Tensor | None) -> list[list[int]]:
    return [] if grid_thw is None else [list(map(int, g)) for g in grid_thw.tolist()]


def _run_length(ids: list[int], start: int, tok: int) -> int:
    n = 0
    while start + n < len(ids) and ids[start + n] == tok:
        n += 1
    return n
