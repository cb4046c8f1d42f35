"""A step's metrics: the rollout's and the update's, reduced over the dp ranks;
each phase's time and peak memory, beside the memory plan's; throughput.

Every dp rank calls these functions in the same order: each reduction is a
collective over the trainers' dp group.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch.profiler import record_function

from rollplex.data.reward_scoring import RewardScores
from rollplex.dist import all_gather_objects, all_reduce_values
from rollplex.metrics import Timer
from rollplex.rl.memory import GiB, PHASE_MARK, CpuPhasePeaks, MemoryPlan, live_tensor_bytes, loop_phase_bytes
from rollplex.rl.prompt_work import PromptWorkScheduler
from rollplex.rl.rollout import Rollout
from rollplex.rl.step import StepState
from rollplex.train.flops import peak_flops
from rollplex.user_code import carry_user_traceback

# Actor metrics that are global already (see Actor.update); the others are this rank's share of a global sum,
# or, ending in _max, this rank's maximum.
GLOBAL_ACTOR_METRICS = ("actor/grad_norm", "actor/lr", "actor/skipped_steps_total", "training/nonfinite_logprobs")
COUNTED_ACTOR_METRICS = ("training/nonfinite_logprobs",)  # summed over the step's updates, not averaged


def combine_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """The step's actor metrics from those of its optimizer steps: each averaged over the steps that report it
    (rollout_probs_diff: the first only), counts summed, running totals (_total) the last step's."""
    reported = Counter(key for metrics in updates for key in metrics)
    combined: dict[str, float] = {}
    for metrics in updates:
        for key, value in metrics.items():
            combined[key] = combined.get(key, 0.0) + (value if key in COUNTED_ACTOR_METRICS else value / reported[key])
    combined.update({key: value for key, value in updates[-1].items() if key.endswith("_total")})
    return combined


def gather_metrics(state: StepState, actor: dict[str, float], skipped_total: float,
                   group: dist.ProcessGroup | None) -> dict[str, float]:
    """The step's sample metrics (`sample_metrics`) and actor metrics over every dp rank of `group`;
    `skipped_total`: the training rows found unusable since the process started."""
    metrics = {**sample_metrics(state, group), "data/skipped_total": skipped_total}
    shares = sorted(k for k in actor if k not in GLOBAL_ACTOR_METRICS and not k.endswith("_max"))
    metrics.update(zip(shares, all_reduce_values([actor[k] for k in shares], group=group)))
    maxima = sorted(k for k in actor if k.endswith("_max"))
    metrics.update(zip(maxima, all_reduce_values([actor[k] for k in maxima], dist.ReduceOp.MAX, group)))
    metrics.update({k: actor[k] for k in GLOBAL_ACTOR_METRICS})
    metrics.update(reward_component_means(state.rewards.components, group))
    return metrics


