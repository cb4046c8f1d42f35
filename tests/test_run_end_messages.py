"""How a stopped run ends (rollplex.run_errors): one line on stderr saying what happened, the last checkpoint and
how to resume (unless the command must change); the traceback in <output_dir>/error.log, a reward function's own
first; exit status 1, or 130 for Ctrl-C, 143 for SIGTERM (which finishes and saves the step under way first);
under torchrun, the line in torchrun's own report. A save on a full disk removes its half-written folder, and a
new run removes those a dead earlier run left. Rollplex's warnings are one plain line each."""

import errno
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import rollplex.cli
from rollplex.config import ConfigError
from rollplex.data.reward_scoring import RewardScorer
from rollplex.rl.setup import ResumeRefused
from rollplex.rl.step_metrics import RewardsFailed
from rollplex.run_errors import run_end_line, warnings_in_one_line, write_elastic_error_file
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
    assert "first error: RuntimeError: boom (reward.py:2 in reward)." in last  # the function's line
    assert last.endswith(f"No checkpoint was saved yet. The traceback is in {tmp_path / 'run' / 'error.log'}.")
    log = (tmp_path / "run" / "error.log").read_text()
    assert log.startswith("--- ") and " rank 0 pid " in log and "train.py" in log.splitlines()[0]
    # The reward's own traceback (raised in a worker process) first, then the trainer's.
    user, trainer = log.split("The trainer's traceback:\n")
    assert user.splitlines()[1:] == [f"The traceback of reward function {tmp_path / 'reward.py'}:reward's first "
                                     f"failed call:", "Traceback (most recent call last):",
                                     f'  File "{tmp_path / "reward.py"}", line 2, in reward',
                                     "    raise RuntimeError('boom')", "RuntimeError: boom", ""]
    assert trainer.startswith("Traceback (most recent call last)") and "RewardsFailed: reward function" in trainer


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


