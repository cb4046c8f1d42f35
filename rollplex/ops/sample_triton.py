"""The sampler's Triton path: rollplex.engine.sampler.sample's draw from one read of the logits.

Same inputs, outputs and rule as the torch path (inverse transform of the host's U,
float64 running sums, the logprob of log_softmax(x / T)); what differs is how the
row is read. Three kernels:

1. `_tile_stats_kernel`, one program per (row, tile of TILE logits): the tile's max,
   the index of its first max, and the float64 sum of exp((x - tile max) / T). This
   is the one full read of the logits. Every tile is independent, so a batch of 64
   rows over a 151,936-token vocabulary runs ~4,800 programs.
2. `_rung_stats_kernel` (top-k / top-p only), one program per (row, tile): the count
   and float64 weight of the tile's logits at or above each of PROBES thresholds
   ("rungs", the row's max minus 0, 0.25 T, ... 22.6 T, and -inf), the weights
   exp((x - row max) / T) being the torch path's own.
3. `_draw_kernel`, one program per row. The row's max is the largest tile max, and
   its total weight the sum of the tile sums rescaled by exp((tile max - row max) / T)
   in float64, as flash attention's online softmax rescales. Without truncation the
   tile where the running sum of those crosses U * total is found from the tiles'
   sums alone and only that tile is read again: one read of the logits and one tile.
   With truncation the row's candidates are the logits at or above the highest rung
   that holds the top-k (or, top-k off, top_p of the weight) and fits in CANDIDATES
   slots: they are gathered (reading only the tiles that hold some), sorted by
   (logit descending, index ascending) in registers, and cut and drawn from exactly
   as the torch path does over its full stable sort. A row whose candidates do not fit
   (a large k, or a nucleus of thousands of tokens) finds the k-th logit, the
   nucleus' last logit and the drawn logit by bisection on the logits' order keys
   instead, PROBES thresholds per pass over the row (~8 passes each), and the drawn
   token among ties by one more pass: slower, the same tokens.

So the tokens are today's: vocab order without truncation, decreasing-logit order
with it, ties broken by the lower index in both the cut and the draw. They differ only
where float rounding does (module docstring of rollplex.engine.sampler).

Triton is optional: this module imports without it, and the kernels are built on
the first call. With TRITON_INTERPRET=1 set before triton is imported they run on
CPU tensors (tests/sample_triton_cases.py).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from rollplex.ops.paged_decode_triton import _next_pow2, _patch_interpreter_index

TILE = 2048  # logits per program of the per-tile kernels: 75 tiles for 151,936 tokens
PROBE_BLOCK = 512  # logits per step of a probing loop, times PROBES thresholds in registers
PROBES = 16  # rungs of the candidate ladder, and thresholds per bisection pass
CANDIDATES = 4096  # most candidates a truncated row sorts in registers


@functools.cache
def _kernels():
    """The kernels, imported on first use (so importing this module never needs triton)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        _patch_interpreter_index()
    from rollplex.ops import sample_triton_kernels as k

    return k.tile_stats_kernel, k.rung_stats_kernel, k.draw_kernel


def _param(value: float | int | torch.Tensor, placeholder: torch.Tensor) -> tuple[torch.Tensor, float | int, bool]:
    """A kernel's (tensor, number, per row) arguments for one sampling parameter: a (B,)
    tensor is read per row; a number is passed as it is, beside a tensor never read."""
    if isinstance(value, torch.Tensor):
        return value, 0.0 if value.is_floating_point() else 0, True
    return placeholder, value, False


def sample_triton(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    top_k: int | torch.Tensor,
    u: torch.Tensor,
    truncate: bool = True,
    candidates: int = CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rollplex.engine.sampler.sample on a CUDA device (or anywhere in the interpreter):
    same arguments and results. `candidates` (a power of two) is how many logits a
    truncated row may sort in registers before it bisects instead. No host sync."""
    tile_stats, rung_stats, draw = _kernels()
    batch, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    device = logits.device
    tokens = torch.empty(batch, dtype=torch.long, device=device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    if batch == 0:
        return tokens, logprobs
    num_tiles = math.ceil(vocab / TILE)
    t_args, p_args, k_args = (_param(x, u) for x in (temperature, top_p, top_k))
    tile_max = torch.empty(batch, num_tiles, dtype=torch.float32, device=device)
    tile_argmax = torch.empty(batch, num_tiles, dtype=torch.int32, device=device)
    tile_sum = torch.empty(batch, num_tiles, dtype=torch.float64, device=device)
    tile_stats[(batch, num_tiles)](logits, logits.stride(0), vocab, num_tiles, *t_args[:2], tile_max, tile_argmax,
                                   tile_sum, T_PER_ROW=t_args[2], TILE=TILE, num_warps=8)
    tiles_pad = _next_pow2(num_tiles)
    rung_counts = rung_masses = slots = tile_sum  # placeholders: read only when truncating
    if truncate:
        rung_counts = torch.empty(batch, num_tiles, PROBES, dtype=torch.int32, device=device)
        rung_masses = torch.empty(batch, num_tiles, PROBES, dtype=torch.float64, device=device)
        slots = torch.empty(batch, candidates, dtype=torch.int64, device=device)
        rung_stats[(batch, num_tiles)](logits, logits.stride(0), vocab, num_tiles, *t_args[:2], tile_max,
                                       rung_counts, rung_masses, T_PER_ROW=t_args[2], TILE=TILE,
                                       TILES_PAD=tiles_pad, BLOCK=PROBE_BLOCK, PROBES=PROBES, num_warps=8)
    # maxnreg: ptxas 13 (triton 3.9) held the truncated draw at 8 warps to 128 registers and spilled;
    # with room for 224 it takes ~200 (tools/compile_kernels.py), as triton 3.6's ptxas chose by itself.
    draw[(batch,)](logits, logits.stride(0), vocab, num_tiles, tile_max, tile_argmax, tile_sum, u,
                   *t_args[:2], *p_args[:2], *k_args[:2], rung_counts, rung_masses, slots, tokens, logprobs,
                   T_PER_ROW=t_args[2], P_PER_ROW=p_args[2], K_PER_ROW=k_args[2], TRUNCATE=truncate, TILE=TILE,
                   TILES_PAD=tiles_pad, BLOCK=PROBE_BLOCK, PROBES=PROBES, CANDIDATES=candidates, num_warps=8, maxnreg=224)
    return tokens, logprobs
