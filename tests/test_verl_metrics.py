"""The metrics a verl user looks for (critic/rewards, critic/advantages, prompt_length, response_length's
range, training/epoch), combined over dp ranks, and validation as verl's val_kwargs sample it (trainer.val_n,
val_temperature, val_top_p), split by the rows' data_source."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollplex.config import load_config
from rollplex.dist import init_distributed
from rollplex.data.reward_scoring import RewardScores
from rollplex.metrics import read_metrics
from rollplex.models.inputs import Group, Sample
from rollplex.rl.loop import RLTrainer
from rollplex.rl.rollout import Rollout
from rollplex.rl.step import StepState
from rollplex.rl.step_metrics import sample_metrics

REWARD = Path(__file__).with_name("length_reward.py")  # scores that differ within a group


def _state(prompt_lengths: list[int], response_lengths: list[list[int]], scores: list[float],
           advantages: list[float], epochs: list[int | None], errors: int = 0) -> StepState:
    """A step's state on one rank: a group per prompt of `prompt_lengths` tokens, with responses of the given lengths
    (one ending at the length limit), and its examples drawn in `epochs`."""
    groups = [Group(SimpleNamespace(input_ids=[0] * p), [Sample([1] * n, [0.0] * n, "length" if n == 4 else "stop")
                                                          for n in lengths])
              for p, lengths in zip(prompt_lengths, response_lengths)]
    examples = [SimpleNamespace(epoch=e) for e in epochs]
    state = StepState(1, examples, rollout=Rollout(examples, groups, [""] * len(scores)))
    state.rewards, state.advantages = RewardScores(scores, errors=errors), advantages
    return state


def test_sample_metrics_are_verls_names_and_meanings():
    """On one rank (tests/test_rl_loop.py's two-rank run logs what one rank does: they combine over ranks)."""
    init_distributed("cpu")
    state = _state(prompt_lengths=[10, 30, 20], response_lengths=[[2, 4], [1, 3], [4, 2]],
                   scores=[1.0, 0.0, 0.5, 0.5, 2.0, -1.0], advantages=[1.0, -1.0, 0.0, 0.0, 0.5, -0.5],
                   epochs=[2, 3, 2], errors=1)  # the batch runs from epoch 2 into 3
    metrics = sample_metrics(state, group=None)
    assert metrics["critic/score/mean"] == pytest.approx(3.0 / 6)
    assert (metrics["critic/score/max"], metrics["critic/score/min"]) == (2.0, -1.0)
    assert metrics["critic/rewards/mean"] == pytest.approx(3.0 / 6)
    # verl's mean is over response tokens (16 of them): it shows whether longer responses get the higher advantages.
    assert metrics["critic/advantages/mean"] == pytest.approx((2 - 4 + 0 + 0 + 2 - 1) / 16)
    assert (metrics["critic/advantages/max"], metrics["critic/advantages/min"]) == (1.0, -1.0)
    assert metrics["prompt_length/mean"] == pytest.approx((2 * 10 + 2 * 30 + 2 * 20) / 6)  # once per sample
    assert (metrics["prompt_length/max"], metrics["prompt_length/min"]) == (30, 10)
    assert metrics["response_length/mean"] == pytest.approx(16 / 6)
    assert (metrics["response_length/max"], metrics["response_length/min"]) == (4, 1)
    assert metrics["response_length/clip_ratio"] == pytest.approx(2 / 6)
    assert metrics["reward/errors"] == 1
    assert metrics["training/epoch"] == 2  # the epoch the batch's first row comes from

    # The synthetic tasks and validation rows have no epochs: no training/epoch.
    state.rollout.examples = [SimpleNamespace(epoch=None)] * 3
    assert "training/epoch" not in sample_metrics(state, group=None)


def _rows(path: Path, sources: list[str | None]) -> str:
    """Rows of the verl layout, with a data_source where `sources` names one."""
    rows = [{"problem": f"what colour is row {i} ?", "answer": "red", **({"data_source": s} if s else {})}
            for i, s in enumerate(sources)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


FAST = ["--data.batch_size", "4", "--rollout.n", "2", "--rollout.max_tokens", "4", "--trainer.save_every", "0",
        "--logging.no_console", "--algorithm.updates_per_batch", "1", "--trainer.num_threads", "1",
        "--data.reward", str(REWARD)]


def test_sampled_validation_scores_every_response_per_data_source_and_draws_alike_each_time(tmp_path):
    train = _rows(tmp_path / "train.jsonl", [None] * 4)
    val = _rows(tmp_path / "val.jsonl", ["gsm8k", "geo/3k", "gsm8k", None])
    trainer = RLTrainer(load_config(FAST + [
        "--trainer.output_dir", str(tmp_path / "run"), "--data.train_files", train, "--data.val_files", val,
        "--trainer.total_steps", "1", "--trainer.eval_every", "0", "--trainer.val_n", "3",
        "--trainer.val_temperature", "1.0", "--trainer.val_top_p", "0.9"]))
    metrics = trainer.evaluate()
    records = [json.loads(line) for line in (tmp_path / "run" / "samples" / "step_00000000.jsonl").open()]
    assert [r["index"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # every response, prompt by prompt
    assert len({r["response"] for r in records}) > 4  # sampled: a prompt's responses differ
    assert metrics["val/score"] == pytest.approx(sum(r["score"] for r in records) / 12)
    for source, rows in (("gsm8k", {0, 2}), ("geo/3k", {1}), ("unknown", {3})):  # "unknown": rows without one
        scores = [r["score"] for r in records if r["index"] in rows]
        assert metrics[f"val/score/{source}"] == pytest.approx(sum(scores) / len(scores)), source
    assert [r.get("data_source") for r in records[::3]] == ["gsm8k", "geo/3k", "gsm8k", None]
    # The seeds are the run's and the prompts', not the step's: the same weights give the same draws.
    assert trainer._validation_records(trainer.data.val_examples) == records


def _train_samples(out: Path, *extra: str) -> list[list[dict]]:
    """Every step's training samples (all 8 of them) of a 2-step run on the built-in task."""
    RLTrainer(load_config(FAST + ["--trainer.output_dir", str(out), "--trainer.total_steps", "2",
                                  "--trainer.log_samples_every", "1", "--trainer.log_samples", "8", *extra])).fit()
    return [[json.loads(line) for line in (out / "samples" / f"step_{step:08d}.jsonl").open()] for step in (1, 2)]


def test_sampled_validation_leaves_the_trainings_draws_as_they_were(tmp_path):
    unevaluated = _train_samples(tmp_path / "none", "--trainer.eval_every", "0")
    evaluated = _train_samples(tmp_path / "sampled", "--trainer.eval_every", "1", "--trainer.val_n", "2",
                               "--trainer.val_temperature", "1.0", "--trainer.val_before_train")
    assert [[r for r in step if r["split"] == "train"] for step in evaluated] == unevaluated
    assert "val/score" in read_metrics(tmp_path / "sampled")[-1]
