"""Every hand-written Triton kernel compiles for sm_90 (H100/H200) here, without a GPU.

tools/compile_kernels.py drives the ops' own wrappers at the engine's and the sampler's
shapes, and each kernel they launch compiles offline with the ptxas Triton bundles,
which reports registers and spills. The default suite compiles a quick subset (one
layer shape, 16-bit, the sampler at temperature 1); the full sweep is a slow test.
Both run in a fresh process: the suite may have set TRITON_INTERPRET, under which
kernels are interpreted, not compiled.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cases import ROOT, fresh_env

pytest.importorskip("triton")


def compiled_env() -> dict[str, str]:
    env = fresh_env()
    env.pop("TRITON_INTERPRET", None)
    return env


def compile_kernels(report: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    res = subprocess.run([sys.executable, "tools/compile_kernels.py", "--json", str(report), *args], cwd=ROOT,
                         env=compiled_env(), capture_output=True, text=True, timeout=timeout)
    return res, json.loads(report.read_text())


def test_the_quick_subset_compiles_for_sm90_without_a_spill(tmp_path):
    res, report = compile_kernels(tmp_path / "report.json", "--quick", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert report["target"] == "sm_90" and not report["failures"]
    kernels = {s["kernel"] for s in report["compiled"]}
    # The decode attention (plain, cascade, merge), the fused layer and the sampler's three kernels.
    assert {"_paged_decode_kernel", "_merge_splits_kernel", "rms_norm_kernel", "silu_mul_kernel",
            "rotary_store_kernel", "tile_stats_kernel", "rung_stats_kernel", "draw_kernel"} <= kernels
    assert any(s["constexprs"].get("GATHER_ROWS") for s in report["compiled"])  # the cascade's prefix kernel
    for spec in report["compiled"]:
        assert spec["must_not_spill"] and spec["spill_bytes"] == 0 and spec["registers"] <= 255, spec


def test_a_spill_in_a_decode_kernel_fails_the_run(tmp_path):
    """The check can fail: a tile too large for the registers (the cascade's 64-row tile with
    4 warps and 64 keys at head_dim 256) is reported as a spill and the run exits 1."""
    script = tmp_path / "spill.py"
    script.write_text(f"""
import sys
sys.path[:0] = [{ROOT!r} + "/tools", {ROOT!r}]
import torch
import compile_kernels as ck
from rollplex.ops import paged_decode_triton
paged_decode_triton._tile_and_warps = lambda rows, dim, fp32: (64, 4)
sweep = ck.run_sweep([ck.Case("too large", lambda: ck.cascade_case(ck.LayerShape("x", 4096, 16, 2, 256), 64,
                                                                   torch.bfloat16), True)])
print("DEFECTS", sweep.defects())
""")
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=compiled_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DEFECTS ['_paged_decode_kernel [too large] spills" in res.stdout, res.stdout


@pytest.mark.slow
def test_the_full_sweep_compiles_with_no_failure_and_no_spill_where_none_may(tmp_path):
    res, report = compile_kernels(tmp_path / "report.json", timeout=3600)
    assert res.returncode == 0, res.stdout[-3000:]
    assert not report["failures"]
    assert not [s for s in report["compiled"] if s["must_not_spill"] and (s["spill_bytes"] or s["stack_bytes"])]
