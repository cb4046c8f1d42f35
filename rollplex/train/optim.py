"""What the actor's optimizer needs besides AdamW itself: its state held in host
memory between steps (`OptimizerOffload`, parallel.offload_optimizer), the
learning-rate schedule, and the gradient norm over DTensors on several meshes."""

from __future__ import annotations

import math

import torch

from rollplex.dist import full_tensor, local_tensor


class OptimizerOffload:
    """Optimizer state lives in host memory between steps.

    Each state tensor keeps its identity (AdamW and checkpoints hold references
    to it, FSDP2's are DTensors): its device storage is copied to a pinned host
    buffer and shrunk to zero bytes, then regrown and refilled just before the
    next step. On CPU the same code runs; the host buffer is then ordinary memory.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.host: dict[int, torch.Tensor] = {}

    def _tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:  # AdamW's scalar step stays put
                    out.append(local_tensor(value))
        return out

    def offload(self) -> None:
        tensors = self._tensors()
        for t in tensors:
            if id(t) not in self.host:
                self.host[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                               pin_memory=t.is_cuda)
            self.host[id(t)].copy_(t, non_blocking=True)
        if tensors and tensors[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the copies must land before the storage goes
        for t in tensors:
            t.untyped_storage().resize_(0)

    def load(self) -> None:
        for t in self._tensors():
            if t.untyped_storage().size() == 0 and id(t) in self.host:
                t.untyped_storage().resize_(t.numel() * t.element_size())
                t.copy_(self.host[id(t)], non_blocking=True)


def lr_schedule(kind: str, warmup_steps: int, total_steps: int):
    """LR multiplier per optimizer step: linear warmup, then constant or cosine to 0."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr schedule {kind!r}: expected constant or cosine")
    return factor


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients, whatever mix of meshes their DTensors live on
    (TP-sharded layers on the 2D mesh, the rest on the dp mesh alone): each
    parameter's norm is made whole on its own mesh, then the norms combine."""
    norms = [torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32) for g in grads]
    norms = [full_tensor(n) for n in norms]
    return torch.linalg.vector_norm(torch.stack(norms), 2)
