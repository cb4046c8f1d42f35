"""The RL loop end to end on the tiny default: metrics, multi-rank, weight sharing, resume."""

import json

import pytest

from distributed import run_distributed
from rollplex.config import ConfigError, load_config
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer

FAST = ["--trainer.total_steps", "2", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
        "--data.val_size", "4", "--trainer.eval_every", "2", "--trainer.save_every", "0", "--logging.no_console"]
NAMES = ["critic/score/mean", "response_length/mean", "response_length/clip_ratio", "timing_s/step", "timing_s/gen",
         "timing_s/reward", "timing_s/update_actor", "timing_s/update_weights", "perf/throughput", "actor/pg_loss",
         "actor/entropy", "actor/grad_norm", "actor/lr", "training/rollout_probs_diff_mean",
         "training/rollout_probs_diff_max", "weights/bytes_shared", "reward/errors", "data/skipped_total",
         "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/max", "prompt_length/mean",
         "prompt_length/max", "response_length/max", "response_length/min"]


def run(out, *extra):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(out), *extra]))
    trainer.fit()
    return trainer, read_metrics(out / "metrics.jsonl")


def test_default_config_runs_and_logs_verl_names(tmp_path):
    trainer, rows = run(tmp_path)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    for name in NAMES:
        assert name in rows[0], name
    assert "val/score" in rows[-1]
    assert "training/epoch" not in rows[0]  # the built-in task is endless: it has no passes to count
    total = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert rows[0]["weights/bytes_shared"] == total  # the engine ran on the trainer's own weights
    # One KV pool for the run, kept between rollouts (the decode graphs read it by address): the memory plan
    # logged beside the run holds it in every phase.
    assert trainer.engine.cache.nbytes == trainer.engine.cache.pool_bytes() > 0
    for phase in ("gen", "update_actor"):
        assert rows[0][f"perf/planned_memory_gb/{phase}"] * 2**30 >= trainer.engine.cache.pool_bytes()


def test_engine_sees_updated_weights(tmp_path):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--trainer.lr", "0.05"]))
    examples = next(trainer._batches(0))
    before = trainer.rollout(examples, step=1)
    trainer.train_step(examples)
    after = trainer.rollout(examples, step=1)  # same seeds: any change comes from the weights
    assert before.rollout.texts != after.rollout.texts


def distributed_run(rank, world, out, *extra):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", out, "--trainer.num_threads", "1", *extra]))
    trainer.fit()


@pytest.mark.parametrize("engine_tp, schedule", [(1, "serial"), (2, "serial"), (2, "overlap")])
def test_two_ranks_equal_one(tmp_path, engine_tp, schedule):
    """dp_shard=2 with the engine on each rank's gathered weights (engine_tp 1), or
    one engine over both ranks on views of them (engine_tp 2, rollout.tp > parallel.tp;
    with overlap, each rank's prompt work runs between the shared engine's steps):
    the same samples as one process, and step 1's loss."""
    _, single = run(tmp_path / "one")
    run_distributed(distributed_run, 2, str(tmp_path / "two"), "--rollout.tp", str(engine_tp),
                    "--schedule.kind", schedule)
    double = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert abs(double[0]["actor/pg_loss"] - single[0]["actor/pg_loss"]) < 1e-5
    for key in ("critic/score/mean", "critic/score/min", "critic/advantages/mean", "critic/advantages/max",
                "prompt_length/mean", "prompt_length/max", "response_length/mean", "response_length/min", "val/score"):
        assert [r.get(key) for r in double] == [r.get(key) for r in single], key  # combined over the ranks
    if engine_tp == 2:
        assert double[0]["weights/bytes_viewed"] > 0 and double[0]["weights/bytes_rebuilt"] == 0


def test_resume_continues_from_the_checkpoint(tmp_path):
    run(tmp_path, "--trainer.save_every", "1")
    trainer, rows = run(tmp_path, "--trainer.save_every", "1", "--trainer.total_steps", "3")
    assert trainer.step == 3
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]


def test_prompts_are_balanced_across_ranks_by_tokens():
    from types import SimpleNamespace

    from rollplex.rl.loop import balanced_share

    lengths = [100, 10, 90, 10, 80, 10]  # rank::2 would give 270 tokens to one rank, 30 to the other
    examples = [SimpleNamespace(prompt=SimpleNamespace(input_ids=[0] * n)) for n in lengths]
    shares = [balanced_share(examples, 2, r) for r in range(2)]
    assert sorted(id(e) for s in shares for e in s) == sorted(id(e) for e in examples)
    assert [len(s) for s in shares] == [3, 3]
    tokens = [sum(len(e.prompt.input_ids) for e in s) for s in shares]
    assert max(tokens) - min(tokens) <= 80, tokens  # {100, 10, 10} vs {90, 80, 10}


