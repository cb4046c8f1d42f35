"""Kernel cases for the Triton sampler (rollplex/ops/sample_triton.py) against the torch path.

Not collected by pytest directly: tests/test_sample_triton.py runs this file in a
fresh process, with TRITON_INTERPRET=1 on CPU (the variable only works when set
before triton is first imported), or compiled on a CUDA machine. The torch path,
rollplex.engine.sampler.sample(backend="torch"), is the reference: the same tokens,
logprobs within float32 rounding.

The interpreter runs tl.sort as a Python-level reduction (~30 s per row at the
default 4,096 candidates), so on CPU the truncated cases sort at most CPU_CANDIDATES;
with 16 most rows bisect instead, so both ways of drawing are checked.
"""

import math
import os

import numpy as np
import pytest
import torch

from rollplex.engine.sampler import sample, uniforms
from rollplex.ops import sample_triton as st

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 on CPU (see tests/test_sample_triton.py)")
CPU_CANDIDATES = (16, 128)
CANDIDATES = CPU_CANDIDATES if DEVICE == "cpu" else (16, st.CANDIDATES)


def draw_both(logits, temperature, top_p, top_k, u, truncate, candidates=st.CANDIDATES):
    """(torch tokens, torch logprobs, triton tokens, triton logprobs) for the same call, the
    reference on CPU (on CUDA the torch path's sums add in another order)."""
    on_cpu = [x.cpu() if isinstance(x, torch.Tensor) else x for x in (logits, temperature, top_p, top_k, u)]
    ref_tokens, ref_logprobs = sample(*on_cpu, truncate=truncate, backend="torch")
    on_device = [x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in (logits, temperature, top_p, top_k, u)]
    tokens, logprobs = st.sample_triton(*on_device, truncate=truncate, candidates=candidates)
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    return ref_tokens, ref_logprobs, tokens.cpu(), logprobs.cpu()


def assert_same_draws(logits, temperature, top_p, top_k, u, truncate, candidates=st.CANDIDATES):
    ref_tokens, ref_logprobs, tokens, logprobs = draw_both(logits, temperature, top_p, top_k, u, truncate,
                                                           candidates)
    assert tokens.tolist() == ref_tokens.tolist()
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=1e-6, atol=1e-7)
    return tokens


