"""The three schedules (serial without shared prompts, serial with them, overlap)
are one training algorithm: the same samples and the same parameters after 3
steps, on 1 process and on 2 (gloo); prompt work runs before the passes that
read it, and within its byte budget (the rest takes the serial path)."""

from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from rollplex.config import load_config
from rollplex.metrics import read_metrics
from rollplex.rl.loop import RLTrainer
from rollplex.rl.trainer import build_trainer

REWARD = Path(__file__).with_name("length_reward.py")
# kl_coef and recomputed old logprobs make every kind of prompt work run; a reward
# that varies within groups makes the policy gradient non-zero.
FAST = ["--trainer.total_steps", "3", "--data.batch_size", "4", "--rollout.n", "4", "--rollout.max_tokens", "4",
        "--data.val_size", "4", "--trainer.eval_every", "0", "--trainer.save_every", "0", "--logging.no_console",
        "--algorithm.kl_coef", "0.01", "--algorithm.recompute_old_logprobs", "true",
        "--data.reward", f"{REWARD}:reward", "--trainer.num_threads", "1"]
SCHEDULES = {"serial-naive": ["--schedule.share_prefix", "false"], "serial-prefix": [],
             "overlap": ["--schedule.kind", "overlap"]}


def train(out: Path, *extra: str) -> tuple[RLTrainer, dict[str, torch.Tensor]]:
    trainer = build_trainer(load_config(FAST + ["--trainer.output_dir", str(out), *extra]))
    trainer.fit()
    return trainer, {n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                     for n, p in trainer.model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def check_same_training(runs: dict[str, tuple[dict, list]]) -> None:
    """Overlap only moves serial-prefix's prompt work into the decode window: the
    parameters are bitwise equal. Serial-naive sums the same gradients in
    another order (per-sample sequences): the same samples at every step, and
    parameters within 2e-5 after 3 AdamW steps at lr 1e-4, because AdamW
    normalises each gradient element and an element whose gradient is at
    rounding level can move by up to lr either way (the gradients themselves
    agree to 1e-5 relative: tests/test_shared_prefix.py)."""
    naive_params, naive_rows = runs["serial-naive"]
    for name, (params, rows) in runs.items():
        assert [r["critic/score/mean"] for r in rows] == [r["critic/score/mean"] for r in naive_rows], name
        assert max_difference(params, naive_params) <= 2e-5, name
    assert max_difference(runs["overlap"][0], runs["serial-prefix"][0]) == 0.0


def test_schedules_train_the_same_on_one_process(tmp_path):
    runs = {}
    for name, extra in SCHEDULES.items():
        trainer, params = train(tmp_path / name, *extra)
        runs[name] = params, read_metrics(tmp_path / name / "metrics.jsonl")
    check_same_training(runs)
    assert "timing_s/prefix_hidden" not in runs["serial-naive"][1][0]
    # The rewards vary within the batch, so advantages and the policy gradient are not all zero.
    assert all(r["critic/score/max"] > r["critic/score/min"] for r in runs["overlap"][1])
    overlap = runs["overlap"][1][0]
    assert overlap["timing_s/prefix_hidden"] > 0 and overlap["prefix/deferred_items"] == 0
    assert overlap["timing_s/prefix_hidden"] + overlap["timing_s/prefix_exposed"] > 0


def test_schedules_train_the_same_with_video_and_a_frozen_tower(tmp_path):
    """Video prompts, frozen vision tower: every prompt forward reads the vision
    features encoded once before rollout instead of running the tower."""
    video = ["--data.task", "direction", "--parallel.freeze_vision", "true", "--trainer.total_steps", "2"]
    trainer = RLTrainer(load_config(FAST + video + ["--trainer.output_dir", str(tmp_path / "items")]))
    prompts = [e.prompt for e in next(trainer._batches(0))]
    items = trainer.prompt_planner.work(prompts, [trainer.encode(p) for p in prompts])
    assert {i.kind for i in items} == {"ref", "actor", "old"} and all(i.vision is not None for i in items)
    runs = {}
    for name, extra in SCHEDULES.items():
        _, params = train(tmp_path / name, *video, *extra)
        runs[name] = params, read_metrics(tmp_path / name / "metrics.jsonl")
    check_same_training(runs)


def schedules_on_two_ranks(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    for name, extra in SCHEDULES.items():
        _, params = train(Path(out) / name, *extra)
        if rank == 0:
            torch.save(params, Path(out) / f"{name}.pt")


def test_schedules_train_the_same_on_two_ranks(tmp_path):
    run_distributed(schedules_on_two_ranks, 2, str(tmp_path))
    check_same_training({name: (torch.load(tmp_path / f"{name}.pt"), read_metrics(tmp_path / name / "metrics.jsonl"))
                         for name in SCHEDULES})


def test_budget_defers_work_to_the_serial_path(tmp_path):
    """A budget that holds the reference model's kept prompts but not the actor's
    graph: the actor's prompt work is deferred, the parameters do not change."""
    _, unlimited = train(tmp_path / "unlimited", "--schedule.kind", "overlap")
    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path / "sizes")]))
    prompts = [e.prompt for e in next(trainer._batches(0))]
    items = trainer.prompt_planner.work(prompts, [None] * len(prompts))
    budget = sum(i.estimate for i in items if i.kind != "actor")
    assert budget < sum(i.estimate for i in items)
    _, limited = train(tmp_path / "limited", "--schedule.kind", "overlap", "--schedule.prefix_memory_budget",
                       str(budget + 2))
    rows = read_metrics(tmp_path / "limited" / "metrics.jsonl")
    assert all(r["prefix/deferred_items"] == 1 and r["prefix/planned_bytes"] <= budget + 2 for r in rows)
    assert max_difference(limited, unlimited) <= 2e-5  # the deferred actor work runs the packed shared-prefix pass


