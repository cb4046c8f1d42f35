"""A run's length in epochs (trainer.total_epochs), the evaluation before training (trainer.val_before_train) and
the running counts among a step's metrics (names ending in _total)."""

import json

import pytest

from rollplex.config import ConfigError, DataConfig, TrainerConfig, load_config
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer
from rollplex.rl.setup import PromptSource
from rollplex.rl.step_metrics import combine_updates

FAST = ["--data.batch_size", "4", "--rollout.n", "2", "--rollout.max_tokens", "2", "--trainer.save_every", "0",
        "--trainer.eval_every", "0", "--logging.no_console", "--algorithm.updates_per_batch", "1"]


def _rows(path, n: int):
    path.write_text("".join(json.dumps({"problem": f"what colour is row {i} ?", "answer": "red"}) + "\n"
                            for i in range(n)))
    return str(path)


def test_total_epochs_sets_the_steps_and_val_before_train_logs_step_0(tmp_path):
    train, val = _rows(tmp_path / "train.jsonl", 6), _rows(tmp_path / "val.jsonl", 2)
    trainer = RLTrainer(load_config(FAST + [
        "--trainer.output_dir", str(tmp_path / "run"), "--data.train_files", train, "--data.val_files", val,
        "--trainer.total_epochs", "2", "--trainer.val_before_train"]))
    trainer.fit()
    assert trainer.total_steps == trainer.step == 3  # ceil(2 epochs x 6 rows / 4 prompts a step)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert set(rows[0]) == {"step", "val/score"}  # the untrained model's score, before any update
    assert "actor/pg_loss" in rows[1] and "val/score" not in rows[1]
    # 6 rows, 4 a step: step 2 starts in the first pass and runs into the second, which step 3 is in.
    assert [r["training/epoch"] for r in rows[1:]] == [0, 0, 1]


def test_total_epochs_needs_data_files(tmp_path):
    from rollplex.data.processor import load_processor
    from rollplex.tiny import TinySpec, write_tiny_files

    write_tiny_files(tmp_path, TinySpec())
    source = PromptSource(DataConfig(val_size=1), load_processor(tmp_path))
    assert source.run_steps(TrainerConfig(total_steps=5)) == 5
    with pytest.raises(ConfigError, match="built-in task 'color' has no epochs"):
        source.run_steps(TrainerConfig(total_steps=0, total_epochs=1))


def test_a_running_count_is_the_steps_last_not_averaged_over_its_updates():
    """Two optimizer steps in one RL step, the second skipped: the skipped steps so far are 1, not their mean."""
    first = {"actor/pg_loss": 1.0, "actor/skipped_steps_total": 0.0, "training/nonfinite_logprobs": 0.0}
    second = {"actor/pg_loss": 3.0, "actor/skipped_steps_total": 1.0, "training/nonfinite_logprobs": 2.0}
    assert combine_updates([first, second]) == {"actor/pg_loss": 2.0, "actor/skipped_steps_total": 1.0,
                                                "training/nonfinite_logprobs": 2.0}
