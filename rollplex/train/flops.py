"""FLOP counts for MFU (`perf/mfu/actor`).

Matmul FLOPs only (the rest is negligible): 2 per multiply-add in the forward,
twice that in the backward, so a training pass is 3x the forward.
- Linear layers: 2 * (weights of the layer) per token.
- Attention: 4 * head_dim * heads per (query, key) pair (scores and weighted
  sum), counted from the pairs each backend actually visits.
The vision tower counts per patch the same way (its windows and full-attention
frames give its pairs); the LM head counts only where logits are computed.
"""

from __future__ import annotations

from rollplex.models.packing import PackedBatch, TrainBatch
from rollplex.models.family import FamilyArgs
from rollplex.models.registry import family_of

# Dense bf16 peak per device (FLOP/s), for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_FLOPS.items():
        if key in device_name:
            return value
    return None


def forward_flops(args: FamilyArgs, batch: TrainBatch) -> float:
    """Forward matmul FLOPs of one pass over a packed training batch."""
    p = batch.packed
    return _flops(args, p.input_ids.numel(), batch.target_ids.numel(), _lm_pairs(batch),
                  (p.image_grid_thw, p.video_grid_thw))


def prompt_flops(args: FamilyArgs, packed: PackedBatch, with_vision: bool) -> float:
    """Forward FLOPs of a kept-prompt pass (causal prompts, no logits)."""
    grids = (packed.image_grid_thw, packed.video_grid_thw) if with_vision else ()
    return _flops(args, packed.input_ids.numel(), 0, sum(n * (n + 1) // 2 for n in packed.lengths), grids)


def suffix_flops(args: FamilyArgs, groups: list[tuple[int, list[int]]]) -> float:
    """Forward FLOPs of a suffix-only pass: (prompt length, response lengths) per
    group; each response token attends to its prompt and its own past."""
    tokens = sum(sum(lens) for _, lens in groups)
    pairs = sum(r * prompt + r * (r + 1) // 2 for prompt, lens in groups for r in lens)
    return _flops(args, tokens, tokens, pairs, ())


def _flops(args: FamilyArgs, tokens: int, targets: int, pairs: int, grids) -> float:
    t, v = args.text, args.vision
    family = family_of(args)
    linear = family.linear_params(args)
    flops = 2 * linear.decoder * tokens + 2 * t.hidden_size * t.vocab_size * targets
    flops += 4 * t.head_dim * t.num_attention_heads * len(family.kv_layers(args)) * pairs
    for grid in grids:
        if grid is None:
            continue
        patches = int(grid.prod(-1).sum())
        flops += 2 * linear.vision * patches
        # Upper bound of the windowed blocks: full attention within each frame for every block.
        frame_pairs = sum(int(ti) * (int(h) * int(w)) ** 2 for ti, h, w in grid.tolist())
        flops += 4 * v.hidden_size * v.depth * frame_pairs
    return float(flops)


def _lm_pairs(batch: TrainBatch) -> int:
    p = batch.packed
    if p.groups is None:
        return sum(n * (n + 1) // 2 for n in p.lengths)
    pairs = 0
    for g in p.groups:
        pairs += g.prompt_len * (g.prompt_len + 1) // 2
        pairs += sum(r * g.prompt_len + r * (r + 1) // 2 for r in g.response_lens)
    return pairs
