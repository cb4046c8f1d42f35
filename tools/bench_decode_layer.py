"""Launches and time of a decoder layer's decode step, fused (rollplex.ops.fused_decode_triton) and torch.

    python tools/bench_decode_layer.py [--batch 64] [--layers 4] [--context 512]

`bench_decode_layer()` returns a dict (tools/gpu_check.py can report it): for each path
the launches of one decoder layer's decode step, and the time of a decode step of
`layers` such layers (a CUDA graph replayed on CUDA, eager on CPU, where the fused
kernels run in Triton's interpreter: that time says nothing of a GPU's). In bf16 with
Qwen2.5-VL 3B's layer shapes on CUDA (q/k/v with biases, no qk_norm); fp16, tiny, on CPU.

How launches are counted:
- on CUDA, torch.profiler's CUDA kernel events of one eager layer call (cuBLAS,
  Triton and aten kernels alike; memcpy/memset events apart);
- on CPU (the fused path in Triton's interpreter, TRITON_INTERPRET=1), a dispatch
  mode counts the aten ops outside Triton kernels that would launch a kernel (views
  and empty allocations launch none, and are listed apart), and each Triton kernel
  launch counts one. That is the count of the code a CUDA graph captures, op for op,
  not of the kernels cuBLAS or a fallback may add on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollplex.engine.kv_cache import KVCache, PagedAttention
from rollplex.models.qwen2_5_vl.args import TextArgs
from rollplex.models.qwen_vl.layers import DecoderLayer
from rollplex.models.rope import MRotaryEmbedding
from rollplex.ops.fused_decode_triton import FUSED_OPS

_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "detach", "alias"}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (by name), apart from those inside a Triton kernel's
    interpreted launch (`suspended`), and the views and allocations that launch nothing."""

    def __init__(self):
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.free: Counter[str] = Counter()  # views, aliases and allocations: no kernel
        self.triton: Counter[str] = Counter()
        self.suspended = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.suspended:
            name = func.overloadpacket.__name__
            returns = func._schema.returns
            view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
            (self.free if view or name in _NO_KERNEL else self.kernels)[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting_triton(self) -> Iterator[None]:
        """Count each interpreted Triton launch as one, and nothing it runs inside."""
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.triton[fn.fn.__name__] += 1
            self.suspended += 1
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.suspended -= 1

        InterpretedFunction.run = counted
        try:
            yield
        finally:
            InterpretedFunction.run = run

    def summary(self) -> dict[str, Any]:
        return {"launches": sum(self.kernels.values()) + sum(self.triton.values()),
                "aten_kernels": dict(self.kernels), "triton_kernels": dict(self.triton),
                "no_kernel_ops": sum(self.free.values())}


def layer_args(device: torch.device) -> TextArgs:
    """Qwen2.5-VL 3B's decoder shapes on CUDA; the same structure, tiny, on CPU."""
    if device.type == "cuda":
        return TextArgs()
    return TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3])


class DecodeSetup:
    """`layers` decoder layers (Qwen2's biased q/k/v; with `qk_norm`, Qwen3's q/k norms too)
    and one decode step's inputs at `batch` rows over `context` tokens each."""

    def __init__(self, args: TextArgs, layers: int, batch: int, context: int, device: torch.device,
                 dtype: torch.dtype, block_size: int = 16, seed: int = 0, qk_norm: bool = False):
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList(DecoderLayer(args, i, qkv_bias=True, qk_norm=qk_norm)
                                          for i in range(layers)).to(device, dtype).eval()
        for p in self.layers.parameters():
            torch.nn.init.normal_(p, std=0.02)
        blocks_per_seq = -(-context // block_size)
        self.cache = KVCache(layers, batch * blocks_per_seq, block_size, args.num_key_value_heads, args.head_dim,
                             dtype, device)
        self.cache.data.normal_()
        self.tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.slots = (self.tables[:, -1].long() * block_size + (context - 1) % block_size)
        table = MRotaryEmbedding(args.head_dim, args.rope_theta, args.mrope_section).text_table(context, device,
                                                                                                dtype)
        self.cos, self.sin = table[self.lens.long() - 1].chunk(2, dim=-1)
        self.h = torch.randn(batch, args.hidden_size, device=device, dtype=dtype)

    def attention(self, fused: bool) -> PagedAttention:
        return PagedAttention(self.cache, self.slots, block_tables=self.tables, context_lens=self.lens,
                              layer_ops=FUSED_OPS if fused else None)

    @torch.no_grad()
    def step(self, fused: bool, layers: int | None = None) -> torch.Tensor:
        """The decode step of the first `layers` layers (all by default) on this step's inputs."""
        h, attn = self.h, self.attention(fused)
        for layer in self.layers[:layers]:
            h = layer(h, self.cos, self.sin, attn)
        return h


def count_launches(setup: DecodeSetup, fused: bool) -> dict[str, Any]:
    """One decoder layer's launches (see the module docstring for what is counted where)."""
    setup.step(fused, 1)  # warm-up: kernels compiled, lazy state made
    if setup.h.is_cuda:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            setup.step(fused, 1)
            torch.cuda.synchronize()
        kernels = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.lower().startswith(("memcpy", "memset")))
        return {"launches": sum(kernels.values()), "kernels": dict(kernels), "counted_by": "torch.profiler"}
    counter = OpCounter()
    with counter, counter.counting_triton() if fused else contextlib.nullcontext():
        setup.step(fused, 1)
    return {**counter.summary(), "counted_by": "dispatch mode + Triton interpreter launches"}


def time_step(setup: DecodeSetup, fused: bool, repeats: int) -> float:
    """Median ms of one decode step of the setup's layers: a CUDA graph's replay on CUDA, eager on CPU."""
    run: Callable[[], Any] = lambda: setup.step(fused)  # noqa: E731
    if setup.h.is_cuda:
        for _ in range(2):
            run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    times = []
    for _ in range(repeats + 1):
        if setup.h.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if setup.h.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times[1:])[repeats // 2]


def bench_decode_layer(batch: int = 64, layers: int = 4, context: int = 512, repeats: int = 20,
                       device: str | None = None) -> dict[str, Any]:
    """Launches per decoder layer and decode-step time of `layers` layers, fused and torch, as a dict."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("on CPU the fused kernels run in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before starting Python")
    # bf16 on CUDA; fp16 on CPU, where the interpreter's bf16 tl.dot (the paged attention's) is wrong
    # (tests/paged_decode_triton_cases.py): the same casts, so the same count.
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    setup = DecodeSetup(layer_args(dev), layers, batch, context, dev, dtype)
    out: dict[str, Any] = {"device": str(dev), "dtype": str(dtype), "batch": batch, "layers": layers,
                           "context": context}
    for name, fused in (("fused", True), ("torch", False)):
        out[name] = {**count_launches(setup, fused), "step_ms": time_step(setup, fused, repeats)}
    out["max_abs_diff"] = (setup.step(True) - setup.step(False)).abs().max().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    a = parser.parse_args()
    print(json.dumps(bench_decode_layer(a.batch, a.layers, a.context, a.repeats), indent=1))


if __name__ == "__main__":
    main()
