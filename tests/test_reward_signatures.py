"""Reward files as verl, EasyR1 and TRL document them, scored through RewardScorer with
the dataset row's columns; dict results' components; a run whose every reward fails
stops, naming the function and its error; a tiny run scores through a verl file."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rollplex.config import ConfigError, DataConfig, load_config
from rollplex.data.datasets import PromptDataset
from rollplex.data.reward_scoring import RewardScorer
from rollplex.data.rewards import Reward, detect_kind, score_of
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer
from rollplex.rl.step_metrics import RewardsFailed

# verl: custom_reward_function.path = this file, custom_reward_function.name = compute_score.
VERL_REWARD = '''
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "hiyouga/geometry3k":
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    boxed = re.findall(r"\\\\boxed\\{([^}]*)\\}", solution_str)
    acc = bool(boxed) and boxed[-1].strip() == ground_truth
    return {"score": float(acc), "acc": acc, "pred": boxed[-1] if boxed else "", "index": extra_info["index"]}
'''

# EasyR1: worker.reward.reward_function = this file:compute_score, reward_type batch (examples/reward_function/math.py).
EASYR1_REWARD = '''
import re
from typing import Any


def format_reward(response: str) -> float:
    pattern = re.compile(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", re.DOTALL)
    return 1.0 if re.fullmatch(pattern, response) else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    boxed = re.findall(r"\\\\boxed\\{([^}]*)\\}", response)
    return 1.0 if boxed and boxed[-1].strip() == ground_truth else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use `reward_type=batch` for math reward function.")
    scores = []
    for reward_input in reward_inputs:
        response = re.sub(r"\\s*(<|>|/)\\s*", r"\\1", reward_input["response"])
        format_score = format_reward(response)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        scores.append({
            "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
            "format": format_score,
            "accuracy": accuracy_score,
            "length": reward_input["response_length"],
        })
    return scores


def sequential(reward_input: dict[str, Any]) -> dict[str, float]:
    return compute_score([reward_input])[0]
'''

# TRL: GRPOTrainer(reward_funcs=[...]); dataset columns arrive as keyword lists.
TRL_REWARD = '''
def accuracy_reward(completions, solution, **kwargs):
    """Conversational: each completion is a list of one assistant message."""
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if content.strip() == answer else 0.0 for content, answer in zip(contents, solution)]


def reward_len(completions, **kwargs):
    """Standard format: each completion is a string (TRL's docs example)."""
    return [-abs(20 - len(completion)) for completion in completions]


def token_count(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
'''


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def geometry3k_verl_rows(folder: Path, n: int) -> Path:
    """A verl-layout JSONL as verl's geo3k preprocessing writes it, with small images."""
    rows = []
    for i in range(n):
        image = folder / f"img_{i}.png"
        Image.fromarray(np.full((56, 56, 3), 40 * i, dtype=np.uint8)).save(image)
        rows.append({"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": f"<image> Find x. ({i})"}],
                     "images": [{"path": image.name}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
                     "extra_info": {"split": "train", "index": i}})
    path = folder / "geo3k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_kinds_are_detected_from_parameter_names(tmp_path):
    verl, easyr1, trl = (write(tmp_path / f"{name}.py", text) for name, text in
                         (("verl", VERL_REWARD), ("easyr1", EASYR1_REWARD), ("trl", TRL_REWARD)))
    assert Reward(f"{verl}:compute_score").kind == "verl"
    assert Reward(f"{easyr1}:compute_score").kind == "easyr1"
    assert Reward(f"{easyr1}:sequential").kind == "easyr1_sequential"
    assert Reward(f"{trl}:accuracy_reward").kind == Reward(f"{trl}:reward_len").kind == "trl"
    assert Reward("exact_match").kind == detect_kind(len) == "rollplex"
    assert Reward(f"{verl}:compute_score", kind="rollplex").kind == "rollplex"  # data.reward_kind overrides
    with pytest.raises(ValueError, match="unknown reward kind 'openrlhf'"):
        Reward("exact_match", kind="openrlhf")
    with pytest.raises(ConfigError, match="data.reward_kind"):
        DataConfig(reward_kind="openrlhf")


def test_verl_compute_score_gets_the_rows_columns(processor, tmp_path):
    examples = list(PromptDataset(geometry3k_verl_rows(tmp_path, 3), processor, max_prompt_length=256))
    assert examples[1].columns["data_source"] == "hiyouga/geometry3k"
    assert "images" not in examples[1].columns and examples[1].columns["prompt"][0]["role"] == "user"
    responses = ["so \\boxed{1}", "\\boxed{7}", "no box"]
    reward = write(tmp_path / "verl_reward.py", VERL_REWARD)
    with RewardScorer(f"{reward}:compute_score", workers=1) as scorer:  # the worker-process path
        result = scorer.score(responses, [e.answer for e in examples], columns=[e.columns for e in examples])
    assert scorer.kind == "verl"
    assert result.scores == [1.0, 0.0, 0.0] and result.errors == 0
    # Numbers and booleans are components (the score too); the text "pred" is not.
    assert result.components == [{"score": 1.0, "acc": 1.0, "index": 0.0}, {"score": 0.0, "acc": 0.0, "index": 1.0},
                                 {"score": 0.0, "acc": 0.0, "index": 2.0}]


def test_easyr1_batch_reward_scores_chunks_in_order(tmp_path):
    reward = write(tmp_path / "math.py", EASYR1_REWARD)
    responses = ["<think>a</think> \\boxed{3}", "\\boxed{3}", "<think> b </think> \\boxed{4}", "x", "\\boxed{5}"]
    ids = [[1] * (i + 1) for i in range(5)]
    with RewardScorer(f"{reward}:compute_score", workers=2) as scorer:  # the batch splits into one chunk per worker
        result = scorer.score(responses, ["3", "3", "3", "3", "5"], response_ids=ids)
    assert scorer.kind == "easyr1"
    assert result.scores == pytest.approx([1.0, 0.9, 0.1, 0.0, 0.9]) and result.errors == 0
    assert [c["accuracy"] for c in result.components] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [c["length"] for c in result.components] == [1.0, 2.0, 3.0, 4.0, 5.0]  # response_length: tokens
    sequential = RewardScorer(f"{reward}:sequential", workers=0).score(responses[:2], ["3", "3"])
    assert sequential.scores == pytest.approx([1.0, 0.9])


def test_trl_rewards_get_columns_as_keywords(processor, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "what is 1 + 2 ?"}], "solution": "3"},
            {"prompt": [{"role": "user", "content": "what is 2 + 2 ?"}], "solution": "4"}]
    data = tmp_path / "trl.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = list(PromptDataset(data, processor, 256, answer_key="solution"))
    reward = write(tmp_path / "trl_reward.py", TRL_REWARD)
    columns = [e.columns for e in examples]
    with RewardScorer(f"{reward}:accuracy_reward", workers=1) as scorer:
        assert scorer.score([" 3 ", "5"], [e.answer for e in examples], columns=columns).scores == [1.0, 0.0]
    # An EasyR1-layout row holds its prompt as text: TRL's standard format, completions as strings.
    standard = RewardScorer(f"{reward}:reward_len", workers=0)
    assert standard.score(["x" * 18, "y" * 25], ["", ""], columns=[{"prompt": "p"}] * 2).scores == [-2.0, -5.0]
    counted = RewardScorer(f"{reward}:token_count", workers=0).score(["a", "b"], ["", ""], response_ids=[[1, 2], [3]])
    assert counted.scores == [2.0, 1.0]


def test_dict_scores_and_their_errors():
    assert score_of({"overall": 0.5, "format": True, "note": "x"}) == (0.5, {"overall": 0.5, "format": 1.0})
    assert score_of({"score": 1, "overall": 0.25}, score_key="score")[0] == 1.0
    assert score_of(0.75) == (0.75, {})
    with pytest.raises(KeyError, match="no 'overall' or 'score' entry.*'acc'.*data.reward_score_key"):
        score_of({"acc": 1.0})
    with pytest.raises(TypeError, match="returned None"):
        score_of(None)


def test_a_failing_batch_call_costs_its_chunk_and_a_wrong_length_fails_the_batch(tmp_path):
    reward = write(tmp_path / "batch.py", '''
        def compute_score(reward_inputs):
            if any(r["response"] == "boom" for r in reward_inputs):
                raise RuntimeError("grader crashed")
            return [{"overall": 1.0} for _ in reward_inputs[1:]]  # one result short
    ''')
    with RewardScorer(f"{reward}:compute_score", workers=0) as scorer:
        with pytest.warns(UserWarning, match=r"failed on 2 of 2.*ValueError: easyr1 reward functions return a list "
                                             r"of one result per response: got 1 for 2"):
            result = scorer.score(["a", "b"], ["", ""])
    assert result.scores == [0.0, 0.0] and result.failed == 2
    with RewardScorer(f"{reward}:compute_score", workers=2) as scorer:
        with pytest.warns(UserWarning, match=r"failed on 4 of 4.*first error: RuntimeError: grader crashed"):
            result = scorer.score(["a", "boom", "b", "c"], [""] * 4)
    # Chunk ["a", "boom"] raised; chunk ["b", "c"] came back one result short: every sample failed.
    assert result.errors == 4 and result.first_error == "RuntimeError: grader crashed (batch.py:4 in compute_score)"
    # The worker's traceback comes back from the function's own frame on, none of Rollplex's around it.
    assert result.first_traceback.startswith("Traceback (most recent call last):\n  File ")
    assert f'{reward}", line 4, in compute_score' in result.first_traceback
    assert "rollplex" not in result.first_traceback


# ----------------------------------------------------------------------------- tiny runs

TINY_RUN = ["--trainer.total_steps", "1", "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4",
            "--trainer.eval_every", "1", "--trainer.save_every", "0", "--logging.no_console"]

# A verl reward a tiny random model can earn: the response's length, weighted by the row's extra_info.
VERL_LENGTH_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "hiyouga/geometry3k":
        raise NotImplementedError(f"Reward function is not implemented for {data_source=}")
    length = min(len(solution_str), 10) / 10
    return {"score": length * (extra_info["index"] + 1), "length": length}
'''


def tiny_run(tmp_path: Path, reward: str, *extra: str) -> RLTrainer:
    data = geometry3k_verl_rows(tmp_path, 2)
    reward_file = write(tmp_path / "reward.py", reward)
    return RLTrainer(load_config(TINY_RUN + ["--trainer.output_dir", str(tmp_path / "run"),
                                             "--data.train_files", str(data), "--data.val_files", str(data),
                                             "--data.reward", f"{reward_file}:compute_score", *extra]))


def test_a_tiny_run_scores_through_a_verl_reward_file(tmp_path):
    trainer = tiny_run(tmp_path, VERL_LENGTH_REWARD)
    trainer.fit()
    [row] = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert row["reward/errors"] == 0 and row["critic/score/mean"] > 0 and row["val/score"] > 0
    assert 0 < row["reward/length/mean"] <= 1 and "reward/score/mean" in row


def test_a_run_whose_every_reward_fails_stops_with_the_name_and_error(tmp_path):
    # Called as rollplex's fn(response, answer), a verl function fails on every sample: the run stops at step 1.
    trainer = tiny_run(tmp_path, VERL_LENGTH_REWARD, "--data.reward_kind", "rollplex")
    with pytest.raises(RewardsFailed, match=r"reward function .*reward.py:compute_score failed on all 4 responses.*"
                                            r"first error: TypeError: compute_score\(\) missing 1 required"):
        trainer.fit()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run" / "metrics.jsonl")


HANGING_REWARD = '''
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)
'''


def test_a_run_whose_every_reward_hangs_stops_naming_the_time_limit(tmp_path):
    # In worker processes, the step's calls share data.reward_timeout_s: the run stops within about that.
    trainer = tiny_run(tmp_path, HANGING_REWARD, "--data.reward_workers", "2", "--data.reward_timeout_s", "0.5")
    with pytest.raises(RewardsFailed, match=r"failed on all 4 responses of the step; none was scored within "
                                            r"data.reward_timeout_s\. A function that hangs needs a fix"):
        trainer.fit()


# An EasyR1 batch reward that scores the response's length in tokens, as EasyR1 passes it.
EASYR1_TOKEN_LENGTH_REWARD = '''
def compute_score(reward_inputs):
    return [{"overall": float(r["response_length"] > 0)} for r in reward_inputs]
'''


def test_validation_responses_reach_a_batch_reward_with_their_tokens(tmp_path):
    trainer = tiny_run(tmp_path, EASYR1_TOKEN_LENGTH_REWARD)
    # every greedy response has at least one token; the rows' data_source splits the score too
    assert trainer.evaluate()["val/score"] == 1.0


# EasyR1's dapo.py shape: the reward needs the run's maximum response length, given by data.reward_kwargs.
EASYR1_WITH_KWARGS = '''
def compute_score(reward_inputs, max_response_length, overlong_buffer_length=0):
    return [{"overall": 1.0 - len(r["response"]) / max_response_length, "buffer": overlong_buffer_length}
            for r in reward_inputs]
'''


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_kwargs_reach_every_call(tmp_path, workers):
    fn = write(tmp_path / "dapo.py", EASYR1_WITH_KWARGS)
    kwargs = DataConfig(reward_kwargs='{"max_response_length": 8, "overlong_buffer_length": 2}')
    with RewardScorer(f"{fn}:compute_score", workers=workers, kwargs=kwargs.reward_keyword_arguments()) as scorer:
        result = scorer.score(["ab", "abcd"], ["", ""])
    assert scorer.kind == "easyr1" and result.scores == [0.75, 0.5] and result.errors == 0
    assert [c["buffer"] for c in result.components] == [2, 2]


def test_reward_kwargs_must_be_a_json_object():
    with pytest.raises(ConfigError, match="data.reward_kwargs is not JSON"):
        DataConfig(reward_kwargs="max_response_length=8")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        DataConfig(reward_kwargs="[8]")