def sample_metrics(state: StepState, group: dist.ProcessGroup | None) -> dict[str, float]:
    """The step's samples over every dp rank of `group`: reward/errors and reward/timeouts (sums), and
    verl's data metrics under its names: critic/score/* and critic/rewards/* (the rewards the advantages
    were computed from, `state.rewards`: the scorer's, clipped by data.reward_clip; the two differ in
    verl only by a KL penalty in the reward, which rollplex puts in the loss instead),
    critic/advantages/* (the mean over the response tokens the policy sampled, as verl's over its
    response_mask, which leaves a multi-turn sample's tool tokens out), prompt_length/* and
    response_length/* (tokens; a prompt's image and video tokens count, and so do a multi-turn
    response's observations, as verl's attention mask counts them), response_length/clip_ratio,
    and, where the prompts come from files, training/epoch (the pass over the training rows that
    the batch's first row comes from, 0 first). A mean is a sum over the ranks over a count over
    them; a max or min is over every rank's samples."""
    rollout, rewards, advantages = state.rollout, state.rewards, state.advantages
    response_lengths = [len(r) for g in rollout.groups for r in g.responses]
    sampled_lengths = [s.sampled_tokens for g in rollout.groups for s in g.samples]
    # Per sample, as verl's batch holds a prompt once per response (a group's samples are all on this rank).
    prompt_lengths = [len(g.prompt.input_ids) for g in rollout.groups for _ in g.samples]
    sums = dict(zip(("errors", "timeouts", "samples", "score", "advantage_x_tokens", "sampled_tokens",
                     "response_tokens", "prompt_tokens", "clipped"), all_reduce_values([
        rewards.errors, rewards.timeouts, len(rewards.scores), sum(rewards.scores),
        sum(a * n for a, n in zip(advantages, sampled_lengths)), sum(sampled_lengths), sum(response_lengths),
        sum(prompt_lengths), sum(reason == "length" for reason in rollout.finish_reasons)], group=group)))
    samples = sums["samples"]
    metrics = {"reward/errors": sums["errors"], "reward/timeouts": sums["timeouts"],
               "critic/score/mean": sums["score"] / samples,
               "critic/advantages/mean": sums["advantage_x_tokens"] / sums["sampled_tokens"],
               "prompt_length/mean": sums["prompt_tokens"] / samples,
               "response_length/mean": sums["response_tokens"] / samples,
               "response_length/clip_ratio": sums["clipped"] / samples}
    ranges = {"critic/score": rewards.scores, "critic/advantages": advantages,
              "prompt_length": prompt_lengths, "response_length": response_lengths}
    # One MAX reduction: each name's max, its min as the max of the negatives, and the earliest epoch likewise.
    extremes = [value for values in ranges.values() for value in (max(values), -min(values))]
    epochs = [e.epoch for e in rollout.examples]
    has_epochs = epochs[0] is not None  # the same on every rank: the prompts come from files (rollplex.data)
    reduced = all_reduce_values(extremes + ([-min(epochs)] if has_epochs else []), dist.ReduceOp.MAX, group)
    for i, name in enumerate(ranges):
        metrics[f"{name}/max"], metrics[f"{name}/min"] = reduced[2 * i], -reduced[2 * i + 1]
    if has_epochs:
        metrics["training/epoch"] = int(-reduced[-1])
    # verl's name for the rewards the advantages came from, which verl users plot: the scores themselves here.
    metrics.update({f"critic/rewards/{stat}": metrics[f"critic/score/{stat}"] for stat in ("mean", "max", "min")})
    return metrics


def summed_over_ranks(metrics: dict[str, float], prefix: str, group: dist.ProcessGroup | None) -> dict[str, float]:
    """`metrics`, those whose names start with `prefix` summed over the dp ranks of `group` (counts each
    rank took of its own)."""
    names = sorted(k for k in metrics if k.startswith(prefix))
    return metrics | dict(zip(names, all_reduce_values([metrics[k] for k in names], group=group)))


def reward_component_means(components: list[dict[str, float]], group: dist.ProcessGroup | None) -> dict[str, float]:
    """reward/<name>/mean of each entry of a reward's dict results (EasyR1's format and
    accuracy, ...), over the samples of every dp rank that have it (ranks may see different entries)."""
    totals, counts = Counter(), Counter()  # Counter.update adds (and keeps zero and negative sums, unlike +)
    for sample in components:
        totals.update(sample)
        counts.update(sample.keys())
    every = all_gather_objects((dict(totals), dict(counts)), group)
    totals, counts = Counter(), Counter()
    for rank_totals, rank_counts in every:
        totals.update(rank_totals)
        counts.update(rank_counts)
    return {f"reward/{name}/mean": totals[name] / counts[name] for name in sorted(counts)}


class RewardsFailed(RuntimeError):
    """Every response of a step failed its reward: the run would learn nothing."""


