"""The trainer computes the policy the engine sampled from: the same logprobs at the
rollout's temperature, and their difference measured on the weights that sampled."""

import torch

from rollplex.config import load_config
from rollplex.metrics import read_metrics
from rollplex.models.packing import pack_groups
from rollplex.rl.loop import RLTrainer

FAST = ["--trainer.total_steps", "1", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
        "--trainer.eval_every", "0", "--trainer.save_every", "0", "--logging.no_console"]


def logprobs_from_logits(model, groups, temperature: float) -> torch.Tensor:
    """log_softmax(logits / temperature) at every response token, flat in group order, from the
    model's logits of one forward per sample (prompt and response: no prompt sharing, no kept prefix)."""
    batch = pack_groups(model.args, groups, share_prefix=False)
    logits = model.logits(model.forward_packed(batch.packed)[batch.target_index])
    return (logits.double() / temperature).log_softmax(-1).gather(1, batch.target_ids[:, None])[:, 0]


@torch.no_grad()
def test_engine_and_trainer_logprobs_are_the_log_softmax_of_logits_over_the_temperature(tmp_path):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--rollout.temperature", "0.7"]))
    rollout = trainer.rollout(next(trainer._batches(0)), step=1).rollout
    engine = torch.cat(rollout.logprobs)
    actor = torch.cat(trainer.actor.logprobs(trainer.model, rollout.groups))  # the old, reference and update passes'
    direct = logprobs_from_logits(trainer.model, rollout.groups, 0.7)
    torch.testing.assert_close(engine.double(), direct, rtol=0, atol=1e-5)
    torch.testing.assert_close(actor.double(), direct, rtol=0, atol=1e-5)
    # The temperature shows: the untempered logprobs of the same tokens are far from these.
    untempered = logprobs_from_logits(trainer.model, rollout.groups, 1.0)
    assert (untempered - direct).abs().max() > 0.05


def test_rollout_probs_diff_is_measured_on_the_weights_that_sampled(tmp_path):
    # Two optimizer steps per batch: the second mini-batch runs after a step, on weights that
    # no longer sampled it (there, the difference is the policy's drift: ~0.08 at this lr).
    RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--algorithm.updates_per_batch", "2",
                                  "--trainer.lr", "1e-4"])).fit()
    [row] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "actor/pg_loss" in r]
    # float32 engine and trainer on the CPU: the same probabilities up to rounding.
    assert row["training/rollout_probs_diff_max"] < 1e-5
    assert row["training/rollout_probs_diff_mean"] < 1e-6