def random_case(batch, vocab, seed, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * scale).to(dtype)
    return logits, uniforms(torch.arange(batch) * 7919 + seed, torch.arange(batch) + 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp16 reads as bf16 does: one cast
@pytest.mark.parametrize("vocab", [1000, 5000])  # one tile, and three with a partial last one
def test_untruncated_draws_what_the_torch_path_draws(dtype, vocab):
    logits, u = random_case(32, vocab, seed=vocab, dtype=dtype)
    per_row = torch.tensor([0.0, 1.0, 0.6, 1.7] * 8)
    # At 1 and 0 (drawn at 1) the kernels' division by T is exact; a greedy row takes the argmax.
    for temperature in (1.0, 0.7, 0.0, per_row):
        tokens = assert_same_draws(logits, temperature, 1.0, -1, u, truncate=False)
        assert len(set(tokens.tolist())) > 20
    greedy = assert_same_draws(logits, per_row, 1.0, -1, u, truncate=False)[per_row == 0]
    assert torch.equal(greedy, logits.float().argmax(-1)[per_row == 0])


@pytest.mark.parametrize("candidates", CANDIDATES)
@pytest.mark.parametrize("top_p,top_k", [(0.9, 40), (0.9, -1), (1.0, 10), (0.5, 3), (1.0, -1), (0.95, 5000)])
def test_truncated_draws_what_the_torch_path_draws(top_p, top_k, candidates):
    # Decreasing-logit order, as the torch path's stable sort; (1.0, -1) in a truncating call is the
    # whole ranking, and top_k 5000 >= the vocabulary is off.
    logits, u = random_case(12, 3000, seed=top_k + 7)
    assert_same_draws(logits, 0.8, top_p, top_k, u, truncate=True, candidates=candidates)


@pytest.mark.parametrize("candidates", CANDIDATES)
def test_truncated_per_row_parameters(candidates):
    logits, u = random_case(12, 2500, seed=3)
    temperature = torch.tensor([0.0, 1.0, 0.5, 1.3] * 3)
    top_p = torch.tensor([1.0, 0.9, 0.8, 0.3] * 3)
    top_k = torch.tensor([-1, 50, 2500, 7, 1, -1] * 2)
    tokens = assert_same_draws(logits, temperature, top_p, top_k, u, truncate=True, candidates=candidates)
    assert torch.equal(tokens[temperature == 0], logits.argmax(-1)[temperature == 0])


@pytest.mark.parametrize("candidates", CANDIDATES)
def test_ties_at_the_cut_keep_the_lower_indices(candidates):
    # Logits on a grid of 9 values: the k-th logit and the nucleus' last one are shared by
    # many tokens, of which the ranking keeps the lowest indices first; so does the draw.
    g = torch.Generator().manual_seed(5)
    batch = 16
    logits = torch.randint(-4, 5, (batch, 700), generator=g).float() * 0.5
    u = uniforms(torch.arange(batch), torch.zeros(batch, dtype=torch.long))
    for top_p, top_k in ((1.0, 5), (0.6, -1), (0.3, 40)):
        tokens = assert_same_draws(logits, 1.0, top_p, top_k, u, truncate=True, candidates=candidates)
        assert len(set(tokens.tolist())) > 5


def test_a_tail_token_gets_its_own_float64_interval():
    # One dominant logit and 151,935 tail tokens of probability ~1e-8 each: U placed in the
    # middle of a tail token's interval (in float64, exactly) must draw that token. In float32
    # the running sum's step near the total is ~6e-8, and the tail could not be drawn at all.
    vocab, dominant, tail = 151936, 70001, -18.4
    logits = torch.full((1, vocab), tail)
    logits[0, dominant] = 0.0
    w = math.exp(np.float32(tail))  # the weight of every tail token, relative to the dominant one
    total = 1.0 + (vocab - 1) * w
    wanted = [0, 1, 2047, 2048, 65000, dominant + 1, 100000, vocab - 1]  # in tiles before and after the max

    def interval_middle(token):
        before = (token if token < dominant else token - 1 + 1.0 / w) * w  # tail tokens (and the max) before it
        return (before + 0.5 * w) / total

    u = torch.tensor([interval_middle(t) for t in wanted], dtype=torch.float64)
    logits = logits.expand(len(wanted), vocab).clone()
    ref_tokens, _, tokens, logprobs = draw_both(logits, 1.0, 1.0, -1, u, truncate=False)
    assert ref_tokens.tolist() == wanted and tokens.tolist() == wanted
    torch.testing.assert_close(logprobs.double(), torch.full((len(wanted),), float(np.float32(tail)) - math.log(total),
                                                              dtype=torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("truncate", [False, True])
def test_nonfinite_rows_give_nan_logprobs_and_valid_tokens(truncate):
    # As tests/test_nonfinite.py asks of the sampler: NaN or +inf in a row, or a row all -inf, makes
    # the logprob NaN; masked -inf logits alone do not, and are never drawn.
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 7], logits[1, 7], logits[2], logits[3, 3:], logits[4] = math.nan, math.inf, -math.inf, -math.inf, math.nan
    usable = torch.tensor([False, False, False, True, False, True])
    u = uniforms(torch.arange(6), torch.full((6,), 5))
    for temperature in (1.0, 0.0, 0.7):
        for top_k in (-1, 5):
            tokens, logprobs = st.sample_triton(logits.to(DEVICE), temperature, 0.9, top_k, u.to(DEVICE),
                                                truncate=truncate, candidates=16)
            tokens, logprobs = tokens.cpu(), logprobs.cpu()
            assert ((0 <= tokens) & (tokens < 50)).all() and tokens[3] < 3
            assert torch.equal(logprobs.isfinite(), usable)


@pytest.mark.parametrize("truncate", [False, True])
def test_masked_tokens_are_never_drawn_and_tiny_temperatures_take_the_tied_maxima(truncate):
    n = 64
    logits = torch.zeros(n, 12)
    logits[:, [0, 3, 4, 10, 11]] = -math.inf
    u = uniforms(torch.arange(n), torch.zeros(n, dtype=torch.long))
    tokens = assert_same_draws(logits, 1.0, 1.0, -1, u, truncate=truncate, candidates=16)
    assert set(tokens.tolist()) == {1, 2, 5, 6, 7, 8, 9}
    tied = torch.tensor([[1e4, -1e4, 0.0, 1e4]]).expand(n, 4).clone()
    for temperature in (1e-30, 1e-45):  # logits / temperature overflows float32 in the second
        tokens = assert_same_draws(tied, temperature, 1.0, -1, u, truncate=truncate, candidates=16)
        assert set(tokens.tolist()) == {0, 3}


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    logits, u = random_case(10, 3000, seed=9)
    for truncate in (False, True):
        together, _ = st.sample_triton(logits.to(DEVICE), 0.9, 0.9, 20, u.to(DEVICE), truncate=truncate,
                                       candidates=CANDIDATES[-1])
        alone, _ = st.sample_triton(logits[4:5].to(DEVICE), 0.9, 0.9, 20, u[4:5].to(DEVICE), truncate=truncate,
                                    candidates=CANDIDATES[-1])
        assert alone.item() == together[4].item()


def test_empty_batch():
    tokens, logprobs = st.sample_triton(torch.zeros(0, 100, device=DEVICE), 1.0, 1.0, -1,
                                        torch.zeros(0, dtype=torch.float64, device=DEVICE), truncate=False)
    assert tokens.shape == logprobs.shape == (0,)
