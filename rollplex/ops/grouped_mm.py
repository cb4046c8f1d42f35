"""Grouped GEMM: rows of a packed input, sorted by expert, each multiplied by its expert's weight.

`grouped_mm(x, weight, ends)`: x (rows, in), weight (experts, in, out), and `ends`
(experts,) int32, the cumulative row count of each expert (its rows are
x[ends[e - 1]:ends[e]]) -> (rows, out). Two backends, the same arithmetic:
- "grouped": `torch._grouped_mm`, one kernel for every expert, reading `ends` on
  the device (no host sync, so it runs inside a CUDA graph); bf16 on sm90 is what it
  is built for. It runs on CPU as well (where the tests check it against the loop);
  every row stride must be a multiple of 16 bytes.
- "loop": one matmul per expert, reading `ends` on the host: the plain reference,
  and the CPU default.
"""

from __future__ import annotations

import torch

GROUPED_MM_BACKENDS = ("auto", "grouped", "loop")


def resolve_grouped_mm(name: str, device: torch.device) -> str:
    """auto: "grouped" on CUDA, "loop" elsewhere."""
    if name not in GROUPED_MM_BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {name!r}: expected one of {', '.join(GROUPED_MM_BACKENDS)}")
    if name == "auto":
        return "grouped" if device.type == "cuda" else "loop"
    return name


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, backend: str = "loop") -> torch.Tensor:
    """x (rows, in) sorted by expert, weight (experts, in, out), ends (experts,) int32 -> (rows, out)."""
    if backend == "grouped":
        # The kernel needs its gradient's strides whole: a broadcast one (from a sum) has zero strides.
        return _GroupedMM.apply(x, weight, ends)
    return _loop_mm(x, weight, ends)


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    bounds = [0, *ends.tolist()]
    parts = [x[start:end] @ weight[e] for e, (start, end) in enumerate(zip(bounds, bounds[1:])) if end > start]
    if not parts:
        return x.new_zeros(x.shape[0], weight.shape[-1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _GroupedMM(torch.autograd.Function):
    """torch._grouped_mm with its backward given contiguous output gradients, as its kernel needs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        return torch._grouped_mm(x, weight, offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad, weight.transpose(1, 2), offs=ends)
        if ctx.needs_input_grad[1]:
            # (in, rows) x (rows, out) per expert: the rows are the contraction, grouped by the same ends.
            grad_w = torch._grouped_mm(x.t(), grad, offs=ends)
        return grad_x, grad_w, None
