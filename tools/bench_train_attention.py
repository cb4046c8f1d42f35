"""Training-pass attention of one GRPO group, shared prefix against naive, side by side.

    python tools/bench_train_attention.py --quick   # 7B geometry, 2k prompt, 8 x 512 (CPU: ~1 min)
    python tools/bench_train_attention.py           # every geometry x prompt x responses below
    python tools/bench_train_attention.py --compare # torch vs flex vs varlen, 4 groups x 8, bf16 (CUDA)
    python tools/bench_train_attention.py --compare --small   # the same at a CPU-sized shape

`--compare` (and `compare_backends`, which tools/gpu_check.py can call for a dict of ms
and peak MB per backend) times one shared-prefix layer per training backend that runs
on the device, on the same q/k/v; see compare_backends for what each number is. Its
figures (and packed_train_3b's) are what "auto" on CUDA without flash-attn should follow;
until a GPU has run them, "auto" stays "torch".

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

from rollplex.ops.attention import (AttentionBackend, GroupLayout, PrefixedSegments, SharedPrefixAttention,
                                    VarlenAttention, resolve_backend, shared_prefix_segments)

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


def training_groups(num_groups: int, n: int, prompt_len: int, max_response: int) -> list[GroupLayout]:
    """GRPO groups packed back to back, responses of lengths spread over [max_response / 4,
    max_response] (seeded), as RL's vary: nearly every response a length of its own."""
    g = torch.Generator().manual_seed(0)
    groups, start = [], 0
    for _ in range(num_groups):
        lens = torch.randint(max(1, max_response // 4), max_response + 1, (n,), generator=g).tolist()
        groups.append(GroupLayout.packed(start, prompt_len, tuple(lens)))
        start = groups[-1].end
    return groups


def available_backends(device: torch.device) -> dict[str, str | None]:
    """Each training backend that can run a training pass on `device`, and why each other cannot."""
    found: dict[str, str | None] = {}
    for name in ("torch", "flex", "varlen", "flash"):
        try:
            resolve_backend(name, device)
            found[name] = "no FlexAttention backward on CPU" if name == "flex" and device.type == "cpu" else None
        except RuntimeError as e:
            found[name] = str(e)
    return found


def compare_backends(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, num_groups: int = 4,
                     n: int = 8, prompt_len: int = 512, max_response: int = 1024, q_heads: int = 16,
                     kv_heads: int = 2, head_dim: int = HEAD_DIM) -> dict:
    """One shared-prefix attention layer per backend, side by side, on the same q/k/v: the
    one-time build of its index tensors / block masks (`build_ms`, per micro-batch), the
    no-grad forward (`forward_ms`, `forward_peak_mb`: the logprob passes) and forward +
    backward (`train_ms`, `train_peak_mb`), peaks above the live q/k/v. `max_err_vs_torch`:
    max |backend - torch| / max |torch| of the output and of dq, dk, dv (bf16 rounding is
    ~1e-2; a wrong mask is O(1)). `host_sync_free` (CUDA): a training pass after the warm-up
    ran under torch.cuda.set_sync_debug_mode("error"). Backends that cannot run are in
    `skipped`, with why; flex on CPU runs the forward only."""
    device = torch.device(device)
    groups = training_groups(num_groups, n, prompt_len, max_response)
    g = torch.Generator().manual_seed(1)
    tokens = groups[-1].end
    q, k, v = (torch.randn(tokens, h, head_dim, generator=g).to(device, dtype).requires_grad_()
               for h in (q_heads, kv_heads, kv_heads))
    grad_out = torch.randn(tokens, q_heads, head_dim, generator=g).to(device, dtype)
    result: dict = {"tokens": tokens, "segments": num_groups * (n + 1), "heads": [q_heads, kv_heads],
                    "head_dim": head_dim, "dtype": str(dtype), "device": str(device), "backends": {}, "skipped": {}}
    reference = None
    for name, unavailable in available_backends(device).items():
        if unavailable is not None and not (name == "flex" and device.type == "cpu"):
            result["skipped"][name] = unavailable
            continue
        row, outputs = _bench_backend(name, groups, q, k, v, grad_out, train=unavailable is None)
        reference = reference or outputs
        row["max_err_vs_torch"] = {key: float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                   for key, a, b in zip(("out", "dq", "dk", "dv"), outputs, reference)}
        result["backends"][name] = row
        if unavailable is not None:
            result["skipped"][f"{name} backward"] = unavailable
    return result


def _bench_backend(name: str, groups: list[GroupLayout], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   grad_out: torch.Tensor, train: bool) -> tuple[dict, list[torch.Tensor]]:
    """(timings, [output, dq, dk, dv] where trained) of one backend's layer."""
    device = q.device
    segments, row = _build(name, groups, device)
    attention = SharedPrefixAttention(groups, name)
    attention.segments = segments  # as its first layer's call would build them

    def forward() -> None:
        with torch.no_grad():
            attention(0, q, k, v)

    def train_pass() -> None:
        torch.autograd.grad(attention(0, q, k, v), (q, k, v), grad_out)

    fwd = measure(forward, device)
    row.update(forward_ms=fwd.seconds * 1e3, forward_peak_mb=fwd.peak_bytes / 2**20)
    with torch.no_grad():
        outputs = [attention(0, q, k, v)]
    if train:
        trained = measure(train_pass, device)
        row.update(train_ms=trained.seconds * 1e3, train_peak_mb=trained.peak_bytes / 2**20)
        out = attention(0, q, k, v)
        outputs = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]
        if device.type == "cuda":
            row["host_sync_free"] = _sync_free(train_pass)
            row["new_layout_first_train_ms"] = _new_layout_first_pass_ms(name, groups, q, k, v)
    return row, outputs


def _build(name: str, groups: list[GroupLayout], device: torch.device) -> tuple[PrefixedSegments, dict]:
    """The segments' one-time build, with its time and (CUDA) its peak above what was live:
    create_block_mask evaluates the mask over the whole (queries, keys) grid."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    segments = PrefixedSegments(shared_prefix_segments(groups), name, device)
    row: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        row["build_peak_mb"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
    row["build_ms"] = (time.perf_counter() - start) * 1e3
    return segments, row


def _new_layout_first_pass_ms(name: str, groups: list[GroupLayout], q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> float:
    """The first training pass of a micro-batch of another token count, build included: what
    each new micro-batch pays (FlexAttention: a recompile unless its shapes went dynamic)."""
    shorter = [GroupLayout.packed(g.prompt_start - 3 * i, g.prompt_len,
                                  (*g.response_lens[:-1], g.response_lens[-1] - 3)) for i, g in enumerate(groups)]
    rows = shorter[-1].end
    torch.cuda.synchronize(q.device)
    start = time.perf_counter()
    attention = SharedPrefixAttention(shorter, name)
    qs, ks, vs = (t[:rows] for t in (q, k, v))
    torch.autograd.grad(attention(0, qs, ks, vs), (qs, ks, vs), torch.ones_like(qs))
    torch.cuda.synchronize(q.device)
    return (time.perf_counter() - start) * 1e3


def _sync_free(fn: Callable[[], None]) -> bool:
    """Whether `fn` runs without a host-device sync (torch raises on one in "error" mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def print_comparison(result: dict) -> None:
    print(f"one shared-prefix attention layer: {result['segments']} segments, {result['tokens']} tokens, heads "
          f"{result['heads'][0]}/{result['heads'][1]}, head_dim {result['head_dim']}, {result['dtype']}, "
          f"{result['device']}")
    print(f"{'backend':>7} | {'build ms':>8} | {'fwd ms':>8} {'fwd MB':>8} | {'fwd+bwd ms':>10} {'MB':>8} | "
          f"{'err out':>8} {'err dq':>8}")
    for name, row in result["backends"].items():
        err = row["max_err_vs_torch"]
        train_ms, train_mb = (f"{row[key]:.1f}" if key in row else "-" for key in ("train_ms", "train_peak_mb"))
        print(f"{name:>7} | {row['build_ms']:>8.1f} | {row['forward_ms']:>8.1f} {row['forward_peak_mb']:>8.1f} | "
              f"{train_ms:>10} {train_mb:>8} | {err['out']:>8.1e} {err.get('dq', float('nan')):>8.1e}")
    for name, why in result["skipped"].items():
        print(f"  skipped {name}: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only 7B geometry, 2k prompt, 8 x 512 responses")
    parser.add_argument("--compare", action="store_true",
                        help="torch vs flex vs varlen (those that run here) at a training shape: 4 groups x 8 "
                             "responses of up to 1024 tokens, 512-token prompts, heads 16/2")
    parser.add_argument("--small", action="store_true", help="with --compare: a CPU-sized shape")
    add_device_options(parser)
    args = parser.parse_args()
    device, dtype, backend = device_options(args)
    if args.compare:
        shape = dict(num_groups=2, n=4, prompt_len=64, max_response=128, q_heads=4) if args.small else {}
        print_comparison(compare_backends(device, dtype, **shape))
        return
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
