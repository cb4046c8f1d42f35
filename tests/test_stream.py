"""Streaming finished groups (schedule.stream_groups): a group's reward, reference
and old logprobs and first-update passes run in the decode tail as soon as all its
samples have finished, and train as serial-prefix does.

The order differs from serial-prefix's: the streamed groups' micro-batches come
first, in the order the groups finished, each a micro-batch of its own, with the
loss summed unnormalised and the gradients divided by the global normaliser once
at the end; then the other groups' micro-batches in batch order. So the samples
are the same at every step, the first step's gradients agree to rounding
(1e-6 relative), and the parameters after 3 AdamW steps to 2e-5 (AdamW
normalises each gradient element: one at rounding level can move by up to lr,
as tests/test_schedules.py says of serial-naive)."""

import time
from pathlib import Path

import pytest
import torch

from distributed import run_distributed
from rollplex.metrics import read_metrics
from rollplex.rl.schedules.overlap_stream import GroupStream, SideStreamBacklog, StreamPlan
from rollplex.rl.step import StepState
from rollplex.train.actor import Actor
from test_prefix_sync import HostSyncGuard
from test_schedules import FAST, max_difference, train

# Each prompt draws its own response limit (1..16 tokens), so groups finish at different decode steps.
UNEVEN = ["--rollout.min_tokens", "1", "--rollout.max_tokens", "16"]
STREAM = ["--schedule.kind", "overlap", "--schedule.stream_groups", "true"]


def record_gradients(monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Every optimizer step's gradients, by parameter, as the step sees them."""
    seen = []
    clip_and_step = Actor._clip_and_step

    def recording(self, skip):
        # Copies: the step clips the gradients in place (full_tensor on a mesh of one is no copy).
        seen.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in self.model.named_parameters() if p.grad is not None})
        return clip_and_step(self, skip)

    monkeypatch.setattr(Actor, "_clip_and_step", recording)
    return seen


def check_same_training(out: Path, prefix: dict, streamed: dict, name: str = "stream",
                        reference_name: str = "prefix") -> list[dict]:
    """Same samples at every step as <out>/<reference_name>, parameters within 2e-5; returns run `name`'s metrics."""
    rows, reference = read_metrics(out / name / "metrics.jsonl"), read_metrics(out / reference_name / "metrics.jsonl")
    for key in ("critic/score/mean", "response_length/mean"):
        assert [r[key] for r in rows] == [r[key] for r in reference], key
    assert max_difference(streamed, prefix) <= 2e-5
    return rows


def test_streamed_groups_train_like_serial_prefix(tmp_path, monkeypatch):
    gradients = record_gradients(monkeypatch)
    _, prefix = train(tmp_path / "prefix", *UNEVEN)
    first_prefix = gradients[0]
    gradients.clear()
    _, streamed = train(tmp_path / "stream", *UNEVEN, *STREAM)
    first_stream = gradients[0]
    assert first_stream.keys() == first_prefix.keys()
    largest = max(g.abs().max().item() for g in first_prefix.values())
    assert max_difference(first_stream, first_prefix) <= 1e-6 * largest
    rows = check_same_training(tmp_path, prefix, streamed)
    # Every kind of work ran in the window at some step; the finished groups' work left after it is measured.
    for kind in ("scored", "ref", "old", "update"):
        assert sum(r[f"stream/{kind}_groups"] for r in rows) > 0, kind
    assert all(r["timing_s/stream_hidden"] > 0 and r["timing_s/stream_exposed"] > 0 for r in rows)


def test_a_collective_in_a_streamed_pass_stops_the_run_on_one_process(tmp_path, monkeypatch):
    """Each dp rank streams its groups in its own order, so a collective in a streamed pass
    (here, a reduction added to the update's metrics) would hang a multi-rank run. On CPU
    the window's passes run under no_collectives: one process names it and stops."""
    from rollplex.dist import CollectiveInLocalWork, all_reduce_values
    from rollplex.train.actor import PolicyUpdate

    add = PolicyUpdate.add

    def add_with_a_reduction(self, units, batch, weight):
        all_reduce_values([weight])
        return add(self, units, batch, weight)

    monkeypatch.setattr(PolicyUpdate, "add", add_with_a_reduction)
    with pytest.raises(CollectiveInLocalWork, match=r"decode window's update pass of group \d+"):
        train(tmp_path, *UNEVEN, *STREAM, "--algorithm.kl_coef", "0", "--algorithm.recompute_old_logprobs", "false")


