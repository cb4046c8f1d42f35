"""Token sampling with reproducible per-sequence randomness, and per-token logprobs.

Sampling is inverse transform sampling with one uniform per row:

    token = min{i : sum_{j <= i} p_j > U},   U ~ U(0, 1)

where p is the tempered (and, with top-k/top-p, truncated) distribution, in
vocab order, or in decreasing-logit order when truncating (the sort is there
already, and the kept tokens are a prefix of it). The sum runs over the
unnormalized weights exp((x - max x) / T) of logits x at temperature T and U
is scaled by their total, so no division by the normalizer is needed. It draws exactly from p: token i is
drawn when U falls in an interval of width p_i. The running sum is float64:
in float32 its rounding step near the total is ~6e-8 of it, more than most
of a real vocabulary's ~150k tail probabilities, which would each get an
interval of 0 or one step, and the rounding would pile up along the row.
One float64 pass over the row replaces a random number per vocab entry.

U is a pure function of (seed, position): an integer hash (splitmix64), not a
torch Generator. A sequence therefore samples the same tokens whatever else is
in the batch, in whatever order, and after preemption and recompute. U is
bitwise equal on CPU and CUDA; the softmax weights and their sum are float
math whose rounding may differ across devices and batch shapes, which moves a
token only when U lands within that rounding of an interval's boundary.
The token does depend on `truncate` (vocab or sorted order): the engine
passes the same value for every step of a request.

The returned logprob is that of the unmodified distribution, log_softmax of
the raw logits, not of the tempered/truncated one: RL compares it with the
trainer's logprob of the same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus threshold in (0, 1]; 1 = off."""
    top_k: int = -1
    """-1 = off, else >= 1."""
    max_tokens: int = 256
    """Maximum new tokens."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a response, besides EOS."""
    ignore_eos: bool = False
    seed: int | None = None
    """None = a nondeterministic seed, drawn once per generate call by the engine."""

    def __post_init__(self) -> None:
        # `not x >= 0` rather than `x < 0` also rejects NaN.
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or self.top_k >= 1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not self.max_tokens >= 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed}")


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 with the same bits."""
    return c - 2**64 if c >= 2**63 else c


_GAMMA = _i64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64: torch's >> is arithmetic, so clear the copied sign bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, a bijection on 64-bit words; int64 products wrap like uint64."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def _to_unit(bits: torch.Tensor) -> torch.Tensor:
    """Random int64 words -> float64 strictly inside (0, 1).

    The top 52 bits u give (u + 0.5) / 2^52 = (2u + 1) / 2^53, exact in float64:
    at least 2^-53 and at most 1 - 2^-53. 52 bits, not float32's 24, so that
    probabilities far below 2^-24 are drawn at their rate.
    """
    return (_srl(bits, 12).double() + 0.5) * 2.0**-52


def _uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U(seed, position) in (0, 1) per row: (B,) float64, splitmix64's first output from a hash of (seed, position)."""
    state = _mix64(_mix64(seeds.long()) ^ positions.long())
    return _to_unit(_mix64(state + _GAMMA))


def _cumulative_weights(ranked: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Running sums in float64 of exp((logit - top) / temperature) along each row.

    Shifting by the row's top logit first keeps every exponent <= 0 with the
    top token's weight exactly 1, whatever the temperature: a tiny one sends
    the others to 0 (argmax over ties), never to inf or NaN. -inf logits weigh 0.
    """
    weights = (ranked - top.float()[:, None]).div_(temperature[:, None]).exp_()
    return weights.cumsum(dim=-1, dtype=torch.float64)


def _invert(cdf: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index i with cdf[i] > u * mass: a draw over the weights up to where cdf reaches mass.

    For a point in [0, mass) the index found is one where cdf grows (a
    positive weight) and comes no later than the first index whose cdf
    reaches mass: zero-weight tokens and tokens cut off after mass are never
    drawn. Clamping the point below mass keeps that true whatever u * mass
    rounds to.
    """
    point = torch.minimum(u * mass, torch.nextafter(mass, torch.zeros_like(mass)))
    return torch.searchsorted(cdf, point[:, None], right=True).squeeze(-1)


def _kept_mass(cdf: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The weight of each row's kept tokens, cdf sorted by decreasing logit: top_k of them, then its nucleus.

    The kept tokens are a prefix of the ranking. A token is in the nucleus
    when the top-k tokens ranked above it weigh < top_p of the top-k's weight;
    the top token always is, and top_p = 1 keeps every token of nonzero weight.
    """
    V = cdf.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k)
    top_k_mass = cdf.gather(-1, (k - 1)[:, None])
    # Ranks 0..n-1 are kept, n - 1 being the first rank whose cdf reaches top_p of the top-k mass.
    last_kept = torch.searchsorted(cdf, top_p.double()[:, None] * top_k_mass)
    return cdf.gather(-1, last_kept).squeeze(-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its logprob under the raw logits.

    logits (B, V) of any float dtype; temperature, top_p float (B,); top_k long
    (B,) with -1 or >= V meaning off; seeds, positions int64 (B,), positions
    being the index in its sequence of the token sampled. Rows with temperature
    0 take the argmax. Others: logits / temperature, keep the top_k, keep the
    nucleus (the fewest most likely tokens whose probability sums to >= top_p),
    sample. Returns tokens (B,) long and logprobs (B,) float32.

    No host sync and no loop over rows: greedy and sampled results are both
    computed and selected per row. `truncate=False` tells that no row uses
    top-k or top-p (the caller knows it from its parameters), which skips the sort.
    """
    greedy = temperature <= 0
    temperature = torch.where(greedy, 1.0, temperature.float())
    u = _uniform(seeds, positions)
    if truncate:
        # Stable sort: among equal logits the lower vocab index ranks first, so the
        # truncation does not depend on the sort implementation. Drawing in sorted
        # order and reading the token from `order` needs no scatter back.
        ranked, order = logits.sort(dim=-1, descending=True, stable=True)
        cdf = _cumulative_weights(ranked, ranked[:, 0], temperature)
        sampled = order.gather(-1, _invert(cdf, _kept_mass(cdf, top_p, top_k), u)[:, None]).squeeze(-1)
        argmax = order[:, 0]
    else:
        top, argmax = logits.max(dim=-1)
        cdf = _cumulative_weights(logits, top, temperature)
        sampled = _invert(cdf, cdf[:, -1], u)
    tokens = torch.where(greedy, argmax, sampled)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