def test_suffix_passes_never_run_before_their_prompt_work(tmp_path, monkeypatch):
    from rollplex.train.actor import Actor

    trainer = RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--schedule.kind", "overlap"]))
    schedulers, suffix_passes = [], []
    rollout, suffix_pass = trainer.rollout, Actor._pass

    def recording_rollout(*args, **kwargs):
        result = rollout(*args, **kwargs)
        schedulers.append(result.prompt_work)
        return result

    def checked_pass(self, model, units, kept, with_entropy, **routes):
        if kept is not None:
            assert not schedulers[-1].queue, "a suffix pass ran while prompt work was still queued"
            assert any(item.result is kept for item in schedulers[-1].admitted)
            suffix_passes.append(kept)
        return suffix_pass(self, model, units, kept, with_entropy, **routes)

    trainer.rollout = recording_rollout
    monkeypatch.setattr(Actor, "_pass", checked_pass)
    trainer.fit()
    assert len(suffix_passes) >= 3 * 3  # per step: old and ref logprobs, the first update's micro-batch(es)


def disagg_on_two_ranks(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    _, params = train(Path(out), "--schedule.kind", "disagg", "--schedule.rollout_ranks", "1",
                      "--schedule.share_prefix", "false", "--trainer.eval_every", "3")
    if rank == 0:
        torch.save(params, Path(out) / "params.pt")


def test_disagg_equals_serial_on_one_process(tmp_path):
    """1 rollout rank + 1 training rank, weights broadcast after each update: the
    same samples, parameters and greedy score as serial on one process."""
    _, serial = train(tmp_path / "serial", "--schedule.share_prefix", "false", "--trainer.eval_every", "3")
    run_distributed(disagg_on_two_ranks, 2, str(tmp_path / "disagg"))
    assert max_difference(torch.load(tmp_path / "disagg" / "params.pt"), serial) == 0.0
    serial_rows = read_metrics(tmp_path / "serial" / "metrics.jsonl")
    disagg_rows = read_metrics(tmp_path / "disagg" / "metrics.jsonl")
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "val/score"):
        assert [r.get(key) for r in disagg_rows] == [r.get(key) for r in serial_rows], key
    assert all(r["timing_s/rollout_idle"] >= 0 and r["timing_s/train_idle"] > 0 for r in disagg_rows)


def test_a_trainer_refuses_a_schedule_of_the_other_kind(tmp_path):
    """disagg has its own trainer, which build_trainer picks; the colocated one, given a
    disagg config, stops before anything starts, and says where to go."""
    from rollplex.rl.disagg import DisaggTrainer

    disagg = ["--schedule.kind", "disagg", "--schedule.rollout_ranks", "1"]
    with pytest.raises(ValueError, match=r"schedule disagg runs on another trainer than RLTrainer: .*build_trainer"):
        RLTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), *disagg]))
    with pytest.raises(ValueError, match="schedule overlap runs on another trainer than DisaggTrainer"):
        DisaggTrainer(load_config(FAST + ["--trainer.output_dir", str(tmp_path), "--schedule.kind", "overlap"]))
    assert not (tmp_path / "checkpoints").exists()


def test_prompt_work_that_runs_out_of_memory_takes_the_serial_path(tmp_path, monkeypatch):
    """Prompt work that needs more memory than estimated is dropped mid-forward and
    its passes run the serial path: the run goes on, the parameters do not change."""
    from rollplex.rl.prompt_work import PromptWork

    _, unlimited = train(tmp_path / "unlimited", "--schedule.kind", "overlap")
    advance = PromptWork.advance

    def out_of_memory_in_the_actors_second_slice(self):
        if self.kind == "actor" and self._slices is not None:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return advance(self)

    monkeypatch.setattr(PromptWork, "advance", out_of_memory_in_the_actors_second_slice)
    _, dropped = train(tmp_path / "dropped", "--schedule.kind", "overlap")
    rows = read_metrics(tmp_path / "dropped" / "metrics.jsonl")
    assert all(r["prefix/dropped_for_memory"] == 1 and r["prefix/deferred_items"] == 1 for r in rows)
    assert max_difference(dropped, unlimited) <= 2e-5


def test_schedules_train_the_same_on_multi_turn_episodes(tmp_path):
    """The look task with room for observations (tests/test_agent_loop.py): episodes whose responses hold tool
    answers, pictures among them, train alike under every schedule; overlap still equals serial-prefix bitwise (it
    moves the initial prompts' work only: the observations are the responses', in the suffix passes)."""
    look = ["--data.task", "look", "--rollout.max_tokens", "40", "--trainer.total_steps", "2"]
    runs = {}
    for name, extra in SCHEDULES.items():
        _, params = train(tmp_path / name, *look, *extra)
        runs[name] = params, read_metrics(tmp_path / name / "metrics.jsonl")
    check_same_training(runs)
    assert all(r["rollout/turns_mean"] > 1.1 for r in runs["overlap"][1])
