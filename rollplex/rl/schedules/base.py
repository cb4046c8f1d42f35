"""What a schedule is: the hooks the trainer calls around a step's decode.

A schedule decides where a step's prompt work runs relative to the engine's
decode; the samples, the updates and the phases after rollout are the same
under every schedule (tests/test_schedules.py holds them equal). Its hooks:

    before_decode  the engine's requests, and what runs in the decode window
                   (a `DecodeWindow`: between decode steps, and as each group
                   finishes), or None
    after_decode   still inside the rollout (the weights in their rollout layout)
    after_rollout  a phase of its own after the rollout (serial-prefix's prompt work)
    report         the schedule's metrics, at the step's end

`PromptWorkSchedule` is the base of the schedules that share the prompt work
across a prompt's samples: it encodes each prompt's vision once, plans the
prompt-work items (declared in rollplex.rl.schedules.prompt_items, which the
memory plan counts) and reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

from rollplex.config import Config
from rollplex.engine import Request
from rollplex.models.inputs import Group
from rollplex.rl.rollout import Rollout
from rollplex.rl.step import StepState, StreamReport
from rollplex.rl.step_metrics import prompt_work_metrics, summed_over_ranks

if TYPE_CHECKING:  # the hooks' argument; the trainer imports the schedules
    from rollplex.rl.loop import RLTrainer


@dataclass
class DecodeWindow:
    """What runs inside the engine's decode loop (rollplex.engine.Engine.generate)."""

    between_steps: Callable[[int], None]  # after each decode step, with the rows still running
    on_finished: Callable[[int, Group], None] | None = None  # as a group's last sample finishes


class Schedule:
    """Serial generation with no prompt work: every training pass recomputes the
    whole sequence, vision tower included (the plain colocated baseline's hooks)."""

    name: ClassVar[str]  # what schedule.kind (and its options) select, as reports and the bench name it
    memory_layout: ClassVar[str]  # the memory plan's name for its phases (rollplex.rl.memory.SCHEDULES)
    separate_ranks: ClassVar[bool] = False  # rollout and training on different ranks (its own trainer)
    prompt_work_phase: ClassVar[bool] = False  # after_rollout runs: the loop times it as the "prefix" phase

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def rollout(self, trainer: RLTrainer, state: StepState) -> None:
        """The gen phase: before decode, the engine's decode with this schedule's window, after decode."""
        runner = trainer.rollout_runner
        with runner.session():
            requests, window = self.before_decode(trainer, state)
            groups = runner.generate(requests, between_steps=window.between_steps if window else None,
                                     on_finished=window.on_finished if window else None, examples=state.examples)
            self.after_decode(trainer, state)
        state.rollout = Rollout.of(state.examples, groups, trainer.tokenizer, state.texts)

    def before_decode(self, trainer: RLTrainer, state: StepState) -> tuple[list[Request], DecodeWindow | None]:
        return trainer.rollout_runner.requests(state.examples, state.step, [None] * len(state.examples)), None

    def after_decode(self, trainer: RLTrainer, state: StepState) -> None:
        pass

    def after_rollout(self, trainer: RLTrainer, state: StepState) -> None:
        pass

    def report(self, trainer: RLTrainer, state: StepState, metrics: dict[str, float]) -> None:
        pass


class PromptWorkSchedule(Schedule):
    """The prompt work once per prompt: vision encoded before rollout (the engine's
    prefill reads it), the declared items planned beside the KV pool."""

    def before_decode(self, trainer: RLTrainer, state: StepState) -> tuple[list[Request], DecodeWindow | None]:
        prompts = [e.prompt for e in state.examples]
        vision = [trainer.encode(p) for p in prompts]
        requests = trainer.rollout_runner.requests(state.examples, state.step, vision)
        work = trainer.prompt_planner.work(prompts, vision)
        state.prompt_work = trainer.prompt_planner.scheduler(work, trainer.engine.cache.pool_bytes())
        return requests, None

    def report(self, trainer: RLTrainer, state: StepState, metrics: dict[str, float]) -> None:
        """The prompt work's metrics, and the finished groups' work left after decode: what
        streaming them (schedule.stream_groups) hides, or could."""
        metrics.update(prompt_work_metrics(state.prompt_work))
        report = state.stream or StreamReport()
        metrics["timing_s/decode_slowdown"] += report.decode_delay  # the decode window's host time: both parts
        report.exposed = sum(metrics.get(f"timing_s/{p}", 0.0) for p in ("reward", "old_log_prob", "ref")) + \
            state.first_update_s
        metrics.update(summed_over_ranks(report.as_metrics(), "stream/", trainer.dp_group))
