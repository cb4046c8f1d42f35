"""Elastic restart: under `torchrun --max-restarts 1`, a rank that dies mid-run
(SIGKILL, injected by ROLLPLEX_KILL_AT_STEP) makes torchrun restart the group,
and the run resumes from its latest complete checkpoint by itself. Everything
after the resume point is bitwise what an uninterrupted run gives: every logged
metric but the timings, and the final parameters; metrics.jsonl holds each step once, as the checkpoints do (the
restart drops the steps the first attempt logged after its last checkpoint), and the restarted rank 0 takes the
run folder's lock over from the killed one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rollplex.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY, KILL = 4, 2, "4:1"  # rank 1 dies as step 4 starts, step 3 logged; the group resumes from step 2


def torchrun(out: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "train.py", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
           "--trainer.total_steps", str(STEPS), "--trainer.save_every", str(SAVE_EVERY), "--trainer.eval_every", "0",
           "--trainer.output_dir", str(out), "--logging.no_console"]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def final_params(out: Path, tmp: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(out / "checkpoints" / f"step_{STEPS:08d}", tmp / f"{out.name}.pt")
    return torch.load(tmp / f"{out.name}.pt", weights_only=True)["model"]


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records]


def test_a_killed_rank_restarts_the_group_and_the_run_resumes_exactly(tmp_path):
    plain = torchrun(tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = torchrun(tmp_path / "killed", ROLLPLEX_KILL_AT_STEP=KILL)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr  # the first attempt did lose a rank
    assert "at step 2" in killed.stdout  # and the second resumed from step 2's checkpoint

    assert untimed(read_metrics(tmp_path / "killed")) == untimed(read_metrics(tmp_path / "plain"))
    lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
    expected, resumed = final_params(tmp_path / "plain", tmp_path), final_params(tmp_path / "killed", tmp_path)
    assert expected.keys() == resumed.keys()
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name
