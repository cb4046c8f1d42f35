"""The engine's sample() at a decode step's shape: time per call and peak workspace.

    python tools/bench_sampler.py                                   # B=128, V=151936, bf16 logits
    python tools/bench_sampler.py --compare /tmp/old_sampler.py     # beside another file's sample()

Every backend of sample() that runs on the device is timed side by side: "torch"
(four passes over the logits and a stable sort when truncating) and, on CUDA with
triton, "triton" (rollplex/ops/sample_triton.py: one read of the logits untruncated).

Each row is one sample() call on random logits, every row sampled at temperature
1, without truncation (`truncate=False`, the engine's call when no request uses
top-k or top-p) and with top_k=50, top_p=0.9. Time and peak memory are measured
as tools/bench_train_attention.py measures them (CUDA: median of five after a
warm-up; CPU: one call's wall time after an untimed one).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from typing import Callable

import torch

from bench_train_attention import measure
from rollplex.engine.sampler import sample, uniforms
from rollplex.ops.paged_decode_triton import triton_available


def load_sample(path: str) -> Callable:
    """`sample` from a Python file with the same signature as rollplex.engine.sampler.sample."""
    spec = importlib.util.spec_from_file_location("compared_sampler", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.sample


def backends(device: torch.device) -> dict[str, Callable]:
    """sample() with each backend that runs on `device`, by name."""
    names = ("torch", "triton") if device.type == "cuda" and triton_available(device) else ("torch",)
    return {name: functools.partial(sample, backend=name) for name in names}


def bench(sample_fn: Callable, batch: int, vocab: int, device: torch.device, dtype: torch.dtype,
          truncate: bool) -> tuple[float, float]:
    """(ms per call, peak MB) of sample_fn on one (batch, vocab) step."""
    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    top_p, top_k = (0.9, 50) if truncate else (1.0, -1)
    u = uniforms(torch.arange(batch), torch.full((batch,), 100)).to(device)

    def call() -> None:
        sample_fn(logits, 1.0, top_p, top_k, u, truncate=truncate)  # the engine's call: one value per parameter

    call()
    measured = measure(call, device)
    return measured.seconds * 1e3, measured.peak_bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="of the logits")
    parser.add_argument("--compare", metavar="FILE", help="a file whose sample() to time beside rollplex's")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    samplers = backends(device) | ({args.compare: load_sample(args.compare)} if args.compare else {})
    print(f"B={args.batch} V={args.vocab} {args.dtype} logits on {device}")
    for name, sample_fn in samplers.items():
        for truncate in (False, True):
            ms, mb = bench(sample_fn, args.batch, args.vocab, device, dtype, truncate)
            print(f"{name:>24}  truncate={truncate!s:5}  {ms:9.2f} ms  peak {mb:8.1f} MB")


if __name__ == "__main__":
    main()
