"""Vision tower cost at Qwen2.5-VL-3B's tower geometry on one real-size video grid.

    python tools/bench_vision.py                      # grid (4, 36, 64): 9216 patches, 8 frames (CPU: ~1 min)
    python tools/bench_vision.py --grid 8 36 64       # 18432 patches

What is measured, on random weights and inputs of the 3B tower (depth 32, hidden
1280, 16 heads, window 112 px, fullatt blocks 7/15/23/31):

    plan         `VisionTransformer.plan` (window order, rotary tables, segment indices),
                 and its parts vision_layout and vision_positions + vision_rotary, on the host
    attention    forward + backward of the attention call alone (rotary-applied q/k/v
                 to its output), over the window segments and over the full segments
    block        forward + backward of one whole VisionBlock (norms, q/k/v, rotary,
                 attention, MLP), window and full

Full attention is one segment per video frame (t x h x w patches -> t segments of
h x w), as the model defines it, so it is quadratic in a frame's patches by design;
window attention is linear in the patches. Peak memory is the peak of live tensor
bytes above what was live before the pass, measured as tools/bench_train_attention.py
does (torch.profiler's allocation events on CPU).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from bench_train_attention import Measured, _measure_cpu, _measure_cuda
from rollplex.models.qwen2_5_vl import VisionArgs, VisionBlock, VisionTransformer, vision_layout
from rollplex.models.rope import vision_positions, vision_rotary
from rollplex.ops.attention import PackedSegments, resolve_backend


def measure(fn: Callable[[], None], device: torch.device) -> Measured:
    return _measure_cuda(fn, device) if device.type == "cuda" else _measure_cpu(fn)


def host_seconds(fn: Callable[[], object], repeats: int = 3) -> float:
    """Best of `repeats` wall times of `fn` (host work: no device sync needed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def attention_pass(attention: PackedSegments, patches: int, args: VisionArgs, device: torch.device,
                   dtype: torch.dtype) -> Measured:
    head_dim = args.hidden_size // args.num_heads

    def forward_backward() -> None:
        q, k, v = (torch.randn(patches, args.num_heads, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        attention(q, k, v).float().square().sum().backward()

    return measure(forward_backward, device)


def block_pass(block: VisionBlock, attention: PackedSegments, cos: torch.Tensor, sin: torch.Tensor,
               args: VisionArgs, device: torch.device, dtype: torch.dtype) -> Measured:
    def forward_backward() -> None:
        x = torch.randn(cos.shape[0], args.hidden_size, device=device, dtype=dtype, requires_grad=True)
        block(x, cos, sin, attention).float().square().sum().backward()

    return measure(forward_backward, device)


def segment_counts(attention: PackedSegments) -> str:
    """'<segments> segments in <kernel calls> calls' (one SDPA call per distinct segment length on torch)."""
    if attention.backend == "flash":
        return f"{attention.cu_seqlens.numel() - 1} segments in 1 call"
    return f"{sum(idx.shape[0] for _, _, idx, _ in attention.groups)} segments in {len(attention.groups)} calls"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", type=int, nargs=3, default=(4, 36, 64), metavar=("T", "H", "W"),
                        help="video grid_thw in patches (default: 8 frames of 504 x 896 px)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--backend", default="auto", help="attention backend: auto, torch or flash")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    vision = VisionArgs(depth=1)  # the 3B tower's geometry; one block is what is timed
    tower = VisionTransformer(vision)
    tower.attn_backend = resolve_backend(args.backend, device)
    grid = torch.tensor([args.grid], device=device)
    patches = int(grid.prod())
    block = VisionBlock(vision).to(device, dtype)

    print(f"3B vision tower, grid_thw {tuple(args.grid)} = {patches} patches, {dtype}, {device}, "
          f"backend {tower.attn_backend}")
    head_dim = vision.hidden_size // vision.num_heads

    def rotary() -> None:
        vision_rotary(vision_positions(grid, vision.spatial_merge_size), head_dim)

    print(f"plan  {host_seconds(lambda: tower.plan(grid)) * 1e3:8.1f} ms  (vision_layout "
          f"{host_seconds(lambda: vision_layout(grid, vision)) * 1e3:.1f} ms, vision_positions + vision_rotary "
          f"{host_seconds(rotary) * 1e3:.1f} ms)")
    plan = tower.plan(grid)
    print(f"{'pass':>16} | {'time s':>7} {'peak GB':>8} | segments")
    for kind, attention in (("window", plan.window_attention), ("full", plan.full_attention)):
        attn = attention_pass(attention, patches, vision, device, dtype)
        whole = block_pass(block, attention, plan.cos, plan.sin, vision, device, dtype)
        for what, m in ((f"{kind} attention", attn), (f"{kind} block", whole)):
            print(f"{what:>16} | {m.seconds:>7.2f} {m.peak_bytes / 1e9:>8.2f} | {segment_counts(attention)}",
                  flush=True)


if __name__ == "__main__":
    main()
