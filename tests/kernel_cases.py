"""Running Triton kernel cases and import checks in a fresh Python process.

The kernel case files (tests/*_triton_cases.py) run in Triton's CPU interpreter
without a GPU and compiled on a CUDA machine. TRITON_INTERPRET=1 only works when
set before triton is first imported, so each file runs in a process of its own.
"""

import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fresh_env(**extra: str) -> dict[str, str]:
    """This process's environment with `extra`, and the repo first on PYTHONPATH."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


def assert_imports_without_triton(modules: list[str], check: str = "") -> None:
    """`modules` import with triton made unimportable (then `check`, a Python statement, holds)."""
    code = "import sys; sys.modules['triton'] = None\n" + "".join(f"import {m}\n" for m in modules)
    code += f"{check}\nprint('ok')"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=fresh_env(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


def assert_cases_pass(files: list[str], timeout: float) -> None:
    """Every case in `files` passes: in the interpreter on CPU (where the GPU-only cases skip,
    saying why), compiled on CUDA (where none may skip). triton is a dev dependency, so its
    absence fails here rather than skips."""
    env = fresh_env() if torch.cuda.is_available() else fresh_env(TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          *(os.path.join(ROOT, "tests", f) for f in files)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    tail = res.stdout[-4000:] + res.stderr[-2000:]
    summary = (res.stdout.strip().splitlines() or [""])[-1]  # e.g. "29 passed, 4 warnings in 85.38s"
    refused = r"failed|error|skipped" if torch.cuda.is_available() else r"failed|error"
    assert res.returncode == 0 and "passed" in summary and not re.search(refused, summary), tail
