"""Token sampling with reproducible per-sequence randomness, and per-token logprobs.

Randomness is a pure function of (seed, position, vocab index): an integer
hash, not a torch Generator. A sequence therefore samples the same tokens
whatever else is in the batch, in whatever order, after preemption and
recompute, and on CPU or CUDA (the noise is bitwise equal; the float math
after it may differ by rounding). Sampling uses the exponential race (Gumbel
max): token = argmax(p / E) = argmax(log p - log E) with E ~ Exp(1) per vocab
entry, which draws exactly from p.

The returned logprob is that of the unmodified distribution, log_softmax of
the raw logits, not of the tempered/truncated one: RL compares it with the
trainer's logprob of the same token.
"""

from __future__ import annotations

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
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
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
    """Random int64 words -> float32 strictly inside (0, 1).

    The top 23 bits u give (u + 0.5) / 2^23 = (2u + 1) / 2^24, exact in float32:
    at least 2^-24 and at most 1 - 2^-24, so log U and log(-log U) stay finite.
    """
    return (_srl(bits, 41).float() + 0.5) * 2.0**-23


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(seed, position, v) in (0, 1) for each row's (seed, position) and every v < vocab_size: (B, V) float32.

    Each row is the splitmix64 stream started from a hash of (seed, position);
    entry v is that stream's (v + 1)-th output.
    """
    state = _mix64(_mix64(seeds.long()) ^ positions.long())
    v = torch.arange(1, vocab_size + 1, dtype=torch.long, device=seeds.device)
    return _to_unit(_mix64(state[:, None] + v * _GAMMA))


def _truncate(z: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus."""
    V = z.shape[-1]
    # Stable sort: among equal logits the lower vocab index ranks first, so the
    # truncation does not depend on the sort implementation.
    z_sorted, order = z.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=z.device)
    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k)
    drop = rank[None, :] >= k[:, None]
    z_sorted = z_sorted.masked_fill(drop, float("-inf"))
    probs = z_sorted.softmax(dim=-1)
    # A token is in the nucleus when the tokens ranked above it sum to < top_p;
    # the top token always is. top_p = 1 keeps everything, whatever the rounding.
    before = probs.cumsum(dim=-1) - probs
    drop |= (before >= top_p.float()[:, None]) & (top_p < 1)[:, None]
    return z.scatter(-1, order, z_sorted.masked_fill(drop, float("-inf")))


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
    logits = logits.float()
    B, V = logits.shape
    greedy = temperature <= 0
    z = logits / torch.where(greedy, 1.0, temperature.float())[:, None]

    if truncate:
        z = _truncate(z, top_p, top_k)

    # argmax(log p - log E) with E = -log U ~ Exp(1); log p = z up to a per-row constant.
    noise = uniform_noise(seeds, positions, V)
    sampled = (z - (-noise.log()).log()).argmax(dim=-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
