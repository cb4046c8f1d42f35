"""A run's output folder: one live run at a time (a second one stops, naming the first; a killed run's restart takes
it over), metrics.jsonl and the samples files holding each step of the run once (a resumed run's cut back to its
checkpoint, a new run's earlier ones set aside), and trainer.output_dir a folder, never empty."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import run_distributed
from rollplex import metrics as M
from rollplex.config import ConfigError, TrainerConfig, config_from_dict, load_config, load_config_file
from rollplex.metrics import start_run_files
from rollplex.rl.loop import RLTrainer
from rollplex.run_lock import LOCK_FILE, LockHolder, RunFolderInUse, RunLock
from test_rl_loop import FAST, run

ROOT = Path(__file__).resolve().parent.parent


def start_train_py(out: Path, *extra: str, **env: str) -> subprocess.Popen:
    """`python train.py` on the tiny defaults in another process, as a user starts a run; its console goes to
    <out>.log."""
    cmd = [sys.executable, "train.py", *FAST, "--trainer.output_dir", str(out), "--trainer.num_threads", "1", *extra]
    with open(f"{out}.log", "w") as console:
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=console, stderr=subprocess.STDOUT)


def logged_steps(out: Path) -> list[int]:
    """The step of every line of out/metrics.jsonl, as the file holds them (read_metrics would hide repeats)."""
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_second_run_in_a_live_runs_folder_stops_naming_it_and_takes_over_once_it_is_killed(tmp_path):
    out = tmp_path / "run"
    first = start_train_py(out, "--trainer.total_steps", "1000")
    try:
        deadline = time.time() + 120
        while not (out / "metrics.jsonl").is_file() or not logged_steps(out):  # it trains: it is live
            assert first.poll() is None and time.time() < deadline, Path(f"{out}.log").read_text()[-3000:]
            time.sleep(0.2)
        with pytest.raises(RunFolderInUse) as refused:
            RLTrainer(load_config(FAST + ["--trainer.output_dir", str(out)]))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    message = str(refused.value)
    assert f"trainer.output_dir {out} is in use by another run, pid {first.pid} on host {socket.gethostname()}" \
        in message and "train.py" in message  # the holder, and its command
    assert "another trainer.output_dir" in message  # a way on
    assert not list(out.glob("metrics.*.jsonl"))  # the refused run touched nothing of the first one's

    _, rows = run(out)  # the killed run's lock was the kernel's to drop: the folder is free
    assert [r["step"] for r in rows] == [1, 2] and logged_steps(out) == [1, 2]
    assert not (out / LOCK_FILE).exists()  # released at the run's end


def test_a_sigkilled_run_restarts_in_its_folder_with_each_step_logged_once(tmp_path, capsys):
    """Killed as step 4 starts, after step 3 was logged and step 2 saved: the restart redoes step 3, and the
    files hold it once, as the checkpoints do."""
    out, length = tmp_path / "run", ["--trainer.eval_every", "0", "--trainer.save_every", "2",
                                     "--trainer.total_steps", "5"]
    killed = start_train_py(out, *length, "--trainer.log_samples_every", "1", ROLLPLEX_KILL_AT_STEP="4:0")
    assert killed.wait(timeout=300) == -signal.SIGKILL, Path(f"{out}.log").read_text()[-3000:]
    assert logged_steps(out) == [1, 2, 3]
    left_behind = LockHolder.read(out / LOCK_FILE)  # a SIGKILL runs no clean-up: the pid file stays

    run(out, *length, "--trainer.log_samples_every", "2")
    assert logged_steps(out) == [1, 2, 3, 4, 5]
    samples = sorted(p.name for p in (out / "samples").iterdir())
    assert samples == ["step_00000001.jsonl", "step_00000002.jsonl", "step_00000004.jsonl"]  # not the old 3's
    assert "at step 2: dropped the steps after it, which the run redoes (1 line(s) of metrics.jsonl, " \
           "1 samples file(s))" in capsys.readouterr().out
    assert left_behind.pid == killed.pid and not (out / LOCK_FILE).exists()  # taken over, then released


def test_a_new_run_keeps_an_earlier_runs_files_aside(tmp_path, capsys):
    run(tmp_path, "--trainer.log_samples_every", "1", "--rollout.temperature", "0.9")
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_bytes(b"x")  # as logging.tensorboard leaves them
    run(tmp_path, "--trainer.log_samples_every", "1")  # no checkpoint to resume: a new run
    assert logged_steps(tmp_path) == [1, 2]
    [old_metrics] = tmp_path.glob("metrics.*.jsonl")
    [old_samples] = tmp_path.glob("samples.*")
    [old_config] = tmp_path.glob("config.*.yaml")
    [old_events] = tmp_path.glob("tb.*")
    stamp = old_metrics.name.removeprefix("metrics.").removesuffix(".jsonl")
    assert stamp == old_samples.suffix[1:] == old_config.name.split(".")[1] == old_events.suffix[1:]  # one time
    assert [json.loads(line)["step"] for line in old_metrics.read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in old_samples.iterdir()) == sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert load_config_file(old_config).rollout.temperature == 0.9  # the earlier run's, kept
    assert load_config_file(tmp_path / "config.yaml").rollout.temperature == 1.0
    assert (f"rollplex: new run in {tmp_path}: kept the earlier run's metrics.jsonl as {old_metrics.name}, "
            f"samples as {old_samples.name}, config.yaml as {old_config.name}, tb as {old_events.name}"
            ) in capsys.readouterr().out


def test_a_resumed_runs_metrics_are_cut_back_to_its_checkpoint_through_a_new_file(tmp_path, monkeypatch):
    lines = ['{"run": "header"}', '{"step": 1}', '{"step": 2, "val/score": 0.5}', '{"step": 3}',
             '{"step": 2, "val/score": 0.75}', '{"step": 3}', '{"step": 4}', '{"step": 5, "crit']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))  # an earlier version's resume, then a torn write
    (tmp_path / "samples").mkdir()
    for name in ("step_00000003.jsonl", "step_00000004.jsonl", "notes.txt"):
        (tmp_path / "samples" / name).write_text("{}\n")

    def crash(*args):
        raise OSError("killed mid-rename")

    monkeypatch.setattr(M.os, "replace", crash)
    with pytest.raises(OSError, match="killed mid-rename"):
        start_run_files(tmp_path, 3)
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines)  # nothing lost
    assert len(list((tmp_path / "samples").iterdir())) == 3
    monkeypatch.undo()

    assert start_run_files(tmp_path, 3) == (f"resuming {tmp_path} at step 3: dropped the steps after it, which the "
                                            f"run redoes (4 line(s) of metrics.jsonl, 1 samples file(s))")
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert kept == ['{"run": "header"}', '{"step": 1}', '{"step": 2, "val/score": 0.75}', '{"step": 3}']
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["notes.txt", "step_00000003.jsonl"]
    assert start_run_files(tmp_path, 3) is None  # already the checkpoint's


def refused_on_every_rank(rank, world, out, holder):
    with pytest.raises(RunFolderInUse, match=f"pid {holder} on host"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", out, "--trainer.num_threads", "1"]))


def test_every_rank_stops_on_a_folder_another_run_holds(tmp_path):
    """Rank 0 alone takes the lock; its refusal reaches rank 1, which would otherwise wait for it."""
    lock = RunLock.acquire(tmp_path)  # this test's process holds it; the ranks are processes of their own
    try:
        run_distributed(refused_on_every_rank, 2, str(tmp_path), os.getpid())
    finally:
        lock.release()


def test_a_lock_held_past_its_holders_death_names_the_dead_pid(tmp_path):
    """A child forked without exec shares its parent's lock: the refusal says the holder is gone and how to find
    what holds the lock."""
    script = """
