"""One step's state on this rank, filled phase by phase.

The phases of `RLTrainer.train_step` (rollout, prompt work, rewards, advantages,
old and reference logprobs, update) each fill what the state still lacks. A
schedule that streams finished groups (rollplex.rl.schedules.overlap_stream)
fills some of it early, group by group in the decode window; the phase after
decode then does the rest, through the same functions. So streaming is "a
phase ran early for some groups", not a different step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollplex.config import Config
from rollplex.data.reward_scoring import RewardScorer, RewardScores
from rollplex.models.inputs import Group
from rollplex.rl.prompt_work import PromptWorkScheduler
from rollplex.rl.rollout import Rollout
from rollplex.rl.schedules.prompt_items import PromptKind
from rollplex.train.actor import PolicyUpdate
from rollplex.train.kept_prefix import KeptPrefix


@dataclass
class StreamReport:
    """The finished groups' work of a step: in the decode window (schedule.stream_groups), and after it."""

    hidden: float = 0.0  # seconds of it in the decode window: scoring, and the passes (on CUDA the side
    # stream's time for them, from events)
    exposed: float = 0.0  # seconds of the same kinds of work after it (the schedule's report sets it)
    # Host seconds the decode loop spent in the window's group work: added to the prompt work's in
    # timing_s/decode_slowdown.
    decode_delay: float = 0.0
    # What the window did: groups scored, and passes run per kind (ref, old, update: one per group)
    done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("scored", "ref", "old", "update"), 0))
    # Host-side timeline (time.perf_counter), as PromptWorkScheduler.spans: each piece of work as (kind, start, end).
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        return {"timing_s/stream_hidden": self.hidden, "timing_s/stream_exposed": self.exposed,
                **{f"stream/{kind}_groups": float(count) for kind, count in self.done.items()}}


@dataclass
class StepState:
    """What one step has computed so far on this rank; group indices are this rank's."""

    step: int
    examples: list  # this rank's prompts (rollplex.data Example), one group each
    rollout: Rollout | None = None  # the engine's samples
    prompt_work: PromptWorkScheduler | None = None  # the kept prompt state (schedules that share prompt work)
    texts: dict[int, list[str]] = field(default_factory=dict)  # responses decoded early, by group
    scores: dict[int, RewardScores] = field(default_factory=dict)  # rewards scored early, by group
    rewards: RewardScores | None = None  # every sample's, in group order
    advantages: list[float] | None = None  # every sample's
    old: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # recomputed old logprobs, by group
    ref: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # reference logprobs, by group
    update: PolicyUpdate | None = None  # the first optimizer step, started on the groups that finished first
    stream: StreamReport | None = None  # what the decode window did with finished groups (overlap-stream)
    first_update_s: float = 0.0  # the first optimizer step's seconds (finished-group work after decode)
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout's and the schedule's

    def kept(self, kinds: tuple[PromptKind, ...], chunk: int) -> KeptPrefix | None:
        """Chunk `chunk`'s kept prompt state from the first of `kinds` whose item ran (None: none did)."""
        if self.prompt_work is None:
            return None
        return next((k for k in (self.prompt_work.result(kind, chunk) for kind in kinds) if k is not None), None)

    def per_sample(self, by_group: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        """Per-group logprobs (old or reference) as one list in sample order."""
        return [lp for g in range(len(self.rollout.groups)) for lp in by_group[g]]


def norm_by_std(cfg: Config) -> bool:
    """Whether advantages are divided by the group's standard deviation (GRPO) or only centred (Dr.GRPO)."""
    return cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std


def score_groups(scorer: RewardScorer, examples: list, groups: list[Group], texts: list[str],
                 warn: bool = True) -> RewardScores:
    """The rewards of every sample of `groups` (one example each; `texts`: the samples' decoded
    responses), in group order."""
    per_sample = [e for e, g in zip(examples, groups) for _ in g.samples]
    samples = [s for g in groups for s in g.samples]
    return scorer.score(texts, [e.answer for e in per_sample], [s.token_ids for s in samples],
                        [e.columns for e in per_sample], warn=warn, episodes=[s.episode for s in samples])