def stop_if_every_reward_failed(rewards: RewardScores, name: str, group: dist.ProcessGroup | None) -> None:
    """Raise RewardsFailed, naming the function and this rank's first error, when every
    sample of the step on every dp rank of `group` failed (raised, returned no score,
    timed out). Some failing is left to the scorer's warning and reward/errors."""
    failed, total = all_reduce_values([rewards.failed, len(rewards.scores)], group=group)
    if total and failed == total:
        advice = (f"first error: {rewards.first_error}. Check its signature (data.reward_kind) and what it returns "
                  f"(data.reward_score_key)" if rewards.first_error else
                  "none was scored within data.reward_timeout_s. A function that hangs needs a fix; a slow one, "
                  "a higher data.reward_timeout_s or more data.reward_workers")
        error = RewardsFailed(f"reward function {name} failed on all {int(total)} responses of the step; {advice}")
        raise carry_user_traceback(error, f"The traceback of reward function {name}'s first failed call:",
                                   rewards.first_traceback)


def prompt_work_metrics(prefix: PromptWorkScheduler) -> dict[str, float]:
    """How the step's prompt work ran: hidden in the decode window or exposed, deferred, dropped."""
    return {**prefix.timing.as_metrics(), "prefix/deferred_items": len(prefix.deferred),
            "prefix/dropped_for_memory": prefix.dropped_for_memory, "prefix/planned_bytes": prefix.planned_bytes}


def speed_metrics(rollout: Rollout, seconds: float, actor_flops: float, update_seconds: float, world: int,
                  device: torch.device, group: dist.ProcessGroup | None) -> dict[str, float]:
    """The step's time, its tokens per second per rank, and on CUDA the update's model FLOPs
    utilisation (its FLOPs over its time, per GPU: rollplex/train/flops.py)."""
    tokens = all_reduce_values([rollout.tokens], group=group)[0]
    metrics = {"timing_s/step": seconds, "perf/throughput": tokens / seconds / world}
    if device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(device))
        if peak:
            metrics["perf/mfu/actor"] = actor_flops / (update_seconds * peak * world)
    return metrics


def memory_metrics(peaks: dict[str, int], plan: MemoryPlan | None) -> dict[str, float]:
    """Each phase's measured peak, its planned peak (`plan`: colocated schedules) and the plan's error."""
    metrics = {f"perf/max_memory_allocated_gb/{phase}": b / GiB for phase, b in peaks.items()}
    if peaks:
        metrics["perf/max_memory_allocated_gb"] = max(peaks.values()) / GiB
    if plan is None:
        return metrics
    planned = loop_phase_bytes(plan)
    metrics.update({f"perf/planned_memory_gb/{phase}": b / GiB for phase, b in planned.items()})
    for phase in planned.keys() & peaks.keys():
        metrics[f"perf/memory_plan_error/{phase}"] = peaks[phase] / planned[phase] - 1
    return metrics


class PhaseMeter:
    """Each phase's time and peak allocated bytes: the CUDA allocator's, or on CPU,
    where `measure_cpu` asks for it (trainer.device_memory), the live tensor bytes
    (CpuPhasePeaks, which reads the profiler ranges `phase` marks)."""

    def __init__(self, device: torch.device, measure_cpu: bool):
        self.device = device
        self.cpu_peaks = CpuPhasePeaks() if measure_cpu else None
        self.cuda_peaks: dict[str, int] = {}

    @contextmanager
    def step(self) -> Iterator[dict[str, int]]:
        """Yields a dict that holds each phase's peak bytes once the step is done."""
        if self.cpu_peaks is not None:
            with self.cpu_peaks.step() as peaks:
                yield peaks
        else:
            self.cuda_peaks = {}
            yield self.cuda_peaks

    @contextmanager
    def phase(self, timer: Timer, name: str) -> Iterator[None]:
        """Time a phase and mark it for its peak memory."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        with timer(name), record_function(PHASE_MARK + name):
            yield
        if cuda:
            self.cuda_peaks[name] = torch.cuda.max_memory_allocated(self.device)

    def live_bytes(self) -> int:
        """Tensor bytes this rank holds between steps, the step's temporaries freed: what a
        leak grows. On CPU it is counted from the tensors Python references (about 0.3 s,
        so only on the steps that save a checkpoint)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return live_tensor_bytes()
