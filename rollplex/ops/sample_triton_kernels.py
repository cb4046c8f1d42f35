"""The Triton kernels of rollplex/ops/sample_triton.py (its docstring says what each does).

Imported only when the Triton sampler first runs: importing this module needs triton.
The kernels call the helpers below by name, which Triton resolves in this module's globals.
"""

import triton
import triton.language as tl

ONE_BELOW = tl.constexpr(1.0 - 2.0**-53)  # the largest float64 below 1: keeps U * mass below mass
LOW_BITS = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _row_param(ptr, value, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """A sampling parameter of this row as DTYPE: from its (B,) tensor, or the one number for all rows."""
    if PER_ROW:
        value = tl.load(ptr + row)
    return tl.cast(value, DTYPE)


@triton.jit
def _draw_temperature(ptr, value, row, PER_ROW: tl.constexpr):
    """The temperature the draw divides by: a greedy row's (<= 0) draws at 1, as in the torch
    path. Kept at least float32's smallest normal: with denormals flushed (as the GPU may),
    a smaller one would become 0 and make 0 / T NaN at the max."""
    t = _row_param(ptr, value, row, PER_ROW, tl.float32)
    return tl.where(t > 0, tl.maximum(t, 1.1754944e-38), 1.0)


@triton.jit
def _weight(x, shift, temperature):
    """exp((x - shift) / T) in float32, the torch path's arithmetic. At T = 1 (and greedy rows,
    drawn at 1) the correctly rounded division is exact, so it gives the torch path's
    undivided weights; one variant for every temperature compiles once, not twice."""
    return tl.exp(tl.math.div_rn(x - shift, temperature))


@triton.jit
def _order_key(x):
    """int32 keys ordered as the float32 values are, -0.0 and +0.0 alike (they tie in a sort)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_weight(key, top, temperature):
    """The float64 weight of a logit given by its order key (the key map is its own inverse)."""
    key = key.to(tl.int32)
    x = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return _weight(x, top, temperature).to(tl.float64)


@triton.jit
def _rung_keys(top, temperature, RUNGS: tl.constexpr):
    """The ladder's thresholds as order keys: the max, then max - 0.25 T ... max - 22.6 T
    in steps of sqrt(2), then -inf (every token)."""
    rungs = tl.arange(0, RUNGS)
    below = tl.where(rungs == 0, 0.0, tl.exp2((rungs - 5).to(tl.float32) * 0.5)) * temperature
    return _order_key(tl.where(rungs == RUNGS - 1, float("-inf"), top - below)).to(tl.int64)


@triton.jit
def _probe(row_ptr, begin, end, top, temperature, thresholds,
           BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """Per threshold key: how many of row[begin:end] have a key at or above it, and their float64 weight."""
    counts = tl.zeros([PROBES], dtype=tl.int32)
    masses = tl.zeros([PROBES], dtype=tl.float64)
    for start in range(begin, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < end
        x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        w = tl.where(valid, _weight(x, top, temperature), 0.0).to(tl.float64)
        above = (_order_key(x).to(tl.int64)[:, None] >= thresholds[None, :]) & valid[:, None]
        counts += tl.sum(above.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
    return counts, masses


@triton.jit
def _search(row_ptr, vocab, top, temperature, lo, hi, lo_count, lo_mass, hi_count, hi_mass, goal,
            BY_MASS: tl.constexpr, STRICT: tl.constexpr,
            BLOCK: tl.constexpr, PROBES: tl.constexpr):
    """The largest key in [lo, hi] whose tokens at or above it reach `goal` (in count, or
    weight; `STRICT`: exceed it), given that lo's do and nothing above hi does. The
    count and weight at or above lo (of the kept tokens: the caller's) and above hi
    (lo_count, lo_mass, hi_count, hi_mass) follow the bounds; each pass over the row
    cuts [lo, hi] into PROBES - 1 parts. Returns the key and the four."""
    probes = tl.arange(0, PROBES)
    while lo < hi:
        thresholds = lo + 1 + ((hi - lo - 1) * probes) // (PROBES - 1)
        counts, masses = _probe(row_ptr, 0, vocab, top, temperature, thresholds, BLOCK, PROBES)
        if BY_MASS:
            measure = masses
        else:
            measure = counts.to(tl.float64)
        if STRICT:
            reached = measure > goal
        else:
            reached = measure >= goal
        n = tl.sum(reached.to(tl.int32), axis=0)  # thresholds ascend: the first n reach the goal
        last, missed = probes == n - 1, probes == n
        lo = tl.where(n > 0, tl.sum(tl.where(last, thresholds, 0), axis=0), lo)
        lo_count = tl.where(n > 0, tl.sum(tl.where(last, counts, 0), axis=0), lo_count)
        lo_mass = tl.where(n > 0, tl.sum(tl.where(last, masses, 0.0), axis=0), lo_mass)
        hi = tl.where(n < PROBES, tl.sum(tl.where(missed, thresholds, 0), axis=0) - 1, hi)
        hi_count = tl.where(n < PROBES, tl.sum(tl.where(missed, counts, 0), axis=0), hi_count)
        hi_mass = tl.where(n < PROBES, tl.sum(tl.where(missed, masses, 0.0), axis=0), hi_mass)
    return lo, lo_count, lo_mass, hi_count, hi_mass


@triton.jit
def _nth_with_key(row_ptr, vocab, key, nth, BLOCK: tl.constexpr):
    """The index of the nth (from 0), in vocab order, of the tokens whose logit has this key."""
    seen = tl.zeros([], dtype=tl.int32)
    found = tl.zeros([], dtype=tl.int64)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < vocab
        x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
        match = valid & (_order_key(x) == key)
        rank = seen + tl.cumsum(match.to(tl.int32), axis=0) - 1
        found = tl.maximum(found, tl.max(tl.where(match & (rank == nth), offs, 0), axis=0).to(tl.int64))
        seen += tl.sum(match.to(tl.int32), axis=0)
    return found


@triton.jit
def _draw_by_search(row_ptr, vocab, top, temperature, u, p, k, k_on, mass_all, BLOCK: tl.constexpr,
                    PROBES: tl.constexpr):
    """The torch path's truncated draw by bisection: the k-th logit, the nucleus' last
    logit and the drawn logit (each the largest key whose tokens at or above it reach a
    count or weight), then the drawn token among the ties at that logit."""
    floor_key = _order_key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
    top_key = _order_key(top).to(tl.int64)
    no_mass = tl.zeros([], dtype=tl.float64)
    no_count = tl.zeros([], dtype=tl.int32)
    # Top-k (a search that does not run when it is off: the floor key, every token kept).
    kth, _, _, above_k, above_k_mass = _search(
        row_ptr, vocab, top, temperature, floor_key, tl.where(k_on, top_key, floor_key), vocab, mass_all,
        no_count, no_mass, k.to(tl.float64), False, False, BLOCK, PROBES)
    kept_k = tl.where(k_on, k, vocab)
    mass_k = tl.where(k_on, above_k_mass + (k - above_k).to(tl.float64) * _key_weight(kth, top, temperature),
                      mass_all)
    # Top-p within the top-k: the first rank whose running weight reaches top_p of theirs.
    p_on = p < 1
    target = p * mass_k
    cut, cut_count, _, above_cut, above_cut_mass = _search(
        row_ptr, vocab, top, temperature, kth, tl.where(p_on, top_key, kth), kept_k, mass_k,
        tl.where(p_on, 0, above_k), tl.where(p_on, 0.0, above_k_mass), target, True, False,
        BLOCK, PROBES)
    cut_weight = _key_weight(cut, top, temperature)
    ties = (cut_count - above_cut).to(tl.float64)  # the tokens at the cut logit the ranking may keep
    # (A cut of weight 0 is one where top-p is off, and `needed` unused: 1 spares the division by 0.)
    needed = tl.ceil((target - above_cut_mass) / tl.where(cut_weight > 0, cut_weight, 1.0))
    needed = tl.where(needed >= 1, needed, 1.0)  # also for NaN
    kept_ties = tl.where(p_on & (needed < ties), needed, ties)
    kept_mass = tl.where(p_on, above_cut_mass + kept_ties * cut_weight, mass_k)
    # The draw: the first rank whose running weight exceeds U * the kept weight.
    point = u * kept_mass
    drawn, drawn_count, _, above_drawn, above_drawn_mass = _search(
        row_ptr, vocab, top, temperature, cut, top_key, above_cut + kept_ties.to(tl.int32), kept_mass,
        no_count, no_mass, point, True, True, BLOCK, PROBES)
    drawn_weight = _key_weight(drawn, top, temperature)  # > 0 but in a row of NaN
    nth = tl.floor((point - above_drawn_mass) / tl.where(drawn_weight > 0, drawn_weight, 1.0))
    last_tie = (drawn_count - above_drawn - 1).to(tl.float64)
    nth = tl.where(nth >= 0, tl.where(nth < last_tie, nth, last_tie), 0.0)
    return _nth_with_key(row_ptr, vocab, drawn.to(tl.int32), nth.to(tl.int32), BLOCK)


@triton.jit
def _draw_from_candidates(row_ptr, vocab, num_tiles, per_tile, threshold, top, temperature, u, p, k, k_on,
                          mass_all, slots_ptr, TILE: tl.constexpr,
                          TILES_PAD: tl.constexpr, CANDIDATES: tl.constexpr):
    """The torch path's truncated draw over the logits at or above `threshold`, a prefix of
    its ranking holding every token it may keep (per_tile: how many each tile has)."""
    tiles = tl.arange(0, TILES_PAD)
    first_slot = tl.cumsum(per_tile, axis=0) - per_tile
    lanes = tl.arange(0, TILE)
    for tile in range(0, num_tiles):
        if tl.sum(tl.where(tiles == tile, per_tile, 0), axis=0) > 0:  # only tiles with candidates are read
            offs = tile * TILE + lanes
            valid = offs < vocab
            x = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            key = _order_key(x).to(tl.int64)
            taken = valid & (key >= threshold)
            slot = tl.sum(tl.where(tiles == tile, first_slot, 0), axis=0) + tl.cumsum(taken.to(tl.int32), 0) - 1
            # (key, complement of the index): one int64 whose descending order is the stable sort's
            tl.store(slots_ptr + slot, (key << 32) + (LOW_BITS - offs.to(tl.int64)), mask=taken)
    tl.debug_barrier()  # the stores above are read by other threads of the program
    count = tl.sum(per_tile, axis=0)
    ranks = tl.arange(0, CANDIDATES)
    present = ranks < count
    ranked = tl.sort(tl.load(slots_ptr + ranks, mask=present, other=-(2**63)), descending=True)
    index = LOW_BITS - (ranked & LOW_BITS)
    cdf = tl.cumsum(tl.where(present, _key_weight(ranked >> 32, top, temperature), 0.0), axis=0)
    # As the torch path's _kept_mass and _invert, over the candidates instead of the whole ranking.
    kept_limit = tl.where(k_on, k, count)
    mass_k = tl.where(k_on, tl.sum(tl.where(ranks == k - 1, cdf, 0.0), axis=0), mass_all)
    last_kept = tl.sum(((cdf < p * mass_k) & (ranks < kept_limit)).to(tl.int32), axis=0)
    last_kept = tl.minimum(last_kept, kept_limit - 1)
    point = u * tl.sum(tl.where(ranks == last_kept, cdf, 0.0), axis=0)
    drawn = tl.minimum(tl.sum(((cdf <= point) & present).to(tl.int32), axis=0), last_kept)
    return tl.sum(tl.where(ranks == drawn, index, 0), axis=0)


@triton.jit
def _draw_truncated(row_ptr, vocab, row, num_tiles, top, temperature, u, p, k, rung_counts_ptr,
                    rung_masses_ptr, slots_ptr, TILE: tl.constexpr,
                    TILES_PAD: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr,
                    CANDIDATES: tl.constexpr):
    """The top-k / top-p draw: over the candidates of the highest rung that holds every
    token the ranking may keep, if they fit, else by bisection."""
    tiles = tl.arange(0, TILES_PAD)
    rungs = tl.arange(0, PROBES)
    at = (row * num_tiles + tiles)[:, None] * PROBES + rungs[None, :]
    in_row = (tiles < num_tiles)[:, None]
    tile_counts = tl.load(rung_counts_ptr + at, mask=in_row, other=0)
    counts = tl.sum(tile_counts, axis=0)
    masses = tl.sum(tl.load(rung_masses_ptr + at, mask=in_row, other=0.0), axis=0)
    mass_all = tl.sum(tl.where(rungs == PROBES - 1, masses, 0.0), axis=0)
    k_on = k > 0
    # With top-k the kept tokens are among the top k; without, the rung must weigh top_p of the row.
    holds = tl.where(k_on, counts >= k, masses >= p * mass_all)
    rung = tl.min(tl.where(holds, rungs, PROBES - 1), axis=0)  # the last rung, every token, always holds
    token = tl.zeros([], dtype=tl.int64)
    if tl.sum(tl.where(rungs == rung, counts, 0), axis=0) <= CANDIDATES:
        per_tile = tl.sum(tl.where(rungs[None, :] == rung, tile_counts, 0), axis=1)
        threshold = tl.sum(tl.where(rungs == rung, _rung_keys(top, temperature, PROBES), 0), axis=0)
        token = _draw_from_candidates(row_ptr, vocab, num_tiles, per_tile, threshold, top, temperature, u, p,
                                      k, k_on, mass_all, slots_ptr + row * CANDIDATES, TILE,
                                      TILES_PAD, CANDIDATES)
    else:
        token = _draw_by_search(row_ptr, vocab, top, temperature, u, p, k, k_on, mass_all, BLOCK,
                                PROBES)
    return token


@triton.jit
def _draw_untruncated(row_ptr, vocab, tiles, tile_max, tile_scale, tile_mass, point, temperature,
                      TILE: tl.constexpr):
    """The first index whose running weight, in vocab order, exceeds `point`: the tile from
    the tiles' weights, the index by reading that tile again with its first pass's weights."""
    running = tl.cumsum(tile_mass, axis=0)
    last_weighed = tl.max(tl.where(tile_mass > 0, tiles, 0), axis=0)
    crossing = tl.minimum(tl.sum((running <= point).to(tl.int32), axis=0), last_weighed)
    before = tl.sum(tl.where(tiles == crossing - 1, running, 0.0), axis=0)
    scale = tl.sum(tl.where(tiles == crossing, tile_scale, 0.0), axis=0)
    shift = tl.max(tl.where(tiles == crossing, tile_max, float("-inf")), axis=0)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    lanes = tl.arange(0, TILE)
    offs = crossing * TILE + lanes
    valid = offs < vocab
    x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    w = tl.where(valid, _weight(x, shift, temperature), 0.0).to(tl.float64) * scale
    first = tl.min(tl.where(before + tl.cumsum(w, axis=0) > point, lanes, TILE), axis=0)
    # Past the tile's end only by rounding (its sum and its running sum add in different orders).
    last_weighed_lane = tl.max(tl.where(w > 0, lanes, 0), axis=0)
    return (crossing * TILE + tl.where(first < TILE, first, last_weighed_lane)).to(tl.int64)


@triton.jit
def tile_stats_kernel(logits_ptr, stride_row, vocab, num_tiles, t_ptr, t_value, max_ptr, argmax_ptr, sum_ptr,
                       T_PER_ROW: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    valid = offs < vocab
    x = tl.load(logits_ptr + row * stride_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
    temperature = _draw_temperature(t_ptr, t_value, row, T_PER_ROW)
    tile_max = tl.max(x, axis=0)
    shift = tl.where(tile_max == float("-inf"), 0.0, tile_max)  # an all-masked tile weighs 0, not NaN
    w = tl.where(valid, _weight(x, shift, temperature), 0.0)
    out = row * num_tiles + tile
    tl.store(max_ptr + out, tile_max)
    tl.store(argmax_ptr + out, tile * TILE + tl.argmax(x, axis=0, tie_break_left=True))
    tl.store(sum_ptr + out, tl.sum(w.to(tl.float64), axis=0))


@triton.jit
def rung_stats_kernel(logits_ptr, stride_row, vocab, num_tiles, t_ptr, t_value, max_ptr, counts_ptr,
                       masses_ptr, T_PER_ROW: tl.constexpr, TILE: tl.constexpr,
                       TILES_PAD: tl.constexpr, BLOCK: tl.constexpr, PROBES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles = tl.arange(0, TILES_PAD)
    top = tl.max(tl.load(max_ptr + row * num_tiles + tiles, mask=tiles < num_tiles, other=float("-inf")), 0)
    temperature = _draw_temperature(t_ptr, t_value, row, T_PER_ROW)
    begin = tile * TILE
    counts, masses = _probe(logits_ptr + row * stride_row, begin, tl.minimum(begin + TILE, vocab), top,
                            temperature, _rung_keys(top, temperature, PROBES), BLOCK, PROBES)
    out = (row * num_tiles + tile) * PROBES + tl.arange(0, PROBES)
    tl.store(counts_ptr + out, counts)
    tl.store(masses_ptr + out, masses)


@triton.jit
def draw_kernel(logits_ptr, stride_row, vocab, num_tiles, max_ptr, argmax_ptr, sum_ptr, u_ptr,
                 t_ptr, t_value, p_ptr, p_value, k_ptr, k_value, rung_counts_ptr, rung_masses_ptr, slots_ptr,
                 tokens_ptr, logprobs_ptr,
                 T_PER_ROW: tl.constexpr, P_PER_ROW: tl.constexpr, K_PER_ROW: tl.constexpr,
                 TRUNCATE: tl.constexpr, TILE: tl.constexpr, TILES_PAD: tl.constexpr,
                 BLOCK: tl.constexpr, PROBES: tl.constexpr, CANDIDATES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    tiles = tl.arange(0, TILES_PAD)
    in_row = tiles < num_tiles
    tile_max = tl.load(max_ptr + row * num_tiles + tiles, mask=in_row, other=float("-inf"))
    tile_sum = tl.load(sum_ptr + row * num_tiles + tiles, mask=in_row, other=0.0)
    greedy = _row_param(t_ptr, t_value, row, T_PER_ROW, tl.float32) <= 0
    temperature = _draw_temperature(t_ptr, t_value, row, T_PER_ROW)
    top = tl.max(tile_max, axis=0)
    top_tile = tl.minimum(tl.min(tl.where(tile_max == top, tiles, TILES_PAD), axis=0), num_tiles - 1)
    argmax = tl.load(argmax_ptr + row * num_tiles + top_tile).to(tl.int64)  # the first max, as torch's
    # Each tile's sum is relative to its own max: rescaled to the row's in float64 (0 for masked
    # tiles; NaN, as in the torch path, for a row of -inf).
    exponent = (tile_max.to(tl.float64) - top.to(tl.float64)) / temperature.to(tl.float64)
    tile_scale = tl.exp(exponent)
    tile_mass = tile_sum * tile_scale
    total = tl.sum(tile_mass, axis=0)
    u = tl.minimum(tl.load(u_ptr + row), tl.full([], ONE_BELOW, tl.float64))
    token = argmax
    if TRUNCATE:
        if not greedy:
            # top_p in float32 then float64, and top_k 0 when off, as the torch path reads them.
            p = _row_param(p_ptr, p_value, row, P_PER_ROW, tl.float32).to(tl.float64)
            k = _row_param(k_ptr, k_value, row, K_PER_ROW, tl.int64)
            k = tl.where((k > 0) & (k < vocab), k, 0).to(tl.int32)
            token = _draw_truncated(row_ptr, vocab, row, num_tiles, top, temperature, u, p, k, rung_counts_ptr,
                                    rung_masses_ptr, slots_ptr, TILE, TILES_PAD, BLOCK, PROBES,
                                    CANDIDATES)
    else:
        sampled = _draw_untruncated(row_ptr, vocab, tiles, tile_max, tile_scale, tile_mass, u * total,
                                    temperature, TILE)
        token = tl.where(greedy, argmax, sampled)
    token = tl.minimum(token, vocab - 1)
    # log_softmax(x / T) at the token, from the draw's float64 normalizer (as _tempered_logprobs).
    shifted = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32) - top, temperature)
    tl.store(tokens_ptr + row, token)
    tl.store(logprobs_ptr + row, (shifted.to(tl.float64) - tl.log(total)).to(tl.float32))
