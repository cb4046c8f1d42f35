"""The Triton sampler (rollplex/ops/sample_triton.py) against the torch path, and how sample() picks it.

The kernel cases live in tests/sample_triton_cases.py and run in a fresh process: in
Triton's CPU interpreter (TRITON_INTERPRET=1, which must be set before triton is first
imported) without a GPU, compiled on a CUDA machine. triton comes with the dev extra.
"""

import os

import pytest
import torch

from kernel_cases import assert_cases_pass, assert_imports_without_triton
from rollplex.engine import sampler
from rollplex.engine.sampler import sample, uniforms


def test_modules_import_without_triton():
    assert_imports_without_triton(["rollplex.ops.sample_triton", "rollplex.engine.sampler"])


def test_kernel_cases():
    assert_cases_pass(["sample_triton_cases.py"], timeout=1200)


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
