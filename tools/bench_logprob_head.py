"""The logprob head's forward and backward at one micro-batch's shape: today's chunked head beside the
whole-batch head it replaced, time and peak memory, side by side.

    python tools/bench_logprob_head.py                     # 4,096 tokens, hidden 2048, vocabulary 151,936
    python tools/bench_logprob_head.py --tokens 1024 --vocab 15194 --chunk-tokens 55

The head is a bias-free linear layer (an lm_head), its loss the actor's with the entropy bonus:
sum(w * logprob) + 0.01 * sum(entropy) at temperature 0.7. "whole" computes every token's logits at
once and keeps them for the backward (rollplex.train.logprob_head's `_head` on the whole batch, what
the actor ran before the chunked head); "chunked" is `token_logprobs`. Peak memory is above what the
head's parameters and inputs hold before the call, the weight's gradient included (both allocate it).
Time and memory are measured as tools/bench_train_attention.py measures them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from bench_train_attention import measure
from rollplex.train.logprob_head import _head, logits_chunk_tokens, token_logprobs


class LinearHead(torch.nn.Module):
    """An lm_head with what the logprob head reads of a model: `logits` and the vocabulary size."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
        self.args = SimpleNamespace(text=SimpleNamespace(vocab_size=vocab_size))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@dataclass
class HeadRun:
    seconds: float
    peak_bytes: int
    logprobs: torch.Tensor
    entropy: torch.Tensor
    grad_hidden: torch.Tensor
    grad_weight: torch.Tensor


def run_head(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, chunked: bool,
             chunk_tokens: int | None = None, temperature: float = 0.7) -> HeadRun:
    """One forward and backward of the head (chunked or whole), measured."""
    weights = torch.linspace(-1.0, 1.0, len(targets), device=hidden.device)
    out = {}

    def step() -> None:
        head.zero_grad(set_to_none=True)
        hidden.grad = None
        if chunked:
            logprobs, entropy = token_logprobs(head, hidden, targets, True, temperature, chunk_tokens)
        else:
            logprobs, entropy = _head(head.logits, hidden, targets, temperature, True)
        ((logprobs * weights).sum() + 0.01 * entropy.sum()).backward()
        out.update(logprobs=logprobs.detach(), entropy=entropy.detach())

    measured = measure(step, hidden.device)
    return HeadRun(measured.seconds, measured.peak_bytes, out["logprobs"], out["entropy"], hidden.grad.clone(),
                   head.lm_head.weight.grad.clone())


def inputs(tokens: int, hidden_size: int, vocab: int, device: torch.device,
           dtype: torch.dtype) -> tuple[LinearHead, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    head = LinearHead(hidden_size, vocab).to(device, dtype)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype, requires_grad=True)
    return head, hidden, torch.randint(0, vocab, (tokens,), device=device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: logits_chunk_tokens(vocab)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    a = parser.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    head, hidden, targets = inputs(a.tokens, a.hidden, a.vocab, device, dtype)
    chunk = a.chunk_tokens or logits_chunk_tokens(a.vocab)
    print(f"{a.tokens} tokens, hidden {a.hidden}, vocabulary {a.vocab}, {a.dtype} on {device}; chunks of {chunk}")
    whole = run_head(head, hidden, targets, chunked=False)
    chunked = run_head(head, hidden, targets, chunked=True, chunk_tokens=chunk)
    for name, r in (("whole", whole), ("chunked", chunked)):
        print(f"  {name:8s} {r.seconds * 1e3:9.1f} ms  peak {r.peak_bytes / 2**20:9.1f} MiB")
    print(f"  chunked / whole: time {chunked.seconds / whole.seconds:.2f}x, peak {chunked.peak_bytes / whole.peak_bytes:.3f}x")
    print(f"  largest differences: logprob {(chunked.logprobs - whole.logprobs).abs().max().item():.2e}, "
          f"d hidden {(chunked.grad_hidden - whole.grad_hidden).abs().max().item():.2e}, "
          f"d weight {(chunked.grad_weight - whole.grad_weight).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
