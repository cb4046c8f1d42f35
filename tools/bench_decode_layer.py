"""Launches, time and agreement of a decoder layer's decode step, fused (rollplex.ops.fused_decode_triton) and torch.

    python tools/bench_decode_layer.py [--batch 64] [--layers 4] [--context 512]

`bench_decode_layer()` returns a dict (tools/gpu_check.py can report it): for each path
the launches of one decoder layer's decode step, and the time of a decode step of
`layers` such layers (a CUDA graph replayed on CUDA, eager on CPU, where the fused
kernels run in Triton's interpreter: that time says nothing of a GPU's); and how far
apart the two paths' outputs and written K/V are, beside how far the torch ops in that
dtype are from the torch ops in float32 on the same inputs (`agreement`). In bf16 with
Qwen2.5-VL 3B's layer shapes on CUDA (q/k/v with biases, no qk_norm); fp16, tiny, on CPU.

The layers are initialised as build_model(init_std=None) initialises a model, so every
layer moves its output by about its input's size, and the step's hidden states are ones
those layers made (`DecodeSetup`): with weights far smaller than the hidden states, a
wrong rotary or attention would change the output below bf16 rounding.

How launches are counted:
- on CUDA, torch.profiler's CUDA kernel events of one eager layer call (cuBLAS,
  Triton and aten kernels alike; memcpy/memset events apart);
- on CPU (the fused path in Triton's interpreter, TRITON_INTERPRET=1), a dispatch
  mode counts the aten ops outside Triton kernels that would launch a kernel (views
  and empty allocations launch none, and are listed apart), and each Triton kernel
  launch counts one. That is the count of the code a CUDA graph captures, op for op,
  not of the kernels cuBLAS or a fallback may add on a GPU.
Either count goes through `layer_launches`, which sorts the kernels by name into the
project's own, GEMMs, cuBLAS's split-K reductions and the rest, and holds what the
design controls (all but the split-K reductions) to FUSED_LAYER_LAUNCHES.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
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
from rollplex.ops.attention import VarlenAttention
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
        return {"aten_kernels": dict(self.kernels), "triton_kernels": dict(self.triton),
                "no_kernel_ops": sum(self.free.values())}


def layer_args(device: torch.device) -> TextArgs:
    """Qwen2.5-VL 3B's decoder shapes on CUDA; the same structure, tiny, on CPU."""
    if device.type == "cuda":
        return TextArgs()
    return TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3])


# The launches one fused decoder layer's decode step is designed to make: 7 GEMMs (q, k and v with their biases,
# o, gate, up, and down accumulating into the residual) and the project's 5 kernels (the two norms, the first with
# the residual add, rotary + KV write, paged attention, SiLU-and-mul). Where the paged attention splits the
# context (few rows: batch x KV heads below the SM count, as at batch 64 on an H200), its merge kernel is one more.
FUSED_LAYER_LAUNCHES = 12
SPLIT_MERGE_KERNEL = "_merge_splits_kernel"
OWN_KERNELS = ("rms_norm_kernel", "silu_mul_kernel", "rotary_store_kernel", "_paged_decode_kernel",
               SPLIT_MERGE_KERNEL)  # the Triton kernels' names, as the profiler and the interpreter give them
# Kernels are classified by their (demangled) name, lower-cased. cuBLAS may split a GEMM's K dimension and sum
# the parts in a kernel of its own, which the design does not control: cuBLAS's `splitKreduce_kernel`
# (`cublasLt::splitKreduce_kernel` from cuBLASLt), CUTLASS's `cutlass::reduction::kernel::ReduceSplitK`, and any
# other kernel naming cuBLAS or CUTLASS with "reduce" in its name (cuBLAS's `reduce_1Block_kernel`, the second
# pass of its split GEMVs). torch's own reductions (`at::native::reduce_kernel`) name neither, so they count.
SPLIT_K_REDUCTION_NAMES = ("splitkreduce", "splitk_reduce", "split_k_reduce", "reducesplitk")
GEMM_LIBRARIES = ("cublas", "cutlass")
# GEMM kernels: cuBLAS's and CUTLASS's (`ampere_bf16_s16816gemm_...`, `sm90_xmma_gemm_...`, `cutlass::Kernel2<
# cutlass_80_tensorop_..gemm..>`, `gemv2T_kernel_val<...>`, Hopper's cuBLASLt `nvjet_...`); on CPU, aten's ops.
GEMM_NAMES = ("gemm", "gemv", "nvjet", "xmma", *GEMM_LIBRARIES)
GEMM_ATEN_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")