import os, sys, time
from rollplex.run_lock import RunLock
RunLock.acquire(sys.argv[1])
child = os.fork()
if child == 0:  # holds the lock on, its console closed so that the test does not wait for it
    quiet = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(quiet, fd)
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""
    parent = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, check=True)
    child = int(parent.stdout)
    try:
        with pytest.raises(RunFolderInUse, match=rf"pid \d+ on this host, which is no longer running, but a process "
                                                 rf"it started still holds .*{LOCK_FILE} \(`fuser"):
            RunLock.acquire(tmp_path)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_later_trainer_of_the_same_process_takes_the_folder_over(tmp_path):
    """As a tool that builds a trainer per schedule in one folder, and fits none, does."""
    first = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path)]))
    second = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path)]))
    first.fit()  # the folder is no longer the first one's to release
    assert LockHolder.read(tmp_path / LOCK_FILE).pid == os.getpid()
    second.fit()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_run_that_fails_to_start_leaves_its_folder_free(tmp_path):
    with pytest.raises(ValueError, match="fewer than algorithm.updates_per_batch"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--data.batch_size", "1",
                                      "--algorithm.updates_per_batch", "2"]))
    assert tmp_path.is_dir() and not (tmp_path / LOCK_FILE).exists()


def test_output_dir_is_a_folder_and_never_empty(tmp_path):
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match="trainer.output_dir must be a folder .*not empty"):
            TrainerConfig(output_dir=empty)
    with pytest.raises(ConfigError, match="trainer.output_dir must be a folder .*x.yaml"):
        config_from_dict({"trainer": {"output_dir": ""}}, "x.yaml")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError, match=f"trainer.output_dir {tmp_path / 'file'} is a file, not a folder"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path / "file")]))
    below = tmp_path / "file" / "run"
    with pytest.raises(ConfigError, match=f"trainer.output_dir {below} is below {tmp_path / 'file'}, which is a file"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(below)]))
