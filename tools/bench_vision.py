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

from bench_train_attention import Measured, add_device_options, device_options, measure
from rollplex.models.qwen2_5_vl import VisionArgs
from rollplex.models.qwen2_5_vl.model import VisionBlock, VisionTransformer, vision_layout
from rollplex.models.rope import vision_positions, vision_rotary
from rollplex.ops.attention import PackedSegments


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
    add_device_options(parser)
    args = parser.parse_args()
    device, dtype, backend = device_options(args)
    vision = VisionArgs(depth=1)  # the 3B tower's geometry; one block is what is timed
    tower = VisionTransformer(vision)
    tower.attn_backend = backend
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
    print(f"{'pass':>16} | {'time ms':>9} {'peak GB':>8} | segments")
    for kind, attention in (("window", plan.window_attention), ("full", plan.full_attention)):
        attn = attention_pass(attention, patches, vision, device, dtype)
        whole = block_pass(block, attention, plan.cos, plan.sin, vision, device, dtype)
        for what, m in ((f"{kind} attention", attn), (f"{kind} block", whole)):
            print(f"{what:>16} | {m.seconds * 1e3:>9.1f} {m.peak_bytes / 1e9:>8.2f} | {segment_counts(attention)}",
                  flush=True)


if __name__ == "__main__":
    main()
