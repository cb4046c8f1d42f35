"""The logprob head computes the micro-batch's logits chunk by chunk, and its backward
recomputes them: the same values and gradients as the whole batch's logits at once,
in a fraction of the memory."""

import sys
from pathlib import Path

import pytest
import torch

from rollplex.train.logprob_head import _head, logits_chunk_tokens, token_logprobs
from test_actor import build_model
from test_model import tiny_args

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_logprob_head  # noqa: E402


def loss_and_grads(model, hidden, targets, chunk_tokens: int | None):
    """The actor's loss terms over the head at temperature 0.7; chunk_tokens None: the whole batch at once."""
    model.zero_grad(set_to_none=True)
    hidden.grad = None
    if chunk_tokens is None:
        logprobs, entropy = _head(model.logits, hidden, targets, 0.7, True)
    else:
        logprobs, entropy = token_logprobs(model, hidden, targets, True, 0.7, chunk_tokens)
    weights = torch.linspace(-1.0, 1.0, len(targets))
    ((logprobs * weights).sum() + 0.1 * entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), hidden.grad.clone(), grads


@pytest.mark.parametrize("chunk_tokens", [1, 4, 13, 1000])
def test_chunks_give_the_whole_batchs_values_and_gradients(chunk_tokens):
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    hidden = torch.randn(13, model.args.text.hidden_size, requires_grad=True)
    targets = torch.randint(0, model.args.text.vocab_size, (13,))
    whole = loss_and_grads(model, hidden, targets, None)
    chunked = loss_and_grads(model, hidden, targets, chunk_tokens)
    for a, b in zip(chunked[:3], whole[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # float32 rounding of differently shaped matmuls
    assert chunked[3].keys() == whole[3].keys() and chunked[3]  # the head's weights get their gradient
    for name in whole[3]:
        torch.testing.assert_close(chunked[3][name], whole[3][name], rtol=0, atol=1e-5)


def test_without_gradients_and_without_tokens():
    model = build_model(tiny_args(), seed=5, init_std=None)
    hidden = torch.randn(9, model.args.text.hidden_size)
    targets = torch.randint(0, model.args.text.vocab_size, (9,))
    with torch.no_grad():
        logprobs, entropy = token_logprobs(model, hidden, targets, chunk_tokens=2)
        whole, _ = _head(model.logits, hidden, targets, 1.0, False)
    torch.testing.assert_close(logprobs, whole, rtol=0, atol=1e-6)
    assert entropy is None
    none, no_entropy = token_logprobs(model, hidden[:0], targets[:0], with_entropy=True)
    assert none.shape == no_entropy.shape == (0,)


def test_a_real_vocabulary_gets_chunks_of_128_mib_of_logits():
    assert logits_chunk_tokens(151936) == 220 and logits_chunk_tokens(100) == 335544


def test_the_peak_is_under_an_eighth_of_the_whole_batchs():
    """At 4,096 tokens and a 151,936-token vocabulary the head runs in chunks of 220 tokens
    (18.6 per micro-batch); here a quarter of the tokens and a tenth of the vocabulary in
    chunks of 55, the same 18.6, so the logits' share of either peak scales alike."""
    head, hidden, targets = bench_logprob_head.inputs(1024, 64, 15194, torch.device("cpu"), torch.float32)
    whole = bench_logprob_head.run_head(head, hidden, targets, chunked=False)
    chunked = bench_logprob_head.run_head(head, hidden, targets, chunked=True, chunk_tokens=55)
    assert chunked.peak_bytes <= whole.peak_bytes / 8, (chunked.peak_bytes, whole.peak_bytes)
    torch.testing.assert_close(chunked.grad_weight, whole.grad_weight, rtol=0, atol=1e-4)
