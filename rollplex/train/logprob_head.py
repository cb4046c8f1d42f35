"""The logprob head: each response token's logprob, and optionally its entropy, under the tempered policy.

    logprob_i = log softmax(z_i)[y_i],   entropy_i = H(softmax(z_i)),   z_i = logits(h_i) / T

at the rollout's temperature T (the policy the engine sampled from, rollplex.engine.sampler),
as verl's and TRL's actors compute it; the entropy is rollplex.train.loss.entropy_from_logits.

At a 151,936-token vocabulary the float32 logits take 0.6 MB per token per copy, about 2.5 GB
for 4,096 tokens, and the log-softmax, the entropy and their backward hold several copies at
once. So the head never holds the whole batch's logits: it runs over chunks of tokens whose
float32 logits fit `LOGITS_CHUNK_BYTES`, and keeps none of them for the backward, which
computes each chunk's logits again and backpropagates through them, one chunk at a time
(`_ChunkedHead`). Its peak is then a chunk's, whatever the micro-batch's length; the memory
plan counts the same (rollplex.rl.memory.estimates). Each token's values are computed by the
same ops as unchunked; only the matrix products' rounding may differ with the chunk's shape.

The backward computes the logits through the model's own head computation (its class's
`logits`, not the FSDP entry the forward went through): the head's parameters belong to the
root FSDP unit, which stays gathered from its forward until the end of the backward, so the
recomputation reads the same gathered weights and its gradients accumulate into them as the
forward's would; FSDP reduces them at the end of the backward.
"""

from __future__ import annotations

import functools

import torch

from rollplex.models.protocol import VisionLanguageModel
from rollplex.train.loss import entropy_from_logits

LOGITS_CHUNK_BYTES = 128 * 2**20  # one chunk's float32 logits: its working copies are a few of these


def logits_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as whose float32 logits fit LOGITS_CHUNK_BYTES (at least one)."""
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


def token_logprobs(model: VisionLanguageModel, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False,
                   temperature: float = 1.0, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (float32) of `targets[i]` under softmax(logits(hidden[i]) / temperature), and
    optionally that distribution's entropy, computed `chunk_tokens` tokens at a time (default:
    `logits_chunk_tokens`); with gradients, the backward recomputes each chunk's logits."""
    chunk = chunk_tokens or logits_chunk_tokens(model.args.text.vocab_size)
    if torch.is_grad_enabled() and hidden.requires_grad:
        logprobs, entropy = _ChunkedHead.apply(hidden, targets, model, temperature, with_entropy, chunk)
        return logprobs, entropy if with_entropy else None
    parts = [_head(model.logits, hidden[s:s + chunk], targets[s:s + chunk], temperature, with_entropy)
             for s in range(0, len(targets), chunk)]
    return _joined(parts, with_entropy, hidden.device)


def _head(logits_of, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
          with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logprobs (and entropy) of `targets`, the logits from `logits_of`."""
    logits = logits_of(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    return logprobs, entropy_from_logits(logits) if with_entropy else None


def _joined(parts: list[tuple[torch.Tensor, torch.Tensor | None]], with_entropy: bool,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not parts:  # no tokens
        empty = torch.zeros(0, device=device)
        return empty, empty.clone() if with_entropy else None
    logprobs = torch.cat([lp for lp, _ in parts])
    return logprobs, torch.cat([e for _, e in parts]) if with_entropy else None


class _ChunkedHead(torch.autograd.Function):
    """The head over chunks with nothing kept but its inputs: the backward recomputes each
    chunk's logits and backpropagates through them (the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, targets: torch.Tensor, model: VisionLanguageModel, temperature: float,
                with_entropy: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [_head(model.logits, hidden[s:s + chunk], targets[s:s + chunk], temperature, with_entropy)
                 for s in range(0, len(targets), chunk)]
        logprobs, entropy = _joined(parts, with_entropy, hidden.device)
        ctx.save_for_backward(hidden, targets)
        ctx.model, ctx.temperature, ctx.with_entropy, ctx.chunk = model, temperature, with_entropy, chunk
        # autograd.Function outputs must be tensors: without the entropy, an empty one nothing reads
        return logprobs, entropy if with_entropy else logprobs.new_zeros(0)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, targets = ctx.saved_tensors
        # The head's computation without FSDP's entry hooks, on the root unit's parameters, still gathered.
        logits_of = functools.partial(type(ctx.model).logits, ctx.model)
        grad_hidden = torch.zeros_like(hidden)
        with torch.enable_grad():
            for s in range(0, len(targets), ctx.chunk):
                piece = hidden[s:s + ctx.chunk].detach().requires_grad_()
                logprobs, entropy = _head(logits_of, piece, targets[s:s + ctx.chunk], ctx.temperature,
                                          ctx.with_entropy)
                outputs, grads = [logprobs], [grad_logprobs[s:s + ctx.chunk]]
                if ctx.with_entropy and grad_entropy is not None:
                    outputs.append(entropy)
                    grads.append(grad_entropy[s:s + ctx.chunk])
                torch.autograd.backward(outputs, grads)
                grad_hidden[s:s + ctx.chunk] = piece.grad
        return grad_hidden, None, None, None, None, None
