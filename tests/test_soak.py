"""Soak, outside the default suite (it takes minutes):

    python -m pytest -q -m slow tests/test_soak.py

The overlap schedule for 200 steps on 2 ranks, with a checkpoint every 20, over
a dataset with one corrupt image per 50 rows and a user reward that raises on
some responses. One run has rank 1 SIGKILLed as step 110 starts and torchrun
restarts the group. Both runs must finish, end on the same parameters, skip
and count the same rows and reward errors, and hold no more tensor memory at
the end than after warm-up.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rollplex.data.tasks import ColorTask
from rollplex.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY, KILL = 200, 20, "110:1"
ROWS, CORRUPT_EVERY = 200, 50
WARM_UP = 40  # steps before the held memory is expected to stay flat

REWARD = '''
def score(response: str, answer: str) -> float:
    if len(response) % 7 == 0:
        raise ValueError("injected reward fault")
    return float(answer in response)
'''


def write_dataset(folder: Path) -> Path:
    """ROWS colour-task rows as PNG files, every CORRUPT_EVERY-th image cut in half."""
    folder.mkdir()
    task, rng, rows = ColorTask(), np.random.default_rng(0), []
    for i in range(ROWS):
        image, answer = task.sample(rng)
        path = folder / f"{i}.png"
        Image.fromarray(image).save(path)
        if i % CORRUPT_EVERY == CORRUPT_EVERY - 1:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        rows.append({"problem": f"<image> {task.question}", "answer": answer, "images": [path.name]})
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def torchrun(out: Path, data: Path, reward: Path, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "train.py", "--schedule.kind", "overlap", "--data.train_files", str(data),
           "--data.reward", f"{reward}:score", "--data.batch_size", "4", "--rollout.n", "4",
           "--rollout.max_tokens", "4", "--trainer.total_steps", str(STEPS), "--trainer.save_every", str(SAVE_EVERY),
           "--trainer.keep_last", "2", "--trainer.eval_every", "0", "--trainer.output_dir", str(out),
           "--logging.no_console"]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)


def final_params(out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(out / "checkpoints" / f"step_{STEPS:08d}", out / "final.pt")
    return torch.load(out / "final.pt", weights_only=True)["model"]


def test_overlap_soak_with_faults_and_a_restart(tmp_path):
    data = write_dataset(tmp_path / "data")
    reward = tmp_path / "soak_reward.py"
    reward.write_text(REWARD)
    plain = torchrun(tmp_path / "plain", data, reward)
    assert plain.returncode == 0, plain.stderr[-3000:]
    killed = torchrun(tmp_path / "killed", data, reward, ROLLPLEX_KILL_AT_STEP=KILL)
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr and "at step 100" in killed.stdout

    records = {run: read_metrics(tmp_path / run) for run in ("plain", "killed")}
    for run, rs in records.items():
        assert [r["step"] for r in rs] == list(range(1, STEPS + 1)), run
        assert rs[-1]["data/skipped_total"] >= 1, run  # the corrupt rows were met, skipped and counted
        assert sum(r["reward/errors"] for r in rs) > 0, run
        held = [r["perf/live_memory_gb"] for r in rs if "perf/live_memory_gb" in r and r["step"] >= WARM_UP]
        assert len(held) >= 8 and max(held) <= held[0] * 1.001, (run, held)
        print(f"{run}: rows skipped {rs[-1]['data/skipped_total']:.0f}, "
              f"reward errors {sum(r['reward/errors'] for r in rs):.0f}, "
              f"held from step {WARM_UP}: {min(held) * 1024:.2f}-{max(held) * 1024:.2f} MiB")
    for key in ("data/skipped_total", "reward/errors", "critic/score/mean", "actor/pg_loss"):
        assert [r[key] for r in records["killed"]] == [r[key] for r in records["plain"]], key

    expected, resumed = final_params(tmp_path / "plain"), final_params(tmp_path / "killed")
    assert expected.keys() == resumed.keys()
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name
