"""Non-finite logits in the engine: detected at almost no cost, then located by a rerun.

Detection reads what each step reads back anyway. The logprob of a sampled
token is log_softmax of its row, gathered: a NaN or a +inf anywhere in the row
makes the row's log-sum-exp NaN, and with it every logprob of the row, and so
does a row that is all -inf. Masked tokens' -inf logits alone never do (they
are never drawn). So the sampled logprobs, on the host already, are finite
exactly when the logits are usable.

Locating runs only after a detection: the failing step's forward again, eager
(no CUDA graph), with a finiteness check after the embedding, each decoder
layer and the final norm, on the failing rows only, and on their logits. It
writes the same K/V into the same slots as the step did; the engine raises
right after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rollplex.models.inputs import VisionEmbeds
from rollplex.models.protocol import VisionLanguageModel


class NonFiniteLogitsError(RuntimeError):
    """The logits of an engine step hold NaN or inf: nothing of the step was sampled."""

    def __init__(self, step_kind: str, step_index: int, samples: list[tuple[int, int]], where: str):
        self.step_kind, self.step_index = step_kind, step_index  # "prefill" or "decode"; 0-based within generate()
        self.samples = samples  # (request index, sample index) of each non-finite row
        self.where = where  # the first stage of the model whose output is non-finite for those rows
        super().__init__(f"non-finite logits (NaN or inf) at engine step {step_index} ({step_kind}) of this "
                         f"generate call, for {_describe(samples)}; they first appear in the output of: {where} "
                         "(an eager rerun of the step, checked stage by stage on those rows)")


def _describe(samples: list[tuple[int, int]], most: int = 8) -> str:
    by_request: dict[int, list[int]] = {}
    for request, sample in samples:
        by_request.setdefault(request, []).append(sample)
    parts = [f"request {r} (sample{'s' if len(s) > 1 else ''} {', '.join(map(str, s))})"
             for r, s in by_request.items()]
    more = f" and {len(parts) - most} more requests" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more


def first_nonfinite_stage(model: VisionLanguageModel, forward: Callable[[], torch.Tensor], token_rows: torch.Tensor,
                          logit_rows: torch.Tensor, vision: Sequence[VisionEmbeds | None] = ()) -> str:
    """Run `forward` (the step's forward, returning its logits) and name the first
    stage whose output is non-finite at `token_rows` of the packed tokens (or, for
    the head, at `logit_rows` of the logits): "embedding", "vision" (the prompts'
    stored `vision` features), "decoder layer i", "final norm" or "head"."""
    stages = model.decoder_stages()
    nonfinite: dict[str, bool] = {}

    def check(name: str):
        def hook(module, args, output):
            nonfinite[name] = nonfinite.get(name, False) or not _finite(output[token_rows])
        return hook

    handles = [module.register_forward_hook(check(name)) for name, module in stages.items()]
    try:
        logits = forward()
    finally:
        for handle in handles:
            handle.remove()
    nonfinite["vision"] = not all(_finite(t) for v in vision if v is not None for t in v.tensors())
    nonfinite["head"] = not _finite(logits[logit_rows])
    order = ["embedding", "vision", *list(stages)[1:], "head"]
    return next((name for name in order if nonfinite.get(name)),
                "nowhere: the rerun's logits are finite (the step's own run, a CUDA graph say, differs from it)")


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())
