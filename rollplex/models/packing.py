"""Packing multimodal sequences into one flat, unpadded batch.

The model's main forward takes packed tokens: the sequences laid end to end,
their boundaries in `cu_seqlens` (flash-attn's varlen convention), M-RoPE
positions per token, and the images/videos of all sequences concatenated in
order. No token is padding, so no compute is wasted on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex.models.inputs import Group, Prompt
from rollplex.models.protocol import RopeArgs
from rollplex.models.rope import generated_positions, mrope_positions
from rollplex.ops.attention import GroupLayout


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (3, T)
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int
    rope_deltas: list[int]
    prompt_mask: torch.Tensor | None = None  # (T,) True on prompt tokens; None when every token is prompt
    groups: list[GroupLayout] | None = None  # set when GRPO groups share their prompt (see pack_groups)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def pack_sequences(args: RopeArgs, prompts: list[Prompt], responses: list[list[int]] | None = None) -> PackedBatch:
    """Pack `prompts`, each followed by its response's tokens when `responses` are given."""
    if not prompts:
        raise ValueError("cannot pack an empty list of sequences")
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses for {len(prompts)} prompts")
    ids, positions, deltas, prompt_masks = [], [], [], []
    for i, p in enumerate(prompts):
        n_prompt = len(p.input_ids)
        response = torch.tensor(responses[i] if responses is not None else [], dtype=torch.long,
                                device=p.input_ids.device)
        if n_prompt + len(response) == 0:
            raise ValueError("cannot pack an empty sequence")
        pos, delta = mrope_positions(p.input_ids, args.rope_spec, p.image_grid_thw, p.video_grid_thw,
                                     p.second_per_grid_ts)
        end = n_prompt + len(response)
        ids.append(torch.cat([p.input_ids, response]))
        positions.append(torch.cat([pos, generated_positions(n_prompt, end, delta, pos.device)], dim=1))
        deltas.append(delta)
        prompt_masks.append(torch.arange(end, device=pos.device) < n_prompt)
    lengths = [len(x) for x in ids]
    device = prompts[0].input_ids.device
    return PackedBatch(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(positions, dim=1),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_seqlen=max(lengths),
        rope_deltas=deltas,
        prompt_mask=None if responses is None or not any(responses) else torch.cat(prompt_masks),
        pixel_values=_cat([p.pixel_values for p in prompts]),
        image_grid_thw=_cat([p.image_grid_thw for p in prompts]),
        pixel_values_videos=_cat([p.pixel_values_videos for p in prompts]),
        video_grid_thw=_cat([p.video_grid_thw for p in prompts]),
    )