def kernel_class(name: str) -> str:
    """"split_k_reduction", "own", "gemm" or "other": which of the layer's launches a kernel name is."""
    lowered = name.lower()
    if any(part in lowered for part in SPLIT_K_REDUCTION_NAMES) or (
            "reduce" in lowered and any(library in lowered for library in GEMM_LIBRARIES)):
        return "split_k_reduction"
    base = name.removeprefix("void ").split("<")[0].split("(")[0].strip()
    if base.startswith(OWN_KERNELS):
        return "own"
    if base in GEMM_ATEN_OPS or any(part in lowered for part in GEMM_NAMES):
        return "gemm"
    return "other"


def layer_launches(kernels: dict[str, int]) -> dict[str, Any]:
    """One fused layer's kernels ({name: launches}) by class (`kernel_class`), and whether what the design
    controls stays within it: every launch but cuBLAS's split-K reductions (reported apart) at most
    FUSED_LAYER_LAUNCHES, one more where the paged attention merged split partitions."""
    classes: dict[str, dict[str, int]] = {"own": {}, "gemm": {}, "split_k_reduction": {}, "other": {}}
    for name, count in kernels.items():
        classes[kernel_class(name)][name] = count
    launches = sum(count for cls, named in classes.items() if cls != "split_k_reduction" for count in named.values())
    limit = FUSED_LAYER_LAUNCHES + min(1, kernels.get(SPLIT_MERGE_KERNEL, 0))
    return {"launches": launches, "launch_limit": limit, "within_design": launches <= limit,
            "split_k_reductions": sum(classes["split_k_reduction"].values()), "kernel_classes": classes}


class DecodeSetup:
    """`layers` decoder layers (Qwen2's biased q/k/v; with `qk_norm`, Qwen3's q/k norms too)
    and one decode step's inputs at `batch` rows over `context` tokens each.

    The weights as build_model(init_std=None) draws a model's (rollplex.models.loader):
    N(0, 1/fan_in) weights and N(0, 0.02) biases, so each layer moves the hidden state by
    about its own size, as a trained model's layers do; norm scales 1 (the model's init)
    moved by N(0, 0.1), so that a kernel ignoring its scale shows. The hidden states are
    what these layers make of embeddings (N(0, 1/hidden): the embedding table's init) of
    one causal sequence of `batch` tokens (torch ops), the scale the residual stream has a
    few layers into the model (RMS ~1.5 after 4 layers). The KV context is N(0, 1), the
    scale of the keys and values those layers write."""

    def __init__(self, args: TextArgs, layers: int, batch: int, context: int, device: torch.device,
                 dtype: torch.dtype, block_size: int = 16, seed: int = 0, qk_norm: bool = False):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers = torch.nn.ModuleList(DecoderLayer(args, i, qkv_bias=True, qk_norm=qk_norm)
                                          for i in range(layers)).to(device, dtype).eval()
        _init_as_build_model(self.layers, gen)
        blocks_per_seq = -(-context // block_size)
        self.cache = KVCache(layers, batch * blocks_per_seq, block_size, args.num_key_value_heads, args.head_dim,
                             dtype, device)
        self.cache.data.normal_(generator=gen)
        self.tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1)
        self.lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.slots = (self.tables[:, -1].long() * block_size + (context - 1) % block_size)
        rotary = MRotaryEmbedding(args.head_dim, args.rope_theta, args.mrope_section)
        table = rotary.text_table(max(context, batch), device, dtype)
        self.cos, self.sin = table[self.lens.long() - 1].chunk(2, dim=-1)
        embeddings = torch.randn(batch, args.hidden_size, generator=gen, device=device) * args.hidden_size ** -0.5
        self.h = self._hidden_states(embeddings.to(dtype), *table[:batch].chunk(2, dim=-1))

    @torch.no_grad()
    def _hidden_states(self, embeddings: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layers' output for `embeddings` as one causal sequence (training attention, torch ops)."""
        attn = VarlenAttention.from_lengths([embeddings.shape[0]], embeddings.device, backend="torch")
        h = embeddings
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        return h

    def cast(self, dtype: torch.dtype) -> DecodeSetup:
        """This setup with its weights, KV context, hidden states and rotary cast to `dtype`: the same inputs."""
        other = copy.copy(self)
        other.layers = copy.deepcopy(self.layers).to(dtype)
        c = self.cache
        other.cache = KVCache(c.num_layers, c.num_blocks, c.block_size, c.kv_heads, c.head_dim, dtype, c.device)
        other.cache.data.copy_(c.data)
        other.h, other.cos, other.sin = (t.to(dtype) for t in (self.h, self.cos, self.sin))
        return other

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

    def written_kv(self) -> torch.Tensor:
        """The K and V the last step wrote, (layers, 2, batch, kv_heads, head_dim): every row's new token's slot."""
        data = self.cache.data
        return data.view(*data.shape[:2], -1, *data.shape[-2:])[:, :, self.slots].clone()


@torch.no_grad()
def _init_as_build_model(layers: torch.nn.Module, gen: torch.Generator) -> None:
    """build_model(init_std=None)'s draws (see DecodeSetup), the norm scales moved off 1."""
    for name, p in layers.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
        elif name.endswith("bias"):
            p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=p.device))
        else:
            p.copy_(p.shape[1] ** -0.5 * torch.randn(p.shape, generator=gen, device=p.device))


