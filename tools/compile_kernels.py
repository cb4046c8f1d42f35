"""Compile every Triton kernel of rollplex/ops for sm_90 (H100/H200) on a machine without a GPU.

    python tools/compile_kernels.py                    # the full sweep (minutes), one line per specialisation
    python tools/compile_kernels.py --quick            # the subset the default test suite compiles
    python tools/compile_kernels.py --cache-dir .triton-cache   # keep the cubins: the device command ships them

Triton builds PTX and a cubin for `GPUTarget("cuda", 90, 32)` without a driver, with
the ptxas it bundles, which reports each kernel's registers, spills and stack. Nothing
here picks a launch configuration of its own: every case calls the ops' own wrappers
(paged and cascade decode attention, the fused decode-layer ops, the sampler) with
CPU tensors of the shapes the engine and the sampler use, and each `kernel[grid](...)`
they make compiles instead of launching (`compiling_offline`): the same constexprs,
num_warps and argument specialisations (a value of 1, a multiple of 16) a GPU run
gets from the same shapes. Where two shapes give the same specialisation Triton
compiles it once, as on the GPU.

Each line: the kernel, its constexprs and num_warps, registers per thread (255 is
the most), spill stores in bytes, stack frame in bytes, shared memory, compile
seconds. The run fails (exit 1) on a compile error, or a spill in a kernel on a
16-bit decode path or in the sampler (`must_not_spill`); a kernel at 240 registers
or more is flagged `near limit`.

With --cache-dir the compiled kernels stay in that Triton cache directory. Built
with the GPU machine's triton (3.6: `.venv-device/bin/python`, tools/check_device_stack.sh),
the device command finds them there (tools/device_run.sh sets TRITON_CACHE_DIR to
it) and spends no time compiling them; gpu_check reports the hits and misses.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("tools/compile_kernels.py compiles for the GPU: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollplex.models.registry import PRESETS  # noqa: E402
from rollplex.ops import fused_decode_triton  # noqa: E402
from rollplex.ops.cascade_decode_triton import cascade_decode_attention_triton, prefix_group_width  # noqa: E402
from rollplex.ops.paged_decode_triton import paged_decode_attention_triton  # noqa: E402
from rollplex.ops.sample_triton import sample_triton  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
REGISTER_LIMIT = 255
NEAR_LIMIT = 240


class OfflineDriver:
    """What Triton's JIT asks of a driver before it compiles, for an sm_90 device that is
    not there: the target, device 0, the null stream. Launching is never reached."""

    def get_current_target(self) -> GPUTarget:
        return SM90

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@dataclass
class Specialisation:
    """One compiled kernel: what it was compiled for and what ptxas made of it."""

    case: str
    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    registers: int
    spill_bytes: int | None  # ptxas' spill stores; None when the kernel came from the cache (no log)
    stack_bytes: int
    shared_bytes: int
    seconds: float
    cache_hit: bool
    must_not_spill: bool = False

    @property
    def spills(self) -> bool:
        return (self.spill_bytes if self.spill_bytes is not None else self.stack_bytes) > 0

    def line(self) -> str:
        flags = [f for f, on in (("SPILLS", self.spills), ("near limit", self.registers >= NEAR_LIMIT),
                                 ("cached", self.cache_hit)) if on]
        consts = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        spill = "?" if self.spill_bytes is None else self.spill_bytes
        return (f"{self.kernel:<26} warps={self.num_warps} {consts} | regs {self.registers:3d} spill {spill} "
                f"stack {self.stack_bytes} smem {self.shared_bytes} | {self.seconds:5.1f} s  [{self.case}]"
                + (f"  <- {', '.join(flags)}" if flags else ""))


@dataclass
class Failure:
    case: str
    error: str


@dataclass
class Sweep:
    """What a run compiled, in order, and what failed."""

    compiled: list[Specialisation] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    case: str = ""
    must_not_spill: bool = False

    def defects(self) -> list[str]:
        return ([f"{f.case}: {f.error}" for f in self.failures]
                + [f"{s.kernel} [{s.case}] spills {s.spill_bytes or s.stack_bytes} bytes" for s in self.compiled
                   if s.must_not_spill and s.spills])


def _resource_usage(cubin_path: str) -> tuple[int, int]:
    """(registers, stack bytes) of the one function in a cubin, from the cuobjdump Triton bundles."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin_path], capture_output=True, text=True,
                         check=True).stdout
    registers, stack = re.search(r"REG:(\d+) STACK:(\d+)", out).groups()
    return int(registers), int(stack)