def _cat(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    return torch.cat(present) if present else None


def split_padded(args: RopeArgs, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 second_per_grid_ts: torch.Tensor | None = None) -> list[Prompt]:
    """A processor's padded batch -> one `Prompt` per row, each with its own
    images and videos (the processor concatenates them in row order)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    spec = args.rope_spec
    merge2 = spec.spatial_merge_size**2
    taken = {"image": 0, "video": 0}  # grids consumed so far
    patch_offset = {"image": 0, "video": 0}
    sources = {"image": (pixel_values, image_grid_thw, spec.image_token_id),
               "video": (pixel_values_videos, video_grid_thw, spec.video_token_id)}
    rows = []
    for row, row_mask in zip(input_ids, mask):
        ids = row[row_mask]
        seq = Prompt(ids)
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


def pack_padded(args: RopeArgs, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                second_per_grid_ts: torch.Tensor | None = None) -> PackedBatch:
    return pack_sequences(args, split_padded(args, input_ids, attention_mask, pixel_values, image_grid_thw,
                                             pixel_values_videos, video_grid_thw, second_per_grid_ts))


# ----------------------------------------------------------------------------- GRPO groups for training


@dataclass
class TrainBatch:
    """A packed batch of groups plus where each response token is predicted.

    The hidden state at `target_index[i]` predicts token `target_ids[i]`; targets
    run response by response in group order, `response_lens` long each.
    """

    packed: PackedBatch
    target_index: torch.Tensor
    target_ids: torch.Tensor
    response_lens: list[int]


def pack_groups(args: RopeArgs, groups: list[Group], share_prefix: bool) -> TrainBatch:
    """Pack GRPO groups for a training or logprob pass.

    share_prefix=True: each group is [prompt | response_1 | ... | response_n]; the
    prompt (and its images) is computed once and every response attends to it
    (SharedPrefixAttention). share_prefix=False: every response is its own
    full sequence prompt + response, images included, as a plain colocated
    trainer computes it; the reference the shared path is tested against.
    """
    if share_prefix:
        return _pack_shared(args, groups)
    prompts, responses, target_index, offset = [], [], [], 0
    for g in groups:
        n_prompt = len(g.prompt.input_ids)
        for r in g.responses:
            _check_response(r)
            prompts.append(g.prompt)
            responses.append(r)
            target_index.append(torch.arange(offset + n_prompt - 1, offset + n_prompt - 1 + len(r)))
            offset += n_prompt + len(r)
    return _train_batch(pack_sequences(args, prompts, responses), target_index, groups)


def _pack_shared(args: RopeArgs, groups: list[Group]) -> TrainBatch:
    layouts, target_index, offset = [], [], 0
    for g in groups:
        n_prompt = len(g.prompt.input_ids)
        for r in g.responses:
            _check_response(r)
        layouts.append(GroupLayout.packed(offset, n_prompt, tuple(len(r) for r in g.responses)))
        start = offset + n_prompt
        for r in g.responses:
            # First token predicted by the prompt's last token, the rest by their predecessor.
            target_index.append(torch.cat([torch.tensor([offset + n_prompt - 1]),
                                           torch.arange(start, start + len(r) - 1)]))
            start += len(r)
        offset = start
    prompts = pack_sequences(args, [g.prompt for g in groups])
    # Insert each group's responses after its prompt: ids, and positions continuing the prompt's.
    ids, positions, prompt_mask = [], [], []
    for i, (g, layout) in enumerate(zip(groups, layouts)):
        a, b = int(prompts.cu_seqlens[i]), int(prompts.cu_seqlens[i + 1])
        ids.append(prompts.input_ids[a:b])
        positions.append(prompts.position_ids[:, a:b])
        prompt_mask.append(torch.ones(b - a, dtype=torch.bool))
        for r in g.responses:
            ids.append(torch.tensor(r, dtype=torch.long))
            positions.append(generated_positions(b - a, b - a + len(r), prompts.rope_deltas[i]))
            prompt_mask.append(torch.zeros(len(r), dtype=torch.bool))
    device = prompts.input_ids.device
    packed = PackedBatch(
        input_ids=torch.cat(ids).to(device),
        position_ids=torch.cat(positions, dim=1).to(device),
        cu_seqlens=torch.tensor([0] + [lay.end for lay in layouts], dtype=torch.int32, device=device),
        max_seqlen=max(lay.end - lay.prompt_start for lay in layouts),
        rope_deltas=prompts.rope_deltas,
        prompt_mask=torch.cat(prompt_mask).to(device),
        groups=layouts,
        pixel_values=prompts.pixel_values, image_grid_thw=prompts.image_grid_thw,
        pixel_values_videos=prompts.pixel_values_videos, video_grid_thw=prompts.video_grid_thw,
    )
    return _train_batch(packed, target_index, groups)


def _train_batch(packed: PackedBatch, target_index: list[torch.Tensor], groups: list[Group]) -> TrainBatch:
    device = packed.input_ids.device
    return TrainBatch(packed, torch.cat(target_index).to(device),
                      torch.tensor([t for g in groups for r in g.responses for t in r], device=device),
                      [len(r) for g in groups for r in g.responses])


def _check_response(tokens: list[int]) -> None:
    if not tokens:
        raise ValueError("a response must hold at least one token")