def test_a_rollout_rebuilt_from_its_groups_samples_is_the_same():
    """A disagg rollout rank sends each group's samples; the trainers rebuild the
    rollout from them (Rollout.of), logprobs bitwise."""
    import torch

    from rollplex.data.datasets import Example
    from rollplex.models.inputs import Group, Prompt, Sample
    from rollplex.rl.rollout import Rollout

    class Digits:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    examples = [Example(Prompt(torch.arange(n)), "a", i) for i, n in enumerate((3, 5))]
    samples = [[Sample([5, 6], [-0.1, -0.2], "stop"), Sample([7], [-0.3], "length")],
               [Sample([8, 9, 10], [-0.4, -0.5, -1 / 3], "stop")]]
    rollout = Rollout.of(examples, [Group(e.prompt, s) for e, s in zip(examples, samples)], Digits())
    assert rollout.texts == ["5 6", "7", "8 9 10"] and rollout.finish_reasons == ["stop", "length", "stop"]
    assert rollout.responses_of(slice(1, 2)) == slice(2, 3) and rollout.responses_of(slice(0, 2)) == slice(0, 3)
    assert rollout.tokens == (2 * 3 + 3) + (5 + 3)  # each sample's prompt and response
    sent = {e.index: g.samples for e, g in zip(rollout.examples, rollout.groups)}  # what a rollout rank sends
    again = Rollout.of(examples, [Group(e.prompt, sent[e.index]) for e in examples], Digits())
    assert [g.responses for g in again.groups] == [g.responses for g in rollout.groups] == [[[5, 6], [7]], [[8, 9, 10]]]
    assert again.texts == rollout.texts and again.finish_reasons == rollout.finish_reasons
    assert all(torch.equal(a, b) for a, b in zip(again.logprobs, rollout.logprobs, strict=True))


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, capsys):
    """A run killed mid-way (SIGKILL, as a crash would) continues from its latest complete checkpoint."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, str(root / "train.py"), *FAST, "--trainer.output_dir", str(tmp_path),
           "--trainer.total_steps", "50", "--trainer.save_every", "1", "--trainer.eval_every", "0"]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (tmp_path / "checkpoints" / "step_00000002" / "COMPLETE.json").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    import re

    trainer, rows = run(tmp_path, "--trainer.total_steps", "4", "--trainer.save_every", "1")
    resumed = re.search(r"resumed from .*step_(\d+) at step (\d+)", capsys.readouterr().out)
    assert resumed and int(resumed.group(2)) >= 2  # not from scratch
    assert trainer.step == 4 and rows[-1]["step"] == 4


def test_tiny_model_shape_comes_from_the_config(tmp_path):
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path),
                                            "--model.tiny.vision_intermediate_size", "48"]))
    assert trainer.model.args.vision.intermediate_size == 48
    assert trainer.model.visual.blocks[0].mlp.gate_proj.weight.shape[0] == 48


def test_the_engine_holds_the_longest_prompt_the_data_admits_with_its_whole_response(tmp_path):
    """The engine's length limit is the run's: data.max_prompt_length (files) plus rollout.max_tokens, so any
    prompt the data admits decodes its whole response (a fixed 8192 once refused longer video prompts outright,
    and cut the responses of those near it); past the model's positions the run stops before any work."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"problem": f"what is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    files = ["--data.train_files", str(data), "--data.max_prompt_length", "1000"]
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path / "run"), *files]))
    assert trainer.engine.max_model_len == 1000 + trainer.cfg.rollout.max_tokens
    positions = trainer.model.args.text.max_position_embeddings
    with pytest.raises(ConfigError, match=rf"data.max_prompt_length.*rollout.max_tokens 4 is {positions + 4} tokens, "
                                          rf"over the model's max_position_embeddings {positions}"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path / "too_long"), *files[:2],
                                      "--data.max_prompt_length", str(positions)]))


def test_a_tensor_parallel_size_that_does_not_split_the_model_stops_before_the_weights_load(tmp_path,
                                                                                          monkeypatch):
    """The model family's check_tp, on rollout.tp (the engine's split), before any weights load."""
    monkeypatch.setattr(RLTrainer, "_load_models", lambda *a: pytest.fail("the weights were loaded"))
    with pytest.raises(ConfigError, match=r"rollout.tp 3: tensor parallel size 3 does not divide the model's "
                                          r"num_attention_heads \(4\)"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--rollout.tp", "3"]))
