"""Packing multimodal sequences into one flat, unpadded batch.

The model's main forward takes packed tokens: the sequences laid end to end,
their boundaries in `cu_seqlens` (flash-attn's varlen convention), M-RoPE
positions per token, and the images/videos of all sequences concatenated in
order. No token is padding, so no compute is wasted on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex.models.qwen2_5_vl import ModelArgs, mrope_for


@dataclass
class SequenceInputs:
    """One unpadded sequence with its own images and videos (what the processor
    returns for one prompt, plus any response tokens appended after `prompt_len`)."""

    input_ids: torch.Tensor  # (L,)
    prompt_len: int | None = None  # None: the whole sequence is prompt
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (3, T)
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int
    rope_deltas: list[int]
    prompt_mask: torch.Tensor | None = None  # (T,) True on prompt tokens; None when every token is prompt
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def pack_sequences(args: ModelArgs, seqs: list[SequenceInputs]) -> PackedBatch:
    if not seqs:
        raise ValueError("cannot pack an empty list of sequences")
    lengths = [len(s.input_ids) for s in seqs]
    if min(lengths) == 0:
        raise ValueError("cannot pack an empty sequence")
    positions, deltas, prompt_masks = [], [], []
    for s in seqs:
        n_prompt = len(s.input_ids) if s.prompt_len is None else s.prompt_len
        pos, delta = mrope_for(args, s.input_ids[:n_prompt], s.image_grid_thw, s.video_grid_thw,
                               s.second_per_grid_ts)
        # Response tokens are text: index + rope delta on all three axes.
        response = torch.arange(n_prompt, len(s.input_ids), device=pos.device) + delta
        positions.append(torch.cat([pos, response.expand(3, -1)], dim=1))
        deltas.append(delta)
        prompt_masks.append(torch.arange(len(s.input_ids), device=pos.device) < n_prompt)
    device = seqs[0].input_ids.device
    all_prompt = all(s.prompt_len is None or s.prompt_len == len(s.input_ids) for s in seqs)
    return PackedBatch(
        input_ids=torch.cat([s.input_ids for s in seqs]),
        position_ids=torch.cat(positions, dim=1),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_seqlen=max(lengths),
        rope_deltas=deltas,
        prompt_mask=None if all_prompt else torch.cat(prompt_masks),
        pixel_values=_cat([s.pixel_values for s in seqs]),
        image_grid_thw=_cat([s.image_grid_thw for s in seqs]),
        pixel_values_videos=_cat([s.pixel_values_videos for s in seqs]),
        video_grid_thw=_cat([s.video_grid_thw for s in seqs]),
    )


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    return torch.cat(present) if present else None


def split_padded(args: ModelArgs, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 second_per_grid_ts: torch.Tensor | None = None) -> list[SequenceInputs]:
    """A processor's padded batch -> one `SequenceInputs` per row, each with its own
    images and videos (the processor concatenates them in row order)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    merge2 = args.vision.spatial_merge_size**2
    taken = {"image": 0, "video": 0}  # grids consumed so far
    patch_offset = {"image": 0, "video": 0}
    sources = {"image": (pixel_values, image_grid_thw, args.image_token_id),
               "video": (pixel_values_videos, video_grid_thw, args.video_token_id)}
    rows = []
    for row, row_mask in zip(input_ids, mask):
        ids = row[row_mask]
        seq = SequenceInputs(ids)
        for kind, (pixels, grids, token_id) in sources.items():
            n_tokens = int((ids == token_id).sum())
            if n_tokens == 0:
                continue
            if grids is None:
                raise ValueError(f"the batch holds {kind} pad tokens but no {kind}_grid_thw")
            start = taken[kind]
            count, end = 0, start
            while count < n_tokens and end < len(grids):
                count += int(grids[end].prod()) // merge2
                end += 1
            if count != n_tokens:
                raise ValueError(f"a row holds {n_tokens} {kind} pad tokens but its {kind} grids "
                                 f"{grids[start:end].tolist()} need {count} (was the prompt truncated through the "
                                 f"{kind}?)")
            row_grids = grids[start:end]
            n_patches = int(row_grids.prod(-1).sum())
            p0 = patch_offset[kind]
            if kind == "image":
                seq.pixel_values, seq.image_grid_thw = pixels[p0:p0 + n_patches], row_grids
            else:
                seq.pixel_values_videos, seq.video_grid_thw = pixels[p0:p0 + n_patches], row_grids
                if second_per_grid_ts is not None:
                    seq.second_per_grid_ts = second_per_grid_ts[start:end]
            taken[kind], patch_offset[kind] = end, p0 + n_patches
        rows.append(seq)
    return rows


def pack_padded(args: ModelArgs, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                second_per_grid_ts: torch.Tensor | None = None) -> PackedBatch:
    return pack_sequences(args, split_padded(args, input_ids, attention_mask, pixel_values, image_grid_thw,
                                             pixel_values_videos, video_grid_thw, second_per_grid_ts))