def test_a_ctrl_c_inside_a_checkpoint_save_ends_as_ctrl_c_not_as_a_failed_save(tmp_path, capsys):
    """DCP turns whatever its save raises, a KeyboardInterrupt too, into a CheckpointException, which the save
    reports as its failure: the line still says Ctrl-C, with status 130 (one cause of the Ctrl-C test's
    occasional wrong ending)."""
    write_data = _FileSystemWriter.write_data

    def ctrl_c_inside_the_save(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # its KeyboardInterrupt is raised here, inside DCP's save
        return write_data(self, *args, **kwargs)

    out = tmp_path / "run"
    with mock.patch.object(_FileSystemWriter, "write_data", ctrl_c_inside_the_save), \
            pytest.raises(SystemExit) as stopped:
        train_in_process(out)
    assert stopped.value.code == 130
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == f"rollplex: interrupted (Ctrl-C). No checkpoint was saved yet. The traceback is in {out}/error.log."
    assert "CheckpointSaveError" in (out / "error.log").read_text()  # what the save made of it, in the log


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


def start_and_wait_for_a_step(out: Path, *extra: str) -> subprocess.Popen:
    """`train` on 50 steps, once it has logged its first one (it is inside its steps)."""
    run = train(out, "--trainer.total_steps", "50", *extra)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert run.poll() is None and time.time() < deadline, "the run ended before its first step"
        time.sleep(0.2)
    return run


def test_sigterm_finishes_the_step_under_way_saves_it_and_ends_with_status_143(tmp_path):
    out = tmp_path / "run"
    run = start_and_wait_for_a_step(out, "--trainer.save_every", "0")  # the only checkpoint is SIGTERM's
    run.send_signal(signal.SIGTERM)  # as SLURM, Kubernetes and `timeout` send it
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 143, stderr[-3000:]
    received, end = stderr.splitlines()
    step = int(received.split("finishing step ")[1].split(",")[0])
    assert received == (f"rollplex: SIGTERM received: finishing step {step}, then saving it and stopping "
                        f"(trainer.save_on_term)")
    checkpoint = out / "checkpoints" / f"step_{step:08d}"
    assert end == (f"rollplex: stopped by SIGTERM after finishing step {step} and saving it (trainer.save_on_term). "
                   f"Last checkpoint: step {step} ({checkpoint}); run the same command to resume. "
                   f"The traceback is in {out / 'error.log'}.")
    assert sorted((out / "checkpoints").iterdir()) == [checkpoint] and (checkpoint / "COMPLETE.json").is_file()
    assert not (out / "run.lock").exists()  # the folder is free for the resume
    assert "Terminated: SIGTERM: step" in (out / "error.log").read_text()


def test_sigterm_without_save_on_term_stops_at_once_and_frees_the_folder(tmp_path):
    out = tmp_path / "run"
    # No saves: a SIGTERM inside one would be wrapped by DCP (the Ctrl-C-inside-a-save test covers that).
    run = start_and_wait_for_a_step(out, "--trainer.save_on_term", "false", "--trainer.save_every", "0")
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 143, stderr[-3000:]
    [line] = stderr.splitlines()
    assert line == f"rollplex: stopped by SIGTERM. No checkpoint was saved yet. The traceback is in {out}/error.log."
    assert not (out / "run.lock").exists()
    assert "Terminated: SIGTERM" in (out / "error.log").read_text()


def test_a_config_the_run_refuses_does_not_say_to_run_the_same_command(tmp_path):
    refused = ResumeRefused("trainer.resume never, but out/checkpoints holds step_00000002: set trainer.resume auto")
    line = run_end_line(refused, tmp_path, rank=0, log=tmp_path / "error.log")
    assert line == f"rollplex: {refused}. The traceback is in {tmp_path / 'error.log'}."
    assert "same command" not in run_end_line(ConfigError("data.batch_size must be >= 1"), tmp_path, 0, None)


def test_torchrun_shows_rank_0s_line_as_the_root_cause(tmp_path):
    """Each rank writes its line and traceback into the error file torchrun names (TORCHELASTIC_ERROR_FILE), so
    torchrun's report ends with the line instead of "error_file: <N/A>"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py", *FAST,
           "--trainer.output_dir", str(tmp_path / "run"), "--trainer.resume", str(tmp_path / "no_such_checkpoint")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    root_cause = done.stderr.split("Root Cause (first observed failure):")[1].splitlines()
    assert "error_file: <N/A>" not in root_cause and root_cause[-1].startswith("=====")
    last = root_cause[-2].strip()  # the traceback's last line, just above torchrun's closing border
    assert last.startswith("rollplex") and "not a complete checkpoint folder" in last, done.stderr[-3000:]
    assert "same command" not in done.stderr  # resuming cannot help: the config must change


def test_the_elastic_error_file_reads_back_with_torchs_own_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    try:
        raise RewardsFailed("reward function r.py:f failed on all 8 responses of the step")
    except RewardsFailed as error:
        write_elastic_error_file("rollplex: reward function r.py:f failed", error)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "error.json"))
    report = ChildFailedError("train.py", {0: failure}).format_msg()
    assert "rollplex: reward function r.py:f failed\n" in report and "RewardsFailed: reward function" in report


def test_rollplex_warnings_print_as_one_plain_line_and_others_as_python_shows_them(tmp_path, capsys, recwarn):
    (tmp_path / "reward.py").write_text(FAILING_REWARD)
    warnings.simplefilter("always")
    with warnings_in_one_line(), RewardScorer(f"{tmp_path / 'reward.py'}:reward", workers=0) as scorer:
        scorer.score(["a", "b"], ["a", "a"])  # warns from Rollplex's own code, as the loop's calls do
        warnings.warn_explicit("a library's own", UserWarning, "/usr/lib/python3/somelib.py", 7)
    assert capsys.readouterr().err == (f"rollplex warning: reward function {tmp_path / 'reward.py'}:reward failed "
                                       f"on 2 of 2 responses (scored 0.0); first error: RuntimeError: boom "
                                       f"(reward.py:2 in reward)\n")
    assert [str(w.message) for w in recwarn] == ["a library's own"]  # shown as before (pytest records it)
