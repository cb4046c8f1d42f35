"""overlap: the prompt work in the rollout's decode window.

The prompt work is response-independent, and decode is memory-bound: the
items run in slices between the engine's decode steps (rollplex.rl.prompt_work), on
a low-priority side stream on CUDA, more slices per step as the decode batch
empties in the long tail. What the window does not finish runs after the last
decode step, while the weights are still in their rollout layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollplex.engine import Request
from rollplex.rl.schedules.base import DecodeWindow, PromptWorkSchedule
from rollplex.rl.step import StepState

if TYPE_CHECKING:
    from rollplex.rl.loop import RLTrainer


class Overlap(PromptWorkSchedule):
    name = "overlap"
    memory_layout = "overlap"

    def before_decode(self, trainer: RLTrainer, state: StepState) -> tuple[list[Request], DecodeWindow | None]:
        requests, _ = super().before_decode(trainer, state)
        return requests, DecodeWindow(state.prompt_work.between_steps)

    def after_decode(self, trainer: RLTrainer, state: StepState) -> None:
        state.prompt_work.drain()  # what the decode window did not hide, while the weights are still gathered
