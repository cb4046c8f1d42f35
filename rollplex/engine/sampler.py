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
in the batch, in whatever order, and after preemption and recompute. The hash
runs on the host (`uniforms`), where the seeds and positions are, so U is the
same bits whatever device samples; the softmax weights and their sum are float
math whose rounding may differ across devices and batch shapes, which moves a
token only when U lands within that rounding of an interval's boundary.
The token does depend on `truncate` (vocab or sorted order): the engine
passes the same value for every step of a request.

The returned logprob is that of the tempered distribution, log_softmax(x / T):
the policy that sampled, which the trainer's logprob passes compute too (they
divide the logits by the same T, rollplex.train.actor, as verl's and TRL's
actors do), so the update optimises that policy and the two logprobs compare
on the same footing. Top-k/top-p truncation is left out, as there: the trainer
sees the model's full distribution. A greedy row (T = 0) returns log_softmax(x), the
untempered logprob (the T -> 0 limit, 0 for every argmax, would tell nothing);
a trainer after a greedy rollout uses T = 1 too. The draw's weights are the
tempered softmax's own, exp((x - max x) / T), and their float64 total is its
normalizer, so the logprob needs no pass of its own over the vocabulary.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollplex.ops.paged_decode_triton import triton_available
from rollplex.ops.sample_triton import sample_triton

if TYPE_CHECKING:
    from rollplex.config import RolloutConfig


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

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> SamplingParams:
        """The rollout section's sampling (its seeds come per request, from the prompts)."""
        return cls(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                   max_tokens=rollout.max_tokens, ignore_eos=rollout.ignore_eos)


_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix_seed(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix64 steps), so each child of each
    request gets its own stream from one user seed."""
    mask = 0xFFFFFFFFFFFFFFFF
    x = int(_GAMMA)
    for v in values:
        x = (x ^ (v & mask)) * int(_M1) & mask
        x = (x ^ (x >> 31)) * int(_M2) & mask
    return x >> 1


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, a bijection on 64-bit words (uint64 arrays: products wrap, shifts are logical)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _to_unit(bits: np.ndarray) -> np.ndarray:
    """Random uint64 words -> float64 strictly inside (0, 1).

    The top 52 bits u give (u + 0.5) / 2^52 = (2u + 1) / 2^53, exact in float64:
    at least 2^-53 and at most 1 - 2^-53. 52 bits, not float32's 24, so that
    probabilities far below 2^-24 are drawn at their rate.
    """
    return ((bits >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U(seed, position) in (0, 1) per row, splitmix64's first output from a hash of
    (seed, position): host int64 (B,) tensors in, a host float64 (B,) tensor out, for
    the caller to copy to the sampling device with its other inputs. The hash runs in
    numpy: its ~20 elementwise ops on a few hundred words take ~15 us there, several
    times less than torch's dispatch of each (or a kernel launch each)."""
    seeds, positions = (t.long().numpy().view(np.uint64) for t in (seeds, positions))
    state = _mix64(_mix64(seeds) ^ positions)
    return torch.from_numpy(_to_unit(_mix64(state + _GAMMA)))


