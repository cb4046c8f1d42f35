"""Tests for rollplex.engine.sampler: greedy/top-k/top-p sampling, hash randomness, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollplex.engine.sampler import SamplingParams, _cumulative_weights, _invert, _to_unit, sample, uniforms
from test_prefix_sync import HostSyncGuard


def run(logits, temperature=1.0, top_p=1.0, top_k=-1, seeds=None, positions=0, truncate=True, per_row=True):
    """sample() with per-row tensors built from scalars (or given as lists), or with
    `per_row=False` one number per parameter, as the engine calls it."""
    B = logits.shape[0]

    def col(x, dtype):
        return torch.as_tensor(x, dtype=dtype).expand(B).clone()

    seeds = torch.arange(B) if seeds is None else seeds
    params = ((col(temperature, torch.float32), col(top_p, torch.float32), col(top_k, torch.long)) if per_row
              else (temperature, top_p, top_k))
    return sample(logits, *params, uniforms(col(seeds, torch.long), col(positions, torch.long)), truncate=truncate)


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
        ({"temperature": math.inf}, "temperature"),
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


def splitmix64_reference(seed: int, position: int) -> int:
    """uniforms' hash in plain Python uint64 arithmetic."""
    mask = 2**64 - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    state = mix(mix(seed) ^ position)
    return mix((state + 0x9E3779B97F4A7C15) & mask)


def test_uniform_is_the_uint64_hash_bit_for_bit():
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1])
    positions = torch.tensor([0, 7, 100_000, 3])
    expected = [((splitmix64_reference(s, p) >> 12) + 0.5) / 2**52 for s, p in zip(seeds.tolist(), positions.tolist())]
    u = uniforms(seeds, positions)
    assert u.dtype == torch.float64 and u.device.type == "cpu" and u.tolist() == expected


