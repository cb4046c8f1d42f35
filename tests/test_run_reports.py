"""What a run tells its user beside metrics.jsonl: the start-up summary, a line per save and
evaluation, the samples files (<output_dir>/samples/step_N.jsonl) and the wandb tracker."""

import json
from pathlib import Path

import pytest

from distributed import run_distributed
from offline_trackers import wandb_run
from rollplex.config import load_config
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer
from rollplex.rl.trainer import build_trainer

FAST = ["--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4", "--data.val_size", "4",
        "--trainer.num_threads", "1"]


def fit(out: Path, *extra: str) -> RLTrainer:
    trainer = build_trainer(load_config(FAST + ["--trainer.output_dir", str(out), *extra]))
    trainer.fit()
    return trainer


def samples(out: Path, step: int) -> list[dict]:
    path = out / "samples" / f"step_{step:08d}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_run_reports_its_start_saves_evaluations_and_samples(tmp_path, capsys):
    fit(tmp_path, "--trainer.total_steps", "2", "--trainer.eval_every", "2", "--trainer.save_every", "2",
        "--trainer.log_samples_every", "1", "--trainer.log_samples", "3")
    out = capsys.readouterr().out
    assert f"rollplex: new run in {tmp_path}" in out
    assert "parameters, compute float32" in out and "train: built-in task 'color' (endless); val: 4 prompts" in out
    assert "2 (2 to go); 4 prompts x 4 responses = 16 samples per step" in out
    assert "1 rank(s): dp_shard 1 x tp 1, engine tp 1; schedule serial-prefix" in out
    assert f"step 2: saved checkpoint {tmp_path / 'checkpoints' / 'step_00000002'}" in out
    assert f"generations in {tmp_path / 'samples' / 'step_00000002.jsonl'}" in out

    first = samples(tmp_path, 1)
    assert [r["split"] for r in first] == ["train"] * 3
    assert len({r["index"] for r in first}) == 3  # one response to each of three prompts
    for record in first:
        assert record["prompt"] and record["answer"] and record["finish_reason"] in ("stop", "length")
        assert {"response", "score", "advantage"} <= record.keys()
    second = samples(tmp_path, 2)
    val = [r for r in second if r["split"] == "val"]
    assert [r["split"] for r in second] == ["train"] * 3 + ["val"] * 4  # every validation generation
    assert sorted(r["index"] for r in val) == [r["index"] for r in val]
    rows = read_metrics(tmp_path)
    assert rows[-1]["val/score"] == pytest.approx(sum(r["score"] for r in val) / 4)
    assert f"val/score {rows[-1]['val/score']:.4g} over 4 prompts" in out

    fit(tmp_path, "--trainer.total_steps", "3", "--trainer.eval_every", "2", "--trainer.save_every", "2",
        "--trainer.log_samples_every", "0")
    out = capsys.readouterr().out
    assert f"rollplex: resuming {tmp_path} from {tmp_path / 'checkpoints' / 'step_00000002'} (step 2)" in out
    assert "3 (1 to go)" in out
    assert [r["split"] for r in samples(tmp_path, 3)] == ["val"] * 4  # evaluations write, whatever log_samples_every


def test_logging_wandb_gets_the_runs_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run stays in <output_dir>/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit(tmp_path, "--trainer.total_steps", "1", "--trainer.eval_every", "1", "--trainer.save_every", "0",
        "--logging.no_console", "--logging.wandb", "true", "--logging.project", "tests")
    history, config = wandb_run(tmp_path)
    (row,) = read_metrics(tmp_path)
    assert history[1]["val/score"] == row["val/score"]
    assert history[1]["critic/score/mean"] == row["critic/score/mean"]
    assert config["trainer"]["output_dir"] == str(tmp_path) and config["logging"]["project"] == "tests"


SAMPLED_VALIDATION = ["--trainer.val_n", "2", "--trainer.val_temperature", "1.0"]


def disagg_on_two_ranks(rank: int, world: int, out: str) -> None:
    fit(Path(out), "--trainer.total_steps", "1", "--trainer.eval_every", "1", "--trainer.save_every", "0",
        "--logging.no_console", "--schedule.kind", "disagg", "--schedule.rollout_ranks", "1", *SAMPLED_VALIDATION)


def test_disagg_evaluation_writes_the_generations_one_process_does(tmp_path):
    """The rollout rank generates the validation responses (trainer.val_n each, sampled); rank 0, a trainer,
    writes them."""
    fit(tmp_path / "serial", "--trainer.total_steps", "1", "--trainer.eval_every", "1", "--trainer.save_every", "0",
        "--logging.no_console", *SAMPLED_VALIDATION)
    run_distributed(disagg_on_two_ranks, 2, str(tmp_path / "disagg"))
    serial, disagg = samples(tmp_path / "serial", 1), samples(tmp_path / "disagg", 1)
    assert len([r for r in serial if r["split"] == "val"]) == 4 * 2
    assert [r for r in disagg if r["split"] == "val"] == [r for r in serial if r["split"] == "val"]
    assert read_metrics(tmp_path / "disagg")[0]["val/score"] == read_metrics(tmp_path / "serial")[0]["val/score"]


def test_bf16_or_fp16_compute_on_a_cpu_is_called_slow_in_one_line_saying_how_to_change_it():
    from rollplex.rl.reports import slow_cpu_compute_note

    note = slow_cpu_compute_note("bfloat16", "cpu")
    assert "\n" not in note and "bfloat16 on a CPU is slow" in note
    assert "--model.dtype float32" in note and "preset: tiny" in note
    assert "float16 on a CPU" in slow_cpu_compute_note("float16", "cpu")
    assert slow_cpu_compute_note("float32", "cpu") is None and slow_cpu_compute_note("bfloat16", "cuda") is None
