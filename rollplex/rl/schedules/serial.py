"""The serial schedules: generate, then the training passes.

serial-naive (schedule.share_prefix false) is the plain colocated trainer:
every training pass recomputes the vision tower and the whole sequence, per
sample. serial-prefix computes the prompt work once per prompt, as overlap
does, but as a phase of its own after the rollout instead of in its decode
window: the same items and results, none of them hidden.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollplex.rl.schedules.base import PromptWorkSchedule, Schedule
from rollplex.rl.step import StepState

if TYPE_CHECKING:
    from rollplex.rl.loop import RLTrainer


class SerialNaive(Schedule):
    name = "serial-naive"
    memory_layout = "serial-naive"


class SerialPrefix(PromptWorkSchedule):
    name = "serial-prefix"
    memory_layout = "serial-prefix"
    prompt_work_phase = True

    def after_rollout(self, trainer: RLTrainer, state: StepState) -> None:
        """The prompt work, on the weights the rollout read (its items are the rollout's prompt forwards),
        routing an MoE model's prompts as algorithm.routing_replay says (the rollout's routes are known now)."""
        replay, groups = trainer.cfg.algorithm.routing_replay, state.rollout.groups
        state.prompt_work.replay_routes(groups, replay)
        with trainer.weights.for_rollout():
            state.prompt_work.drain()
        state.prompt_work.record_routes(groups, replay)