def _cumulative_weights(ranked: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """Running sums in float64 of exp((logit - top) / temperature) along each row;
    temperature (B, 1), or None for 1 (the division, which would change nothing, is skipped).

    Shifting by the row's top logit first keeps every exponent <= 0 with the
    top token's weight exactly 1, whatever the temperature: a tiny one sends
    the others to 0 (argmax over ties), never to inf or NaN. -inf logits weigh 0.
    """
    weights = ranked - top.float()[:, None]
    if temperature is not None:
        weights = weights.div_(temperature)
    return weights.exp_().cumsum(dim=-1, dtype=torch.float64)


def _invert(cdf: torch.Tensor, mass: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index i with cdf[i] > u * mass: a draw over the weights up to where cdf reaches mass.

    For a point in [0, mass) the index found is one where cdf grows (a
    positive weight) and comes no later than the first index whose cdf
    reaches mass: zero-weight tokens and tokens cut off after mass are never
    drawn. u clamped to 1 - 2^-53 keeps the point below mass (>= 1, the top
    token's weight) whatever u * mass rounds to: (1 - 2^-53) * mass rounds to
    the largest float64 below mass, and rounding is monotonic. A NaN row finds
    no index: the last one stands in, a valid token id (its logprob is NaN, and
    the engine raises on it) instead of an out-of-range gather (a device-side
    assert on CUDA).
    """
    point = u.clamp(max=1 - 2**-53) * mass
    return torch.searchsorted(cdf, point[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def _kept_mass(cdf: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The weight of each row's kept tokens, cdf sorted by decreasing logit: top_k of them, then its nucleus.

    The kept tokens are a prefix of the ranking. A token is in the nucleus
    when the top-k tokens ranked above it weigh < top_p of the top-k's weight;
    the top token always is, and top_p = 1 keeps every token of nonzero weight.
    """
    V = cdf.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k)
    top_k_mass = cdf.gather(-1, (k - 1)[:, None])
    # Ranks 0..n-1 are kept, n - 1 being the first rank whose cdf reaches top_p of the top-k mass
    # (a NaN row reaches none: clamped to a valid rank, as in _invert).
    last_kept = torch.searchsorted(cdf, top_p.double()[:, None] * top_k_mass).clamp_(max=V - 1)
    return cdf.gather(-1, last_kept).squeeze(-1)


def sample(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    top_p: float | torch.Tensor,
    top_k: int | torch.Tensor,
    u: torch.Tensor,
    truncate: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, and its logprob under the tempered logits (module docstring).

    logits (B, V) of any float dtype; temperature, top_p (floats) and top_k (ints,
    -1 or >= V meaning off): each one number for every row, or a (B,) tensor of one
    per row; u (B,) float64 on logits' device: each row's `uniforms(seed, position)`,
    position being the index in its sequence of the token sampled. Rows with
    temperature 0 take the argmax. Others: logits / temperature, keep the top_k,
    keep the nucleus (the fewest most likely tokens whose probability sums to
    >= top_p), sample. Returns tokens (B,) long and logprobs (B,) float32.

    No host sync and no loop over rows: greedy and sampled results are both
    computed and selected per row. `truncate=False` tells that no row uses
    top-k or top-p (the caller knows it from its parameters), which skips the sort.
    A number for the temperature (the engine's case: one per generation) skips what
    it makes needless: at 0 or 1 the division, and at a number above 0 the argmax
    (no row is greedy).

    `backend`: "triton" (rollplex.ops.sample_triton: one read of the logits, the same
    tokens), "torch" (the code below, the reference), or "auto", the default: Triton for
    float32/bf16/fp16 logits on CUDA when it is installed, else torch. None reads the
    ROLLPLEX_SAMPLER environment variable (default "auto"): the switch back to the torch
    path on a GPU without touching the engine.
    """
    if _resolve_backend(backend, logits) == "triton":
        return sample_triton(logits, temperature, top_p, top_k, u, truncate)
    greedy, temperature = _temperature(temperature, logits.device)
    if truncate:
        # Stable sort: among equal logits the lower vocab index ranks first, so the
        # truncation does not depend on the sort implementation. Drawing in sorted
        # order and reading the token from `order` needs no scatter back.
        ranked, order = logits.sort(dim=-1, descending=True, stable=True)
        top, argmax = ranked[:, 0], order[:, 0]
        cdf = _cumulative_weights(ranked, top, temperature)
        mass = _kept_mass(cdf, _per_row(top_p, cdf), _per_row(top_k, cdf))
        sampled = order.gather(-1, _invert(cdf, mass, u)[:, None]).squeeze(-1)
    else:
        # The max with its indices costs several times amax: only where a row may be greedy.
        top, argmax = (logits.amax(dim=-1), None) if greedy is False else logits.max(dim=-1)
        cdf = _cumulative_weights(logits, top, temperature)
        sampled = _invert(cdf, cdf[:, -1], u)
    if isinstance(greedy, torch.Tensor):
        tokens = torch.where(greedy, argmax, sampled)
    else:
        tokens = argmax if greedy else sampled
    return tokens, _tempered_logprobs(logits, tokens, top, cdf[:, -1], temperature)


SAMPLER_BACKEND_ENV = "ROLLPLEX_SAMPLER"


def _resolve_backend(name: str | None, logits: torch.Tensor) -> str:
    """"triton" or "torch" for `sample`'s backend argument (see there)."""
    name = os.environ.get(SAMPLER_BACKEND_ENV, "auto") if name is None else name
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown sampler backend {name!r}: expected auto, torch or triton")
    if name == "triton" and not triton_available(logits.device):
        raise ValueError(f"the triton sampler needs triton and a CUDA device (or TRITON_INTERPRET=1), "
                         f"got logits on {logits.device}")
    if name == "auto":
        fits = logits.is_cuda and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return "triton" if fits and triton_available(logits.device) else "torch"
    return name


def _temperature(temperature: float | torch.Tensor,
                 device: torch.device) -> tuple[bool | torch.Tensor, torch.Tensor | None]:
    """Which rows are greedy (one bool for all, or (B,) per row), and the temperature the
    draw divides by: (B, 1) or (1, 1), or None for 1. Greedy rows draw at 1: only their
    logprob reads the draw's weights. A number other than 0 and 1 becomes a tensor, not
    a Python scalar: CUDA multiplies by a scalar divisor's reciprocal, which rounds
    differently from the division that per-row tensors get."""
    if isinstance(temperature, torch.Tensor):
        greedy = temperature <= 0
        return greedy, torch.where(greedy, 1.0, temperature.float())[:, None]
    if temperature in (0, 1):
        return temperature == 0, None
    return False, torch.full((1, 1), float(temperature), device=device)


def _per_row(value: float | int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row parameter as a (B,) tensor: a number becomes one for every row of `like`."""
    return value if isinstance(value, torch.Tensor) else torch.full((like.shape[0],), value, device=like.device)


def _tempered_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: torch.Tensor, total: torch.Tensor,
                       temperature: torch.Tensor | None) -> torch.Tensor:
    """log_softmax(logits / temperature) at each row's token, float32 (temperature as
    `_temperature` gives it: None for 1). `total` is the draw's float64 sum of
    exp((logit - top) / temperature), the tempered softmax's normalizer: log p =
    (logit - top) / temperature - log(total), read off the row's token with no pass
    over the vocabulary, and rounded to float32 once."""
    shifted = logits.gather(-1, tokens[:, None]).squeeze(-1).float() - top.float()
    if temperature is not None:
        shifted = shifted / temperature.squeeze(-1)
    return (shifted - total.log()).float()
