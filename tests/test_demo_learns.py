"""The tiny demo's learning bar (issue 25): a bare `python train.py` reaches a 10-step mean score of at least
0.95 and a val/score of at least 0.95 within its 500 steps, on seeds 0, 1 and 2, and so does the tiny
Qwen3-VL (`--model.tiny.family qwen3_vl`, issue 26) and the tiny Qwen3.5 (`qwen3_5`, issue 39); the look demo
(`--data.task look`, issue 41) learns to call its tool. About 4 minutes a run on 2 cores, so outside the default
suite:

    python -m pytest -q -m slow tests/test_demo_learns.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollplex.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_the_tiny_demo_learns(tmp_path, family, seed):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--trainer.output_dir", str(out), "--trainer.seed", str(seed),
                    "--model.tiny.family", family, "--logging.console", "false"], cwd=REPO, check=True,
                   timeout=1800)
    records = read_metrics(out / "metrics.jsonl")
    scores = [r["critic/score/mean"] for r in records]
    assert len(scores) == 500
    best_mean = max(sum(scores[i - 10:i]) / 10 for i in range(10, len(scores) + 1))
    best_val = max(r["val/score"] for r in records if "val/score" in r)
    assert best_mean >= 0.95 and best_val >= 0.95, (best_mean, best_val)


@pytest.mark.slow
def test_the_tiny_demo_learns_with_lora(tmp_path):
    """`python train.py --lora.rank 8` (issue 29): rank-8 adapters on the frozen random base, the preset's
    lora.alpha 128 with adapters in the vision tower too, pass 0.9 and a val/score of 0.95 in 500 steps
    (docs/RESULTS.md: 0.948 and 1.0 on seed 0)."""
    out = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--trainer.output_dir", str(out), "--lora.rank", "8",
                    "--logging.console", "false"], cwd=REPO, check=True, timeout=1800)
    records = read_metrics(out / "metrics.jsonl")
    scores = [r["critic/score/mean"] for r in records]
    best_mean = max(sum(scores[i - 10:i]) / 10 for i in range(10, len(scores) + 1))
    best_val = max(r["val/score"] for r in records if "val/score" in r)
    assert best_mean >= 0.9 and best_val >= 0.95, (best_mean, best_val)


@pytest.mark.slow
def test_the_look_demo_learns_to_look(tmp_path):
    """`python train.py --data.task look` (issue 41): the question without its picture, a `look` tool that returns
    it; from scratch the tiny model learns to call it first and name the colour after, a 10-step mean score of at
    least 0.9 within the 500 steps (a policy that never looks scores at most 1/7), nearly every sample looking."""
    out = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--data.task", "look", "--trainer.output_dir", str(out),
                    "--logging.console", "false"], cwd=REPO, check=True, timeout=3600)
    records = read_metrics(out / "metrics.jsonl")
    scores = [r["critic/score/mean"] for r in records]
    windows = [sum(scores[i - 10:i]) / 10 for i in range(10, len(scores) + 1)]
    best = max(range(len(windows)), key=windows.__getitem__)
    assert windows[best] >= 0.9, windows[best]
    assert min(r["rollout/turns_mean"] for r in records[best:best + 10]) > 1.9  # it looked before answering