def _spill_bytes(ptxas_log: str) -> int | None:
    found = re.findall(r"(\d+) bytes spill stores", ptxas_log)
    return sum(map(int, found)) if found else None


@contextlib.contextmanager
def compiling_offline(sweep: Sweep, cache_dir: str | None = None) -> Iterator[None]:
    """Inside, every Triton kernel call compiles for sm_90 and returns without launching;
    each compiled (or cache-found) kernel is recorded in `sweep`."""
    knobs = triton.knobs
    saved = (knobs.cache.dir, knobs.nvidia.dump_ptxas_log, knobs.compilation.listener, JITFunction.run)
    saved_driver = triton_driver._active  # None until first asked for: asking would look for a GPU
    log = io.StringIO()

    def listener(*, src, metadata, metadata_group, times, cache_hit) -> None:
        cubin = next(path for name, path in metadata_group.items() if name.endswith(".cubin"))
        registers, stack = _resource_usage(cubin)
        text = log.getvalue()
        log.seek(0), log.truncate()
        constexprs = {k if isinstance(k, str) else src.fn.arg_names[k[0]]: v for k, v in src.constants.items()}
        sweep.compiled.append(Specialisation(
            sweep.case, metadata["name"], {k: v for k, v in constexprs.items() if k.isupper()},
            metadata["num_warps"], metadata["num_stages"], registers, None if cache_hit else _spill_bytes(text),
            stack, metadata["shared"], round(time.perf_counter() - started[0], 2), cache_hit, sweep.must_not_spill))

    started = [time.perf_counter()]

    def compile_only(self, *args, grid, warmup, **kwargs):
        started[0] = time.perf_counter()
        with contextlib.redirect_stdout(log):  # ptxas' log, printed by Triton when dump_ptxas_log is on
            return saved[3](self, *args, grid=grid, warmup=True, **kwargs)

    if cache_dir is not None:
        knobs.cache.dir = cache_dir
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.listener = listener
    JITFunction.run = compile_only
    triton_driver.set_active(OfflineDriver())
    try:
        yield
    finally:
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log, knobs.compilation.listener, JITFunction.run = saved
        triton_driver._active = saved_driver


# ---------------------------------------------------------------------- the shapes


