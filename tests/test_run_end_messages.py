"""How a stopped run ends (rollplex.run_errors): one line on stderr saying what happened, the last checkpoint and
how to resume; the traceback in <output_dir>/error.log; exit status 1, or 130 for Ctrl-C. A save on a full disk
removes its half-written folder, and a new run removes those a dead earlier run left."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest

import rollplex.cli
from rollplex.rl.step_metrics import RewardsFailed
from rollplex.run_errors import run_end_line
from rollplex.train.checkpoint import _rng_state

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--trainer.total_steps", "2", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
        "--data.val_size", "4", "--trainer.eval_every", "0", "--trainer.save_every", "1", "--logging.no_console"]
FAILING_REWARD = "def reward(response, answer):\n    raise RuntimeError('boom')\n"


def train(out: Path, *extra: str) -> subprocess.Popen:
    """`python train.py` on the tiny defaults, in a session of its own (so that Ctrl-C can be sent to it)."""
    return subprocess.Popen([sys.executable, "train.py", *FAST, "--trainer.output_dir", str(out), *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def train_in_process(out: Path, *extra: str) -> None:
    """train.py's entry point (rollplex.cli.train), in this process: for faults injected with mock."""
    rollplex.cli.train([*FAST, "--trainer.output_dir", str(out), *extra])


def test_a_user_error_ends_in_its_message_and_logs_the_traceback(tmp_path):
    (tmp_path / "reward.py").write_text(FAILING_REWARD)
    run = train(tmp_path / "run", "--data.reward", f"{tmp_path / 'reward.py'}:reward")
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in stderr and "[rank0]" not in stderr
    last = stderr.splitlines()[-1]
    assert last.startswith("rollplex: reward function ") and "failed on all 16 responses" in last
    assert last.endswith(f"No checkpoint was saved yet. The traceback is in {tmp_path / 'run' / 'error.log'}.")
    log = (tmp_path / "run" / "error.log").read_text()
    assert log.startswith("--- ") and " rank 0 pid " in log and "train.py" in log.splitlines()[0]
    assert "Traceback (most recent call last)" in log and "RewardsFailed: reward function" in log


def test_ctrl_c_ends_with_the_last_checkpoint_the_resume_hint_and_status_130(tmp_path):
    out = tmp_path / "run"
    run = train(out, "--trainer.total_steps", "50")
    deadline = time.time() + 120
    while not (out / "checkpoints" / "step_00000002" / "COMPLETE.json").exists():
        assert run.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGINT)  # as Ctrl-C does: to the whole process group, reward workers too
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 130
    [line] = stderr.splitlines()
    step = int(line.split("Last checkpoint: step ")[1].split()[0])
    assert line.startswith("rollplex: interrupted (Ctrl-C). ") and step >= 2
    assert f"({out / 'checkpoints' / f'step_{step:08d}'}); run the same command to resume." in line
    assert "KeyboardInterrupt" in (out / "error.log").read_text()


def test_a_save_on_a_full_disk_removes_its_folder_and_says_the_disk_is_full(tmp_path, capsys):
    saves = iter([_rng_state, OSError(errno.ENOSPC, "No space left on device")])  # step 1 saves, step 2 does not

    def rng_state():
        outcome = next(saves)
        if isinstance(outcome, OSError):
            raise outcome
        return outcome()

    out = tmp_path / "run"
    with mock.patch("rollplex.train.checkpoint._rng_state", rng_state), pytest.raises(SystemExit) as stopped:
        train_in_process(out)  # the step-2 save fails after its shards are written
    assert stopped.value.code == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]  # no .tmp-step_00000002
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"rollplex: the disk holding {out} is full (No space left on device): free space there.")
    assert "Last checkpoint: step 1 " in line and "run the same command to resume" in line
    assert "CheckpointSaveError" in (out / "error.log").read_text()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full, a file whose disk is full")
def test_a_metrics_file_on_a_full_disk_names_it(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to("/dev/full")  # every flush of it fails with ENOSPC
    with pytest.raises(SystemExit) as stopped:
        train_in_process(out, "--trainer.save_every", "0")
    assert stopped.value.code == 1
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"rollplex: the disk holding {out} is full (No space left on device): free space there.")
    log = (out / "error.log").read_text()
    assert f"OSError: [Errno 28] No space left on device: '{out / 'metrics.jsonl'}'" in log
    assert log.count("Traceback (most recent call last)") == 2  # the flush's error and ours, not a second flush's


def test_a_new_run_removes_an_unfinished_save_a_dead_run_left(tmp_path):
    unfinished = tmp_path / "run" / "checkpoints" / ".tmp-step_00000007"
    unfinished.mkdir(parents=True)
    (unfinished / "__0_0.distcp").write_bytes(b"half a shard")
    run = train(tmp_path / "run", "--trainer.total_steps", "1")
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 0, stderr[-3000:]
    assert f"rollplex: removed {unfinished}, an earlier run's unfinished checkpoint save" in stdout
    assert sorted(p.name for p in unfinished.parent.iterdir()) == ["step_00000001"]


def test_ranks_other_than_0_end_in_a_short_line(tmp_path):
    """Under torchrun every rank reports; rank 0 alone looks up the checkpoint and says how to resume."""
    failed = RewardsFailed("reward function r.py:f failed on all 8 responses of the step")
    assert run_end_line(failed, tmp_path, rank=3, log=tmp_path / "error.log") == \
        f"rollplex rank 3: reward function r.py:f failed on all 8 responses of the step. " \
        f"The traceback is in {tmp_path / 'error.log'}."
    assert run_end_line(KeyboardInterrupt(), tmp_path, rank=0, log=None) == \
        "rollplex: interrupted (Ctrl-C). No checkpoint was saved yet. ROLLPLEX_DEBUG=1 prints the traceback."
