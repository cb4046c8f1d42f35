"""The actor side: per-token logprob passes over packed GRPO groups."""

from __future__ import annotations

import torch

from rollplex.models.packing import TrainBatch
from rollplex.models.qwen2_5_vl import Qwen2_5_VL, VisionEmbeds
from rollplex.train.loss import entropy_from_logits


def response_logprobs(model: Qwen2_5_VL, batch: TrainBatch, vision: VisionEmbeds | None = None,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (float32) of every response token of the batch, flat in target
    order, and optionally the entropy of each predicting distribution. Logits
    are computed only at the positions that predict a response token."""
    hidden = model.forward_packed(batch.packed, vision)
    logits = model.logits(hidden[batch.target_index]).float()
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, batch.target_ids[:, None])[:, 0]
    return logprobs, entropy_from_logits(logits) if with_entropy else None
