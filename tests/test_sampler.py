"""Tests for rollplex.engine.sampler: greedy/top-k/top-p sampling, hash randomness, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from rollplex.engine.sampler import SamplingParams, _to_unit, sample, uniform_noise


def run(logits, temperature=1.0, top_p=1.0, top_k=-1, seeds=None, positions=0):
    """sample() with per-row tensors built from scalars (or given as lists), as the engine batches them."""
    B = logits.shape[0]

    def col(x, dtype):
        return torch.as_tensor(x, dtype=dtype).expand(B).clone()

    seeds = torch.arange(B) if seeds is None else seeds
    return sample(
        logits,
        col(temperature, torch.float32),
        col(top_p, torch.float32),
        col(top_k, torch.long),
        col(seeds, torch.long),
        col(positions, torch.long),
    )


def repeat(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log().expand(n, len(probs)).clone()


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return tokens.bincount(minlength=vocab_size).float() / len(tokens)


# ----------------------------------------------------------------------------- params


def test_sampling_params_defaults_and_validation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.seed) == (1.0, 1.0, -1, 256, None)
    SamplingParams(temperature=0, top_p=0.5, top_k=1, max_tokens=1, stop_token_ids=[2], seed=3)
    for kwargs, field in [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


# ----------------------------------------------------------------------------- noise


def splitmix64_reference(seed: int, position: int, v: int) -> int:
    """uniform_noise's hash in plain Python uint64 arithmetic."""
    mask = 2**64 - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    state = mix(mix(seed) ^ position)
    return mix((state + (v + 1) * 0x9E3779B97F4A7C15) & mask)


def test_noise_is_the_uint64_hash_bit_for_bit():
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1])
    positions = torch.tensor([0, 7, 100_000, 3])
    u = uniform_noise(seeds, positions, 50)
    for row, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        expected = [((splitmix64_reference(s, p, v) >> 41) + 0.5) / 2**23 for v in range(50)]
        assert u[row].tolist() == expected


def test_noise_strictly_inside_unit_interval_and_uniform():
    extremes = _to_unit(torch.tensor([0, -1, 2**63 - 1, -(2**63)]))  # all-zero, all-one and sign bits
    assert extremes.min() > 0 and extremes.max() < 1
    assert extremes.tolist() == [2**-24, 1 - 2**-24, 0.5 - 2**-24, 0.5 + 2**-24]

    u = uniform_noise(torch.arange(64), torch.arange(64) * 3, 4096)
    assert u.dtype == torch.float32 and u.shape == (64, 4096)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    histogram = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (histogram - 0.1).abs().max() < 0.005


# ----------------------------------------------------------------------------- sample


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    tokens, logprobs = run(logits, temperature=0.0, top_p=0.3, top_k=5)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32

    # Sampled rows too: the logprob ignores temperature, top-k and top-p.
    tokens, logprobs = run(logits, temperature=0.7, top_p=0.9, top_k=10)
    expected = logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert (logprobs - expected).abs().max() <= 1e-6


def test_low_precision_logits():
    torch.manual_seed(0)
    logits = (torch.randn(4, 64) * 2).bfloat16()
    tokens, logprobs = run(logits, temperature=1.0)
    expected = logits.float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert logprobs.dtype == torch.float32 and (logprobs - expected).abs().max() <= 1e-6


def test_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(32, 100)
    tokens, _ = run(logits, temperature=1.5, top_k=1)
    assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_and_position_same_token_whatever_the_batch():
    torch.manual_seed(0)
    B, V = 12, 300
    logits = torch.randn(B, V)
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.3] * 3)
    top_p = torch.tensor([1.0, 0.9, 0.8] * 4)
    top_k = torch.tensor([-1, 50, V, 7] * 3)
    seeds = torch.randint(0, 2**62, (B,))
    positions = torch.randint(0, 4096, (B,))
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions)

    perm = torch.randperm(B)
    shuffled, shuffled_lp = sample(
        logits[perm], temperature[perm], top_p[perm], top_k[perm], seeds[perm], positions[perm]
    )
    assert torch.equal(shuffled, tokens[perm]) and torch.equal(shuffled_lp, logprobs[perm])

    # Row 5 alone, and beside rows it was never batched with.
    rows = [5]
    alone, _ = sample(logits[rows], temperature[rows], top_p[rows], top_k[rows], seeds[rows], positions[rows])
    assert alone.item() == tokens[5].item()
    others = torch.randn(3, V)
    mixed, _ = sample(
        torch.cat([others, logits[rows]]),
        torch.tensor([1.0, 0.0, 0.9, temperature[5]]),
        torch.tensor([1.0, 1.0, 0.5, top_p[5]]),
        torch.tensor([-1, -1, 3, top_k[5]]),
        torch.cat([torch.tensor([1, 2, 3]), seeds[rows]]),
        torch.cat([torch.tensor([9, 9, 9]), positions[rows]]),
    )
    assert mixed[-1].item() == tokens[5].item()


def test_different_seeds_or_positions_sample_differently():
    logits = torch.zeros(64, 1000)  # uniform over 1000 tokens
    by_seed, _ = run(logits, seeds=torch.arange(64), positions=0)
    by_position, _ = run(logits, seeds=123, positions=torch.arange(64))
    assert len(set(by_seed.tolist())) > 55 and len(set(by_position.tolist())) > 55
    assert not torch.equal(by_seed, by_position)


def test_top_k_never_samples_outside_the_top_k():
    torch.manual_seed(0)
    n, k = 2000, 5
    logits = torch.randn(1, 40).expand(n, 40).clone()
    tokens, _ = run(logits, temperature=2.0, top_k=k)  # flattened: many tokens would be likely
    top = set(logits[0].topk(k).indices.tolist())
    assert set(tokens.tolist()) == top


def test_top_p_restricts_to_the_nucleus():
    n = 4000
    tokens, _ = run(repeat([0.5, 0.3, 0.15, 0.05], n), top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}
    # Renormalized over the nucleus: 0.5 / 0.8 and 0.3 / 0.8.
    assert (frequencies(tokens, 4) - torch.tensor([0.625, 0.375, 0, 0])).abs().max() < 0.03

    tokens, _ = run(repeat([0.5, 0.3, 0.15, 0.05], n), top_p=0.4)
    assert set(tokens.tolist()) == {0}  # the top token is always kept


def test_empirical_distribution_matches_softmax():
    n = 4000
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    tokens, _ = run(repeat(probs.tolist(), n), temperature=1.0, positions=17)
    assert (frequencies(tokens, 6) - probs).abs().max() < 0.03


def test_temperature_sharpens_and_flattens():
    n = 4000
    probs = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    logits = repeat(probs, n)
    for temperature in (0.5, 2.0):
        tokens, _ = run(logits, temperature=temperature)
        expected = (logits[0] / temperature).softmax(-1)
        assert (frequencies(tokens, 6) - expected).abs().max() < 0.03
    cold = frequencies(run(logits, temperature=0.5)[0], 6)[0]
    hot = frequencies(run(logits, temperature=2.0)[0], 6)[0]
    assert cold > 0.4 > hot
