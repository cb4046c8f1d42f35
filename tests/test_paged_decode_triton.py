"""The Triton paged decode kernels (plain and group-shared) against the torch reference paths.

The kernel cases live in tests/paged_decode_triton_cases.py and
tests/cascade_decode_triton_cases.py and run in a fresh process: in Triton's CPU interpreter (TRITON_INTERPRET=1, which must be set
before triton is first imported) without a GPU, compiled on a CUDA machine.
triton comes with the dev extra.
"""

import os
import re
import subprocess
import sys

import torch

from rollplex.ops import paged_decode_triton as pdt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
         for name in ("paged_decode_triton_cases.py", "cascade_decode_triton_cases.py")]


def test_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import rollplex.ops.paged_decode_triton as m\n"
            "import rollplex.ops.cascade_decode_triton\n"
            "assert not m.triton_available()\n"
            "print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def test_kernel_cases():
    import triton  # noqa: F401  (a dev dependency: its absence is a failure, not a skip)

    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CASES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) >= 25 and "failed" not in res.stdout, tail


def test_default_num_splits_shape_only():
    # Many sequences: the (sequence, kv head) programs fill the GPU, no split.
    assert pdt.default_num_splits(64, 4, 8192, 64, 132) == 1
    # Short context: not worth splitting.
    assert pdt.default_num_splits(1, 2, 128, 64, 132) == 1
    # One long sequence: split, bounded.
    n = pdt.default_num_splits(1, 2, 32768, 64, 132)
    assert 1 < n <= 64
