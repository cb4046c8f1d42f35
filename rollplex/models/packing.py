"""Packing multimodal sequences into one flat, unpadded batch.

The model's main forward takes packed tokens: the sequences laid end to end,
their boundaries in `cu_seqlens` (flash-attn's varlen convention), M-RoPE
positions per token, and the images/videos of all sequences concatenated in
order. No token is padding, so no compute is wasted on it.

A multi-turn (agentic) sample's response holds the observations its tools
returned (rollplex.models.inputs.Observation): context inside the response.
They take their own M-RoPE positions (`rope.response_positions`), their images
and videos follow the prompt's in the batch's vision tensors (token order), and
`prompt_mask` marks them as it marks prompts: tokens the policy did not sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollplex.models.inputs import Group, Observation, Prompt
from rollplex.models.protocol import RopeArgs
from rollplex.models.rope import mrope_positions, response_positions
from rollplex.ops.attention import GroupLayout


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (3, T)
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    max_seqlen: int
    rope_deltas: list[int]
    # (T,) True at the tokens the policy did not sample: prompts and the observations inside multi-turn responses.
    # They are context: only they take vision features at their pad tokens (VisionSlots.find; a pad id the policy
    # sampled is text), and an MoE update's auxiliary loss counts the others. None when every token is context.
    prompt_mask: torch.Tensor | None = None
    groups: list[GroupLayout] | None = None  # set when GRPO groups share their prompt (see pack_groups)
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def pack_sequences(args: RopeArgs, prompts: list[Prompt], responses: list[list[int]] | None = None,
                   observations: list[list[Observation]] | None = None) -> PackedBatch:
    """Pack `prompts`, each followed by its response's tokens when `responses` are given, with
    the observations inside each response when `observations` are given (a multi-turn
    sample's, in order; `response_inputs` says how they are laid out)."""
    if not prompts:
        raise ValueError("cannot pack an empty list of sequences")
    if responses is not None and len(responses) != len(prompts):
        raise ValueError(f"{len(responses)} responses for {len(prompts)} prompts")
    if observations is not None and len(observations) != len(prompts):
        raise ValueError(f"observations for {len(observations)} responses but {len(prompts)} prompts")
    ids, positions, deltas, context, vision_sources, lengths = [], [], [], [], [], []
    for i, p in enumerate(prompts):
        n_prompt, device = len(p.input_ids), p.input_ids.device
        response = responses[i] if responses is not None else []
        if n_prompt + len(response) == 0:
            raise ValueError("cannot pack an empty sequence")
        pos, delta = mrope_positions(p.input_ids, args.rope_spec, p.image_grid_thw, p.video_grid_thw,
                                     p.second_per_grid_ts)
        ids.append(p.input_ids)
        positions.append(pos)
        context.append(torch.ones(n_prompt, dtype=torch.bool, device=device))
        vision_sources.append(p)
        if response:
            inputs = response_inputs(response, observations[i] if observations else [], n_prompt, delta, device)
            ids.append(inputs.input_ids)
            positions.append(inputs.position_ids)
            context.append(inputs.context_mask)
            vision_sources += inputs.vision
        deltas.append(delta)
        lengths.append(n_prompt + len(response))
    device = prompts[0].input_ids.device
    return PackedBatch(
        input_ids=torch.cat(ids),
        position_ids=torch.cat(positions, dim=1),
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_seqlen=max(lengths),
        rope_deltas=deltas,
        prompt_mask=None if responses is None or not any(responses) else torch.cat(context),
        **concat_vision(vision_sources),
    )


@dataclass
class ResponseInputs:
    """A response as a forward reads it after its prompt."""

    input_ids: torch.Tensor  # (n,) long: every token, sampled and observed
    position_ids: torch.Tensor  # (3, n): rope.response_positions
    context_mask: torch.Tensor  # (n,) bool: True at its observations' tokens (the policy did not sample them)
    vision: list[Prompt]  # its observations' prompts, in order: their images and videos follow the prompt's


def response_inputs(tokens: list[int], observations: list[Observation], n_prompt: int, rope_delta: int,
                    device: torch.device | str | None = None) -> ResponseInputs:
    """The response `tokens` (its observations' tokens among them) after a prompt of `n_prompt`
    tokens whose rope delta is `rope_delta`. The observations must lie inside the response, in
    order, each holding exactly its prompt's tokens: a misplaced one would put its images'
    features at tokens that are not their pads (a ValueError)."""
    if not tokens:
        raise ValueError("a response must hold at least one token")
    _check_observations(tokens, observations)
    positions, _ = response_positions(n_prompt, rope_delta, len(tokens), observations, device)
    context = torch.zeros(len(tokens), dtype=torch.bool, device=device)
    for o in observations:
        context[o.start:o.end] = True
    # Without a device the ids stay on the host: a suffix pass copies them over without blocking (to_device),
    # which a streamed pass in the decode window must (tests/test_stream.py).
    return ResponseInputs(torch.tensor(tokens, dtype=torch.long).to(device), positions, context,
                          [o.prompt for o in observations])


def _check_observations(tokens: list[int], observations: list[Observation]) -> None:
    previous_end = 0
    for k, o in enumerate(observations):
        if o.start < previous_end or o.end > len(tokens):
            raise ValueError(f"observation {k} spans response tokens [{o.start}, {o.end}), which is not inside the "
                             f"{len(tokens)}-token response after the observation before it (ending at "
                             f"{previous_end})")
        if tokens[o.start:o.end] != o.prompt.input_ids.tolist():
            raise ValueError(f"observation {k}'s tokens differ from the response's tokens [{o.start}, {o.end})")
        previous_end = o.end


def concat_vision(sources: list[Prompt]) -> dict[str, torch.Tensor | None]:
    """The images and videos of `sources` (prompts, observations' prompts) one after another, as
    the keyword arguments of `PackedBatch` and of a model's `encode_vision`."""
    return {name: _cat([getattr(p, name) for p in sources])
            for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}


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
    trainer computes it; the reference the shared path is tested against. Either
    way a response's observations (and their images) are its own.
    """
    if share_prefix:
        return _pack_shared(args, groups)
    prompts, responses, observations, target_index, offset = [], [], [], [], 0
    for g in groups:
        n_prompt = len(g.prompt.input_ids)
        for s in g.samples:
            prompts.append(g.prompt)
            responses.append(s.token_ids)
            observations.append(s.observations)
            target_index.append(torch.arange(offset + n_prompt - 1, offset + n_prompt - 1 + len(s.token_ids)))
            offset += n_prompt + len(s.token_ids)
    return _train_batch(pack_sequences(args, prompts, responses, observations), target_index, groups)


def _pack_shared(args: RopeArgs, groups: list[Group]) -> TrainBatch:
    prompts = pack_sequences(args, [g.prompt for g in groups])
    # Each group's prompt as packed alone, then its responses, continuing the prompt's positions.
    layouts, target_index, ids, positions, context, vision_sources, offset = [], [], [], [], [], [], 0
    for i, g in enumerate(groups):
        a, b = int(prompts.cu_seqlens[i]), int(prompts.cu_seqlens[i + 1])
        n_prompt = b - a
        ids.append(prompts.input_ids[a:b])
        positions.append(prompts.position_ids[:, a:b])
        context.append(torch.ones(n_prompt, dtype=torch.bool))
        vision_sources.append(g.prompt)
        start = offset + n_prompt
        for s in g.samples:
            response = response_inputs(s.token_ids, s.observations, n_prompt, prompts.rope_deltas[i])
            ids.append(response.input_ids)
            positions.append(response.position_ids)
            context.append(response.context_mask)
            vision_sources += response.vision
            # First token predicted by the prompt's last token, the rest by their predecessor.
            target_index.append(torch.cat([torch.tensor([offset + n_prompt - 1]),
                                           torch.arange(start, start + len(s.token_ids) - 1)]))
            start += len(s.token_ids)
        layouts.append(GroupLayout.packed(offset, n_prompt, tuple(len(r) for r in g.responses)))
        offset = start
    device = prompts.input_ids.device
    packed = PackedBatch(
        input_ids=torch.cat(ids).to(device),
        position_ids=torch.cat(positions, dim=1).to(device),
        cu_seqlens=torch.tensor([0] + [lay.end for lay in layouts], dtype=torch.int32, device=device),
        max_seqlen=max(lay.end - lay.prompt_start for lay in layouts),
        rope_deltas=prompts.rope_deltas,
        prompt_mask=torch.cat(context).to(device),
        groups=layouts,
        **concat_vision(vision_sources),
    )
    return _train_batch(packed, target_index, groups)


def _train_batch(packed: PackedBatch, target_index: list[torch.Tensor], groups: list[Group]) -> TrainBatch:
    device = packed.input_ids.device
    return TrainBatch(packed, torch.cat(target_index).to(device),
                      torch.tensor([t for g in groups for r in g.responses for t in r], device=device),
                      [len(r) for g in groups for r in g.responses])