def test_uniform_strictly_inside_unit_interval_and_uniform():
    extremes = _to_unit(np.array([0, 2**64 - 1, 2**63 - 1, 2**63], dtype=np.uint64))  # all-zero, all-one, sign bits
    assert extremes.dtype == np.float64
    assert extremes.tolist() == [2**-53, 1 - 2**-53, 0.5 - 2**-53, 0.5 + 2**-53]

    n = 2**18
    u = uniforms(torch.arange(n) % 512, torch.arange(n) // 512)  # 512 seeds x 512 positions
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.002
    assert abs(u.var().item() - 1 / 12) < 0.001
    histogram = torch.histc(u, bins=16, min=0, max=1) / n
    assert (histogram - 1 / 16).abs().max() < 0.002


def test_invert_draws_only_tokens_of_nonzero_weight_even_at_the_ends_of_u():
    cdf = torch.tensor([0.0, 0.0, 2.0, 2.0, 5.0, 5.0, 5.0], dtype=torch.float64).expand(4, 7).clone()
    u = torch.tensor([2**-53, 0.3, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0 is past uniforms' range
    assert _invert(cdf, cdf[:, -1], u).tolist() == [2, 2, 4, 4]
    # A cut at the first index reaching mass 2 (top-k/top-p) keeps the draw at or before it.
    assert _invert(cdf, torch.full((4,), 2.0, dtype=torch.float64), u).tolist() == [2, 2, 2, 2]


def test_cumulative_weights_keep_the_tail_mass_of_a_real_vocab():
    # One likely token and 151935 tokens of probability ~1e-8: in float32 each
    # addition would fall below the running sum's ulp and the tail, 0.15% of
    # the mass, would never be drawn.
    V = 151936
    logits = torch.full((1, V), -18.4)
    logits[0, 0] = 0.0
    cdf = _cumulative_weights(logits, logits[:, 0], torch.ones(1, 1))
    exact = math.fsum(logits[0].exp().double().tolist())
    assert abs(cdf[0, -1].item() - exact) < 1e-12
    assert (cdf[0, -1] - cdf[0, 0]).item() > 1e-3


# ----------------------------------------------------------------------------- sample


def tempered_log_softmax(logits, tokens, temperature):
    """The logprob the sampler returns, computed directly: log_softmax(logits / T) at
    each row's token, untempered (T = 1) for a greedy row (T = 0)."""
    temperature = torch.as_tensor(temperature, dtype=torch.float64).expand(logits.shape[0])
    tempered = logits.double() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    return tempered.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def test_greedy_is_argmax_with_the_untempered_logprob():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    tokens, logprobs = run(logits, temperature=0.0, top_p=0.3, top_k=5)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), logits.double().log_softmax(-1).amax(-1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_row", [True, False])
def test_sampled_logprobs_are_of_the_tempered_distribution_without_truncation(per_row):
    # What the trainer computes for the token (logits / T, the full vocabulary), whatever top-k and top-p kept.
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for temperature in (0.7, 1.0, 1.6):
        tokens, logprobs = run(logits, temperature=temperature, top_p=0.9, top_k=10, per_row=per_row)
        torch.testing.assert_close(logprobs.double(), tempered_log_softmax(logits, tokens, temperature),
                                   rtol=0, atol=1e-6)


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


@pytest.mark.parametrize("truncate", [True, False])
def test_same_seed_and_position_same_token_whatever_the_batch(truncate):
    torch.manual_seed(0)
    B, V = 12, 300
    logits = torch.randn(B, V)
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.3] * 3)
    # Without truncate, the caller promises no row uses top-k or top-p.
    top_p = torch.tensor([1.0, 0.9, 0.8] * 4) if truncate else torch.ones(B)
    top_k = torch.tensor([-1, 50, V, 7] * 3) if truncate else torch.full((B,), -1)
    seeds = torch.randint(0, 2**62, (B,))
    positions = torch.randint(0, 4096, (B,))

    def draw(rows, others=0):
        """The rows' tokens and logprobs, after `others` unrelated rows in the same batch."""
        extra = torch.arange(others)
        tokens, logprobs = sample(
            torch.cat([torch.randn(others, V), logits[rows]]),
            torch.cat([torch.full((others,), 0.9), temperature[rows]]),
            torch.cat([torch.full((others,), 0.5 if truncate else 1.0), top_p[rows]]),
            torch.cat([torch.full((others,), 3 if truncate else -1), top_k[rows]]),
            uniforms(torch.cat([extra, seeds[rows]]), torch.cat([extra * 9, positions[rows]])),
            truncate=truncate,
        )
        return tokens[others:], logprobs[others:]

    everything = torch.arange(B)
    tokens, logprobs = draw(everything)
    assert len(set(tokens.tolist())) > 6
    again, again_lp = draw(everything)
    assert torch.equal(again, tokens) and torch.equal(again_lp, logprobs)  # deterministic

    perm = torch.randperm(B)
    shuffled, shuffled_lp = draw(perm)
    assert torch.equal(shuffled, tokens[perm]) and torch.equal(shuffled_lp, logprobs[perm])
    # Row 5 alone, and beside rows it was never batched with.
    assert draw([5])[0].item() == tokens[5].item()
    assert draw([5], others=3)[0].item() == tokens[5].item()


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_one_number_per_parameter_draws_what_per_row_tensors_of_it_draw(temperature, truncate):
    # The engine's call: the sampler skips the argmax (temperature > 0) and the division (temperature 0 or 1).
    torch.manual_seed(0)
    logits = torch.randn(64, 3000) * 4
    top_p, top_k = (0.9, 40) if truncate else (1.0, -1)
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, positions=torch.arange(64), truncate=truncate)
    tokens, logprobs = run(logits, **kwargs, per_row=False)
    expected_tokens, expected_logprobs = run(logits, **kwargs)
    assert torch.equal(tokens, expected_tokens) and logprobs.dtype == torch.float32
    assert torch.equal(logprobs, expected_logprobs)
    # From the draw's float64 sum: within two float32 roundings of the exact value (of the shifted
    # logit and of its division by the temperature), plus ~1e-9 from the float32 weights it sums.
    torch.testing.assert_close(logprobs.double(), tempered_log_softmax(logits, tokens, temperature),
                               rtol=2.4e-7, atol=1e-8)


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