NO_KL = ["--algorithm.kl_coef", "0"]
TWO_RANK_RUNS = {"prefix": NO_KL, "stream": NO_KL + STREAM, "stream-engine-tp": NO_KL + STREAM + ["--rollout.tp", "2"],
                 "prefix-kl": [], "stream-kl": STREAM}


def streamed_on_two_ranks(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    for name, extra in TWO_RANK_RUNS.items():
        _, params = train(Path(out) / name, *UNEVEN, *extra)
        if rank == 0:
            torch.save(params, Path(out) / f"{name}.pt")


def test_streamed_groups_train_like_serial_prefix_on_two_ranks(tmp_path):
    """Each rank streams its own groups, FSDP holding the gradients until the prompt's backward.
    stream-engine-tp: one engine over both ranks (rollout.tp 2), which reports every rank's
    groups: each rank streams its own. stream-kl: the reference model, sharded over the 2
    dp ranks, is held gathered through the decode window (StreamPlan.gather_ref), so its
    passes stream too, and the update, whose loss reads them."""
    run_distributed(streamed_on_two_ranks, 2, str(tmp_path))
    for name, reference in (("stream", "prefix"), ("stream-engine-tp", "prefix"), ("stream-kl", "prefix-kl")):
        rows = check_same_training(tmp_path, torch.load(tmp_path / f"{reference}.pt"),
                                   torch.load(tmp_path / f"{name}.pt"), name, reference)
        assert sum(r["stream/update_groups"] for r in rows) > 0, name
        if name == "stream":
            # A rank's last group ends its decode and is scored after it: of its 2 groups, at most 1 in the
            # window. The counts are summed over the ranks, so they reach 2.
            assert max(r["stream/scored_groups"] for r in rows) == 2
        streamed_ref = sum(r["stream/ref_groups"] for r in rows)
        assert streamed_ref > 0 if name == "stream-kl" else streamed_ref == 0, name


@pytest.mark.parametrize("reward_workers", ["0", "1"])
def test_no_work_runs_before_its_group_has_finished(tmp_path, monkeypatch, reward_workers):
    """A group is reported once its longest sample is done (a sample of L tokens needs
    the prefill and L - 1 decode steps), and its passes run only after that, and after
    its scores are in: scored inline (an in-process reward) or by a worker process
    that a thread waits for, the decode loop going on meanwhile."""
    from rollplex.engine import Engine

    reported, passes = {}, []
    generate, run = Engine.generate, GroupStream._run

    def recording_generate(self, requests, params=None, between_steps=None, on_finished=None):
        def heard(index, group):
            reported[index] = (self.stats["steps"], max(len(s.token_ids) for s in group.samples))
            on_finished(index, group)
        return generate(self, requests, params, between_steps, heard if on_finished else None)

    def recording_run(self, kind, g):
        assert g in reported, f"a {kind} pass ran on group {g} before it finished"
        assert g in self.state.scores, f"a {kind} pass ran on group {g} before its scores were in"
        passes.append(kind)
        run(self, kind, g)

    monkeypatch.setattr(Engine, "generate", recording_generate)
    monkeypatch.setattr(GroupStream, "_run", recording_run)
    train(tmp_path, *UNEVEN, *STREAM, "--trainer.total_steps", "1", "--data.reward_workers", reward_workers)
    assert reported and all(step >= longest for step, longest in reported.values())
    assert {"ref", "old", "update"} <= set(passes)


def test_streamed_passes_never_make_the_host_wait(tmp_path, monkeypatch):
    """A streamed pass runs between two decode steps: a host wait in it (a device value
    read back, a blocking copy to the device) would hold the next step back. Each pass
    only launches device work and copies its inputs over without blocking; the host-side
    work (the group's advantages) is done when its scores arrive (HostSyncGuard: on CPU
    it records what would wait on a GPU)."""
    found, run = {}, GroupStream._run

    def guarded(self, kind, g):
        with HostSyncGuard(copies=True) as guard:
            run(self, kind, g)
        found.setdefault(kind, []).extend(guard.calls)

    monkeypatch.setattr(GroupStream, "_run", guarded)
    train(tmp_path, *UNEVEN, *STREAM, "--trainer.total_steps", "1")
    assert found == {"ref": [], "old": [], "update": []}


def test_the_reference_model_is_held_gathered_only_within_the_budget():
    """With dp_shard > 1 the reference passes stream only if holding the model gathered
    fits the prefix budget the prompt items left; the update then needs room beside it."""
    from types import SimpleNamespace

    from rollplex.config import load_config
    from rollplex.rl.schedules.prompt_items import PromptKind

    cfg = load_config(FAST + STREAM)  # kl_coef 0.01: the update reads the reference logprobs

    def plan(dp_shard: int, budget_left: int | None) -> StreamPlan:
        prefix = SimpleNamespace(budget_left=budget_left, admitted=[SimpleNamespace(kind=PromptKind.ACTOR)])
        return StreamPlan.of(cfg, dp_shard, prefix, update_bytes=10, gathered_ref_bytes=100)

    assert plan(2, None) == plan(2, 110) == StreamPlan(ref=True, old=True, update=True, gather_ref=True)
    assert plan(2, 105) == StreamPlan(ref=True, old=True, update=False, gather_ref=True)
    assert plan(2, 99) == StreamPlan(ref=False, old=True, update=False, gather_ref=False)
    assert plan(1, 10) == StreamPlan(ref=True, old=True, update=True, gather_ref=False)  # not sharded: nothing to hold


@pytest.mark.parametrize("room", ["none", "enough"])
def test_streamed_update_only_within_the_memory_budget(tmp_path, room):
    """The update streams only when its gradients and a micro-batch fit the budget the
    prompt items leave (MemoryPlan.streamed_update_bytes); else it runs after decode."""
    from rollplex.config import load_config
    from rollplex.rl.loop import RLTrainer

    trainer = RLTrainer(load_config(FAST + UNEVEN + ["--trainer.output_dir", str(tmp_path / "sizes")]))
    prompts = [e.prompt for e in next(trainer._batches(0))]
    items = sum(i.estimate for i in trainer.prompt_planner.work(prompts, [None] * len(prompts)))
    update = trainer.memory.streamed_update_bytes()
    budget = items + (update if room == "enough" else update // 2)
    train(tmp_path / room, *UNEVEN, *STREAM, "--schedule.prefix_memory_budget", str(budget))
    rows = read_metrics(tmp_path / room / "metrics.jsonl")
    assert all(r["prefix/deferred_items"] == 0 for r in rows)
    streamed = sum(r["stream/update_groups"] for r in rows)
    assert streamed > 0 if room == "enough" else streamed == 0


@pytest.mark.parametrize("lost", ["deferred", "dropped"])
def test_logprob_passes_stream_only_over_their_kept_prompt(tmp_path, monkeypatch, lost):
    """Where a chunk's prompt item was not kept - deferred by the budget (here chunk 1's
    reference and old items) or dropped for memory (here every reference item) - a pass in
    the window would have to be a full pass, reading values back and copying to the device
    blocking between two decode steps, outside the budget. So those groups' passes run after
    decode, and so does the update of a group whose reference logprobs did not stream; the
    training is serial-prefix's all the same."""
    from rollplex.config import load_config
    from rollplex.rl.loop import RLTrainer
    from rollplex.rl.prompt_work import PromptWork

    few = [*UNEVEN, "--trainer.total_steps", "2"]
    _, prefix = train(tmp_path / "prefix", *few)
    if lost == "deferred":
        trainer = RLTrainer(load_config(FAST + few + ["--trainer.output_dir", str(tmp_path / "sizes")]))
        prompts = [e.prompt for e in next(trainer._batches(0))]
        chunk_0 = sum(i.estimate for i in trainer.prompt_planner.work(prompts, [None] * len(prompts)) if i.chunk == 0)
        budget, missing = ["--schedule.prefix_memory_budget", str(chunk_0)], {("ref", 1), ("old", 1)}
    else:
        advance = PromptWork.advance

        def out_of_memory_in_the_references_second_slice(self):
            if self.kind == "ref" and self._slices is not None:
                raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
            return advance(self)

        monkeypatch.setattr(PromptWork, "advance", out_of_memory_in_the_references_second_slice)
        budget, missing = [], {("ref", 0), ("ref", 1)}
    passes, run = [], GroupStream._run  # (kind, chunk, the host syncs it made)

    def guarded(self, kind, g):
        with HostSyncGuard(copies=True) as guard:
            run(self, kind, g)
        passes.append((kind, self._chunk(g), guard.calls))

    monkeypatch.setattr(GroupStream, "_run", guarded)
    _, streamed = train(tmp_path / "stream", *few, *STREAM, *budget)
    rows = check_same_training(tmp_path, prefix, streamed)
    assert all(r["prefix/deferred_items"] == 2 for r in rows)
    streamed_passes = {(kind, chunk) for kind, chunk, _ in passes}
    assert streamed_passes and not streamed_passes & missing
    assert all(calls == [] for _, _, calls in passes)
    if lost == "dropped":
        assert all(r["stream/ref_groups"] == r["stream/update_groups"] == 0 for r in rows)
        assert ("old", 0) in streamed_passes and ("old", 1) in streamed_passes
    else:
        assert {("ref", 0), ("old", 0)} <= streamed_passes


class StandInEvent:
    """What the backlog reads of a CUDA event recorded after a pass: `query()`, whether
    the side stream has got past it (it does not block)."""

    def __init__(self):
        self.finished = False

    def query(self) -> bool:
        return self.finished


def test_the_side_stream_backlog_has_room_while_few_passes_are_unfinished():
    backlog = SideStreamBacklog(limit=2)
    first, second = StandInEvent(), StandInEvent()
    assert backlog.has_room()
    backlog.issued(first)
    assert backlog.has_room()
    backlog.issued(second)
    assert not backlog.has_room()
    second.finished = True
    assert backlog.has_room()
    backlog.issued(StandInEvent())
    assert not backlog.has_room()


def test_streamed_passes_wait_for_the_side_stream_to_get_through_its_backlog(monkeypatch):
    """On CUDA a pass only issues its work on the side stream; between two decode steps the
    stream issues passes while fewer than the backlog's limit of them are unfinished, so the
    decode steps never compete with a long queue of them. Here the side stream is slower
    than decode: no pass it was given finishes until the test says so."""
    from types import SimpleNamespace

    from rollplex.config import load_config

    kept_everywhere = SimpleNamespace(side_stream=None, result=lambda kind, chunk: "kept prompt")
    state = StepState(step=1, examples=[None] * 4, prompt_work=kept_everywhere)
    stream = GroupStream(load_config(FAST + STREAM), state, tokenizer=None, scorer=SimpleNamespace(workers=0),
                         actor=None, ref_model=None, plan=StreamPlan(ref=True, old=False, update=False))
    stream._passes = [("ref", g) for g in range(4)]  # 4 scored groups' reference passes, all ready
    issued = []

    def issue(self, kind, g):
        issued.append(StandInEvent())
        return issued[-1]

    monkeypatch.setattr(GroupStream, "_issue", issue)
    stream.between_steps(running=0)  # an empty decode batch: room for 8 passes, but the backlog holds 2
    assert len(issued) == stream.backlog.limit == 2
    stream.between_steps(running=0)
    assert len(issued) == 2
    issued[0].finished = True
    stream.between_steps(running=0)
    assert len(issued) == 3
    assert stream.report.done["ref"] == 3


def test_the_decode_slowdown_counts_the_finished_groups_work(tmp_path, monkeypatch):
    """timing_s/decode_slowdown is the host time the decode loop spent between its steps:
    in the prompt work's slices and in the finished groups' work, here an in-process
    reward that takes 50 ms a group, scored in the window."""
    score = GroupStream._score

    def slow_score(self, g):
        time.sleep(0.05)
        return score(self, g)

    monkeypatch.setattr(GroupStream, "_score", slow_score)
    train(tmp_path, *UNEVEN, *STREAM, "--trainer.total_steps", "2", "--data.reward_workers", "0")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["stream/scored_groups"] > 0 for r in rows)
    assert all(r["timing_s/decode_slowdown"] >= 0.05 * r["stream/scored_groups"] for r in rows)