@dataclass(frozen=True)
class LayerShape:
    """What a decoder layer's kernels specialise on, per tensor-parallel rank."""

    name: str
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def layer_shapes(tp_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[LayerShape]:
    """Every preset's layer at every engine tp that splits its KV heads evenly, one per distinct
    specialisation-relevant shape; and head_dim 256 (Qwen3.5's), which no preset has yet."""
    shapes: dict[tuple, LayerShape] = {}
    for name, args in PRESETS.items():
        t = args.text
        for tp in tp_sizes:
            if t.num_key_value_heads % tp == 0:
                shape = LayerShape(f"{name} tp{tp}", t.hidden_size, t.num_attention_heads // tp,
                                   t.num_key_value_heads // tp, t.head_dim)
                shapes.setdefault((shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim), shape)
    shapes[(4096, 16, 2, 256)] = LayerShape("head_dim 256", 4096, 16, 2, 256)
    return list(shapes.values())


BLOCK_SIZE = 16  # rollout.block_size's default
CONTEXT = 4096  # tokens a decode step's tables cover (max_model_len)
BATCHES = (1, 64, 256)  # a lone sequence, a mid batch (split-K at few KV heads), a full bucket
VOCABS = sorted({args.text.vocab_size for args in PRESETS.values()})


def _pool(shape: LayerShape, dtype: torch.dtype, blocks: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K/V view of a pool laid out as rollplex.engine.kv_cache's (layers, 2, blocks, ...)."""
    data = torch.zeros(2, 2, blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim, dtype=dtype)
    return data[1, 0], data[1, 1]


def paged_case(shape: LayerShape, batch: int, dtype: torch.dtype) -> None:
    """A decode step's attention, as the engine's graphs call it (full-width tables, int32)."""
    k, v = _pool(shape, dtype)
    q = torch.zeros(batch, shape.q_heads, shape.head_dim, dtype=dtype)
    tables = torch.zeros(batch, CONTEXT // BLOCK_SIZE, dtype=torch.int32)
    paged_decode_attention_triton(q, k, v, tables, torch.ones(batch, dtype=torch.int32))


def cascade_case(shape: LayerShape, batch: int, dtype: torch.dtype) -> None:
    """The group-shared decode as the engine's graphs call it: groups padded to half the batch,
    `prefix_group_width` rows each, prefix and tail tables over the full width (rollplex/engine/cascade.py)."""
    k, v = _pool(shape, dtype)
    q = torch.zeros(batch, shape.q_heads, shape.head_dim, dtype=dtype)
    groups, width, table = max(1, batch // 2), prefix_group_width(shape.group), CONTEXT // BLOCK_SIZE
    index = torch.int32
    cascade_decode_attention_triton(q, k, v, torch.zeros(groups, width, dtype=index),
                                    torch.zeros(groups, table, dtype=index), torch.zeros(groups, dtype=index),
                                    torch.zeros(batch, table, dtype=torch.int32),
                                    torch.ones(batch, dtype=torch.int32))


def fused_layer_case(shape: LayerShape, batch: int, dtype: torch.dtype, qk_norm: bool) -> None:
    """The fused decode layer's elementwise kernels (rollplex.ops.fused_decode_triton)."""
    ops = fused_decode_triton
    x = torch.zeros(batch, shape.hidden, dtype=dtype)
    weight = torch.ones(shape.hidden, dtype=dtype)
    ops.rms_norm(x, weight, 1e-6)
    ops.rms_norm(x, weight, 1e-6, residual=x)
    intermediate = 4 * shape.hidden
    ops.silu_mul(torch.zeros(batch, intermediate, dtype=dtype), torch.zeros(batch, intermediate, dtype=dtype))
    qkv = torch.zeros(batch, (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim, dtype=dtype)
    q, k, v = qkv.split([shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                         shape.kv_heads * shape.head_dim], dim=-1)
    q, k, v = (t.view(batch, -1, shape.head_dim) for t in (q, k, v))
    cos = torch.zeros(batch, shape.head_dim, dtype=dtype)
    norms = (torch.nn.RMSNorm(shape.head_dim, eps=1e-6, dtype=dtype),) * 2 if qk_norm else None
    k_cache, v_cache = _pool(shape, dtype)
    ops.rotary_store(q, k, v, cos, cos, torch.zeros(batch, dtype=torch.long), k_cache, v_cache, norms)


def sampler_case(batch: int, vocab: int, temperature: float, truncate: bool) -> None:
    """The engine's sample() call: one temperature, top-p and top-k for every row."""
    logits = torch.zeros(batch, vocab, dtype=torch.bfloat16)
    top_p, top_k = (0.9, 50) if truncate else (1.0, -1)
    sample_triton(logits, temperature, top_p, top_k, torch.zeros(batch, dtype=torch.float64), truncate=truncate)


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[], None]
    must_not_spill: bool  # a 16-bit decode or sampler kernel: a spill there is a defect
    quick: bool = False  # in the default test suite's subset


def cases() -> list[Case]:
    """Every case of the full sweep (the quick subset marked): decode attention (plain and
    cascade) and the fused layer at each layer shape, batch and dtype; the sampler at each
    vocabulary, with and without truncation, at temperature 1 and 0.7."""
    found: list[Case] = []
    for i, shape in enumerate(layer_shapes()):
        for dtype in (torch.bfloat16, torch.float32):
            bits16 = dtype != torch.float32
            for batch in BATCHES:
                tag = f"{shape.name} {str(dtype)[6:]} batch {batch}"
                quick = i == 0 and bits16 and batch != 64
                found += [Case(f"paged {tag}", lambda s=shape, b=batch, d=dtype: paged_case(s, b, d), bits16, quick),
                          Case(f"cascade {tag}", lambda s=shape, b=batch, d=dtype: cascade_case(s, b, d), bits16,
                               quick and batch > 1)]
            found.append(Case(f"fused layer {shape.name} {str(dtype)[6:]}",
                              lambda s=shape, d=dtype: (fused_layer_case(s, 64, d, False),
                                                        fused_layer_case(s, 64, d, True)), bits16, i == 0 and bits16))
    for vocab in VOCABS:
        for temperature in (1.0, 0.7):
            for truncate in (False, True):
                found.append(Case(f"sampler vocab {vocab} T {temperature} {'top-k/p' if truncate else 'full'}",
                                  lambda v=vocab, t=temperature, tr=truncate: sampler_case(64, v, t, tr), True,
                                  vocab == VOCABS[0] and temperature == 1.0))
    return found


def run_sweep(selected: list[Case], cache_dir: str | None = None, echo: Callable[[str], None] | None = None) -> Sweep:
    """Compile every selected case's kernels; a case that fails to compile is recorded, and the sweep goes on."""
    sweep = Sweep()
    with compiling_offline(sweep, cache_dir):
        for case in selected:
            sweep.case, sweep.must_not_spill = case.name, case.must_not_spill
            before = len(sweep.compiled)
            try:
                case.run()
            except Exception as e:  # a compile error of this case: the report names it, the sweep goes on
                sweep.failures.append(Failure(case.name, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
                if echo:
                    echo(f"FAILED {case.name}: {sweep.failures[-1].error}")
            if echo:
                for spec in sweep.compiled[before:]:
                    echo(spec.line())
    return sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the default suite's subset")
    parser.add_argument("--cache-dir", help="keep the compiled kernels in this Triton cache directory")
    parser.add_argument("--only", help="only cases whose name contains this text")
    parser.add_argument("--json", help="write every specialisation and failure to this file")
    args = parser.parse_args()
    selected = [c for c in cases() if (c.quick or not args.quick) and (args.only or "") in c.name]
    print(f"triton {triton.__version__}, torch {torch.__version__}, target sm_90, {len(selected)} cases", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        sweep = run_sweep(selected, args.cache_dir or scratch, echo=lambda line: print(line, flush=True))
    spilled = [s for s in sweep.compiled if s.spills]
    print(f"{len(sweep.compiled)} specialisations compiled ({sum(s.cache_hit for s in sweep.compiled)} from the "
          f"cache), {len(sweep.failures)} failures, {len(spilled)} spilling ({sum(s.must_not_spill for s in spilled)}"
          f" where none may), most registers {max((s.registers for s in sweep.compiled), default=0)}, "
          f"{time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "triton": triton.__version__, "target": "sm_90",
            "compiled": [asdict(s) for s in sweep.compiled], "failures": [asdict(f) for f in sweep.failures]},
            indent=1))
    for defect in sweep.defects():
        print("DEFECT", defect)
    sys.exit(1 if sweep.defects() else 0)


if __name__ == "__main__":
    main()