@pytest.mark.parametrize("truncate", [True, False])
def test_empirical_distribution_matches_softmax(truncate):
    # One row per seed, over probabilities from 0.3 down to 0.005 in shuffled
    # vocab order, so sorted and vocab order differ; top_p = 1 keeps them all.
    n = 20000
    probs = torch.tensor([0.005, 0.3, 0.02, 0.1, 0.01, 0.2, 0.05, 0.015, 0.15, 0.08, 0.07])
    tokens, _ = run(repeat(probs.tolist(), n), temperature=1.0, positions=17, truncate=truncate)
    expected = probs / probs.sum() * n
    chi_square = ((tokens.bincount(minlength=len(probs)) - expected) ** 2 / expected).sum().item()
    degrees = len(probs) - 1
    assert chi_square < degrees + 5 * math.sqrt(2 * degrees)  # a false alarm has odds of about 1e-5


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("truncate", [True, False])
def test_masked_tokens_are_never_drawn(truncate, per_row):
    # -inf at both ends and inside, where a draw that ran past the kept mass would land.
    n, V = 4000, 12
    logits = torch.zeros(n, V)
    masked = [0, 3, 4, 10, 11]
    logits[:, masked] = float("-inf")
    for temperature in (0.3, 1.0, 5.0):
        tokens, logprobs = run(logits, temperature=temperature, truncate=truncate, per_row=per_row)
        assert set(tokens.tolist()) == set(range(V)) - set(masked)
        assert torch.isfinite(logprobs).all()


def test_tiny_temperature_is_argmax_and_draws_among_tied_maxima():
    n = 400
    logits = torch.tensor([[1.0, 3.0, 3.0 - 1e-6, -2.0], [1e4, -1e4, 0.0, 1e4]]).repeat(n, 1)
    for temperature in (1e-30, 1e-45):  # logits / temperature overflows float32 in the second
        for truncate in (True, False):
            tokens, _ = run(logits, temperature=temperature, seeds=torch.arange(2 * n), truncate=truncate)
            assert set(tokens[0::2].tolist()) == {1}
            assert set(tokens[1::2].tolist()) == {0, 3}


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


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("truncate", [True, False])
def test_sampling_never_makes_the_host_wait(truncate, per_row):
    B = 8
    u = uniforms(torch.arange(B), torch.arange(B))  # the caller's, on the host, copied with its other inputs
    params = ([torch.tensor([0.0, 0.7] * 4), torch.full((B,), 0.9 if truncate else 1.0),
               torch.full((B,), 20 if truncate else -1)] if per_row else [1.0, 0.9 if truncate else 1.0, 20])
    with HostSyncGuard() as guard:
        sample(torch.randn(B, 500), *params, u, truncate=truncate)
    assert guard.calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("truncate", [True, False])
def test_cuda_draws_what_cpu_draws_without_a_sync(truncate, per_row):
    torch.manual_seed(0)
    B, V = 64, 151936
    logits = (torch.randn(B, V) * 3).bfloat16()
    params = [0.8 if per_row else 1.0, 0.9 if truncate else 1.0, 50 if truncate else -1]
    rows = [torch.full((B,), x) for x in params] if per_row else params
    u = uniforms(torch.arange(B) * 7919, torch.arange(B))
    on_cpu, lp_cpu = sample(logits, *rows, u, truncate=truncate)
    on_device = [r.cuda() for r in rows] if per_row else rows
    u = u.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_cuda, lp_cuda = sample(logits.cuda(), *on_device, u, truncate=truncate)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The float sums may round differently: a token moves only when U falls at a boundary.
    same = on_cuda.cpu() == on_cpu
    assert (~same).sum() <= 1
    assert (lp_cuda.cpu() - lp_cpu)[same].abs().max() <= 1e-4  # float32 log_softmax over 151936 tokens: ~3e-5