def differences(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """How far apart two results are: the largest absolute difference, and its root mean square."""
    d = (a.float() - b.float()).flatten()
    return {"max": d.abs().max().item(), "rms": d.pow(2).mean().sqrt().item()}


def agreement(setup: DecodeSetup) -> dict[str, dict[str, Any]]:
    """The decode step's output and the K/V it wrote, fused and torch in the setup's dtype, against each
    other and against the torch ops in float32 on the same inputs (`DecodeSetup.cast`): {quantity:
    {"fused_vs_torch", "torch_vs_fp32", "fused_vs_fp32": `differences`, "fp32_max_abs": the float32
    result's largest value}}. torch's own error against float32 is what rounding in the dtype costs;
    the fused path rounds no more often, so it should differ from torch by about that much."""
    reference = setup.cast(torch.float32)
    results = {"fp32": (reference.step(False), reference.written_kv())}
    for name, fused in (("fused", True), ("torch", False)):
        results[name] = (setup.step(fused), setup.written_kv())
    return {quantity: {**{f"{a}_vs_{b}": differences(results[a][i], results[b][i])
                          for a, b in (("fused", "torch"), ("torch", "fp32"), ("fused", "fp32"))},
                       "fp32_max_abs": results["fp32"][i].abs().max().item()}
            for i, quantity in enumerate(("output", "written_kv"))}


def count_launches(setup: DecodeSetup, fused: bool) -> dict[str, Any]:
    """One decoder layer's launches (see the module docstring for what is counted where), by `layer_launches`."""
    setup.step(fused, 1)  # warm-up: kernels compiled, lazy state made
    if setup.h.is_cuda:
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            setup.step(fused, 1)
            torch.cuda.synchronize()
        kernels = Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.lower().startswith(("memcpy", "memset")))
        return {**layer_launches(kernels), "kernels": dict(kernels), "counted_by": "torch.profiler"}
    counter = OpCounter()
    with counter, counter.counting_triton() if fused else contextlib.nullcontext():
        setup.step(fused, 1)
    summary = counter.summary()
    return {**summary, **layer_launches(summary["aten_kernels"] | summary["triton_kernels"]),
            "counted_by": "dispatch mode + Triton interpreter launches"}


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
    out["agreement"] = agreement(setup)
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
