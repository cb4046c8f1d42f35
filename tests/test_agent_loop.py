"""Multi-turn episodes through the RL loop (issue 41), on the look task from scratch: with room for a tool's
answer after a turn (rollout.max_tokens 40), a random policy's turns often end at a tool call's closing tag, and
its episodes go on with the look tool's picture or an error the model reads. In fp32 the engine's logprobs after
observations equal the trainer's (training/rollout_probs_diff_max), the samples files show the turns, and two
ranks log what one does."""

import json

from distributed import run_distributed
from rollplex.config import load_config
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer
from test_rl_loop import FAST

LOOK = FAST + ["--data.task", "look", "--rollout.max_tokens", "40", "--trainer.log_samples_every", "1"]


def run_look(rank, world, out):
    RLTrainer(load_config(LOOK + ["--trainer.output_dir", out, "--trainer.num_threads", "1"])).fit()


def test_look_episodes_train_on_the_rollouts_tokens_and_two_ranks_equal_one(tmp_path):
    run_look(0, 1, str(tmp_path / "one"))
    single = read_metrics(tmp_path / "one" / "metrics.jsonl")
    for row in single[:2]:
        assert row["rollout/turns_mean"] > 1.1 and row["rollout/observation_tokens_mean"] > 1
        assert row["rollout/tool_calls_mean"] > 0 and "timing_s/tools" in row
        assert row["training/rollout_probs_diff_max"] <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "one" / "samples" / "step_00000001.jsonl").open()]
    episode = next(r for r in records if r.get("turns_taken", 1) > 1)
    assert [m["role"] for m in episode["turns"][:2]] == ["assistant", "tool"]
    run_distributed(run_look, 2, str(tmp_path / "two"))
    double = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert abs(double[0]["actor/pg_loss"] - single[0]["actor/pg_loss"]) < 1e-5
    for key in ("critic/score/mean", "rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors",
                "rollout/observation_tokens_mean", "response_length/mean", "val/score"):
        assert [r.get(key) for r in double] == [r.get(key) for r in single], key


def test_look_episodes_train_lora_adapters_on_the_rollouts_tokens(tmp_path):
    """LoRA (the engine runs the same adapters) on multi-turn samples: the logprobs after observations agree too."""
    RLTrainer(load_config(LOOK + ["--trainer.output_dir", str(tmp_path), "--lora.rank", "8",
                                  "--trainer.eval_every", "0"])).fit()
    for row in read_metrics(tmp_path / "metrics.jsonl"):
        assert row["rollout/turns_mean"] > 1.1 and row["training/rollout_probs_diff_max"] <= 1e-5


def test_look_episodes_on_the_hybrid_family(tmp_path):
    """Qwen3.5 (Gated DeltaNet beside attention): a waiting episode keeps its recurrent state, and the trainer's
    logprobs after observations agree with the engine's."""
    RLTrainer(load_config(LOOK + ["--trainer.output_dir", str(tmp_path), "--model.tiny.family", "qwen3_5",
                                  "--trainer.eval_every", "0"])).fit()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert max(row["rollout/turns_mean"] for row in rows) > 1
    assert all(row["training/rollout_probs_diff_max"] <= 1e-5 for row in rows)
