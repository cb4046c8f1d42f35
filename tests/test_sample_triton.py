"""The Triton sampler (rollplex/ops/sample_triton.py) against the torch path, and how sample() picks it.

The kernel cases live in tests/sample_triton_cases.py and run in a fresh process: in
Triton's CPU interpreter (TRITON_INTERPRET=1, which must be set before triton is first
imported) without a GPU, compiled on a CUDA machine. triton comes with the dev extra.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from rollplex.engine import sampler
from rollplex.engine.sampler import sample, uniforms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_triton_cases.py")


def test_modules_import_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import rollplex.ops.sample_triton, rollplex.engine.sampler\n"
            "print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_kernel_cases():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", CASES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    summary = (res.stdout.strip().splitlines() or [""])[-1]  # e.g. "29 passed, 4 warnings in 85.38s"
    assert "passed" in summary and not re.search(r"failed|skipped|error", summary), tail


def test_the_torch_path_runs_on_cpu_whatever_is_asked_by_default(monkeypatch):
    logits = torch.randn(4, 50)
    u = uniforms(torch.arange(4), torch.arange(4))
    monkeypatch.delenv(sampler.SAMPLER_BACKEND_ENV, raising=False)
    assert sampler._resolve_backend(None, logits) == "torch"  # auto: Triton only on CUDA
    assert sampler._resolve_backend("torch", logits) == "torch"
    monkeypatch.setenv(sampler.SAMPLER_BACKEND_ENV, "torch")
    assert sampler._resolve_backend(None, logits) == "torch"
    assert torch.equal(sample(logits, 1.0, 1.0, -1, u, truncate=False)[0],
                       sample(logits, 1.0, 1.0, -1, u, truncate=False, backend="torch")[0])


def test_unknown_or_unavailable_backends_are_refused(monkeypatch):
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="unknown sampler backend 'fast'"):
        sampler._resolve_backend("fast", logits)
    monkeypatch.setenv(sampler.SAMPLER_BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="unknown sampler backend"):
        sampler._resolve_backend(None, logits)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="needs triton and a CUDA device"):
            sampler._resolve_backend("triton", logits)
