"""Training-pass attention of one GRPO group, shared prefix against naive, side by side.

    python tools/bench_train_attention.py --quick   # 7B geometry, 2k prompt, 8 x 512 (CPU: ~1 min)
    python tools/bench_train_attention.py           # every geometry x prompt x responses below

What is measured: forward + backward of one attention layer (the kernel call,
from rotary-applied q/k/v to its output), not of the whole model. The two passes:

    shared-prefix  the packed group [prompt | response_1 | ... | response_n] through
                   SharedPrefixAttention: the prompt attended once, each response over
                   [prompt K/V | its own K/V], as the trainer's shared-prefix forward runs it
    naive          n full sequences prompt + response_i through VarlenAttention (the
                   SDPA / flash-attn kernel path), as a plain per-sample trainer runs it

Peak memory is the peak of live tensor bytes above what was live before the
pass (its q/k/v inputs included): torch.cuda.max_memory_allocated on CUDA, and
on CPU the running sum of the allocations and frees torch.profiler records.
Time is one pass's wall time on CPU (under that profiler, which records only
allocations), and on CUDA the median of five passes timed with CUDA events after
one warm-up pass. The ratios are shared-prefix / naive: issue 12 asks for at most
0.5 in both at 7B geometry, a 2k prompt and 8 x 512 responses, on CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.ops.attention import (AttentionBackend, GroupLayout, SharedPrefixAttention, VarlenAttention,
                                    resolve_backend)

HEAD_DIM = 128
GEOMETRIES = {"3B": (16, 2), "7B": (28, 4), "32B": (40, 8)}  # (query heads, KV heads)
PROMPT_LENS = (2048, 8192)
RESPONSES = ((8, 512), (8, 1024))  # (n, tokens each)
QUICK = (("7B",), (2048,), ((8, 512),))


@dataclass
class Measured:
    seconds: float
    peak_bytes: int


def run_pass(attention: AttentionBackend, tokens: int, q_heads: int, kv_heads: int, device: torch.device,
             dtype: torch.dtype) -> Measured:
    """Forward + backward of `attention` over fresh random q/k/v of `tokens` rows."""
    def forward_backward() -> None:
        q = torch.randn(tokens, q_heads, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(tokens, kv_heads, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(tokens, kv_heads, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
        attention(0, q, k, v).float().square().sum().backward()

    return measure(forward_backward, device)


def measure(fn: Callable[[], None], device: torch.device) -> Measured:
    """`fn`'s time and its peak of live tensor bytes on `device`: on CPU one call's wall
    time, on CUDA the median of CUDA-event times after a warm-up."""
    return _measure_cuda(fn, device) if device.type == "cuda" else _measure_cpu(fn)


def add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU (as issue 12 measured), bfloat16 on CUDA")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch or flash")


def device_options(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, attention backend) from `add_device_options`' arguments."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    return device, dtype, resolve_backend(args.backend, device)


def _measure_cuda(fn: Callable[[], None], device: torch.device, repeats: int = 5) -> Measured:
    """The median of `repeats` timed calls after one untimed warm-up (the first call
    pays for kernel selection and library start-up, which a training step does not)."""
    fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        seconds.append(start.elapsed_time(end) / 1e3)
    return Measured(statistics.median(seconds), torch.cuda.max_memory_allocated(device) - before)


def _measure_cpu(fn: Callable[[], None]) -> Measured:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return Measured(seconds, peak)


def bench_one(q_heads: int, kv_heads: int, prompt_len: int, n: int, response_len: int, device: torch.device,
              dtype: torch.dtype, backend: str) -> tuple[Measured, Measured]:
    """(shared-prefix, naive) for one group of n responses of `response_len` tokens."""
    group = GroupLayout.packed(0, prompt_len, (response_len,) * n)
    shared = run_pass(SharedPrefixAttention([group], backend), group.end, q_heads, kv_heads, device, dtype)
    naive_attention = VarlenAttention.from_lengths([prompt_len + response_len] * n, device, backend=backend)
    naive = run_pass(naive_attention, n * (prompt_len + response_len), q_heads, kv_heads, device, dtype)
    return shared, naive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only 7B geometry, 2k prompt, 8 x 512 responses")
    add_device_options(parser)
    args = parser.parse_args()
    device, dtype, backend = device_options(args)
    geometries, prompts, responses = QUICK if args.quick else (tuple(GEOMETRIES), PROMPT_LENS, RESPONSES)
    print(f"one attention layer, forward + backward, head_dim {HEAD_DIM}, {dtype}, {device}, backend {backend}")
    print(f"{'model':>5} {'prompt':>6} {'responses':>9} | {'shared ms':>9} {'shared GB':>9} | "
          f"{'naive ms':>9} {'naive GB':>8} | {'time x':>6} {'mem x':>6}")
    for name in geometries:
        q_heads, kv_heads = GEOMETRIES[name]
        for prompt_len in prompts:
            for n, response_len in responses:
                shared, naive = bench_one(q_heads, kv_heads, prompt_len, n, response_len, device, dtype, backend)
                print(f"{name:>5} {prompt_len:>6} {f'{n}x{response_len}':>9} | {shared.seconds * 1e3:>9.1f} "
                      f"{shared.peak_bytes / 1e9:>9.2f} | {naive.seconds * 1e3:>9.1f} {naive.peak_bytes / 1e9:>8.2f} | "
                      f"{shared.seconds / naive.seconds:>6.2f} {shared.peak_bytes / naive.peak_bytes:>6.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
