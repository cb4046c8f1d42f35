"""Stateful environments, as TRL's `environment_factory` and verl's interaction: a class whose instance
plays one episode.

    class Guess:
        def reset(self, *, target: int) -> None:         # the row's interaction_kwargs, as keywords
            self.target = target

        def step(self, action: str):                     # the model's turn, as text
            done = action.strip() == str(self.target)
            return ("Right." if done else "Wrong."), float(done), done   # observation, reward, done

An observation is anything a tool may return (text, images or both: rollplex.agent.tools.tool_result).
The episode's first turn answers the row's prompt, which was rendered before the episode started:
what `reset` returns (TRL's text to add to the prompt) is not shown, and anything but None warns,
once per process; such text belongs in the dataset's prompt.

`EnvironmentRunner` plays many episodes at once, one instance per episode key, with the tools'
isolation and deadline (rollplex.agent.workers): each instance lives in one worker process for
its whole episode (its reset and steps go to that worker, in order), and a reset or step past
`timeout_s` kills its worker, which is replaced. The episodes that lived there are lost with it:
a step that ran too long fails as a `timeout`, and every later step of those episodes as `died`.
A reset that raised fails each step of its episode. With `workers=0` the instances live in this
process, without a deadline.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollplex.agent.tools import ToolResult, tool_result
from rollplex.agent.workers import AsyncRunner, ToolFailure, guarded_call
from rollplex.data.rewards import load_user_object
from rollplex.worker_processes import WorkerProcess


@dataclass
class StepResult:
    """What an environment's step answered: an observation, a reward and whether the episode is over."""

    observation: ToolResult
    reward: float = 0.0
    done: bool = False


def load_environment(spec: str) -> type:
    """The environment class `spec` names (`path/to/file.py:Class` or `package.module:Class`, loaded
    as data.reward's functions are). It must have `reset` and `step`, and be made with no arguments
    (an instance per episode, as TRL's environment_factory())."""
    environment = load_user_object(spec, "environment", named="class")
    if not isinstance(environment, type):
        raise TypeError(f"environment {spec!r} is a {type(environment).__name__}, not a class")
    if lacking := [name for name in ("reset", "step") if not callable(getattr(environment, name, None))]:
        raise TypeError(f"environment {spec!r}: class {environment.__name__} has no {' or '.join(lacking)}; an "
                        f"environment has reset(**row_kwargs) -> str | None and "
                        f"step(action) -> (observation, reward, done)")
    required = [p.name for p in inspect.signature(environment).parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise TypeError(f"environment {spec!r}: {environment.__name__}() needs {', '.join(required)}; an environment "
                        f"is made with no arguments, and its reset(**row_kwargs) takes the row's")
    return environment


def _step_result(value: Any) -> StepResult:
    """A step's (observation, reward, done), checked: a reward is a finite number, done a bool."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"step returned a {type(value).__name__}; it returns (observation, reward, done)")
    observation, reward, done = value
    if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise TypeError(f"step returned the reward {reward!r}; a reward is a finite number")
    if not isinstance(done, (bool, np.bool_)):
        raise TypeError(f"step returned done = {done!r}; done is a bool")
    return StepResult(tool_result(observation), float(reward), bool(done))


class _Episodes:
    """The environment instances in one process, by episode key: the handler of a worker (or of
    this process) that starts, steps and ends them. A start answers nothing (None): a reset that
    failed answers each of its episode's steps instead."""

    def __init__(self, spec: str):
        self.environment = load_environment(spec)
        self.instances: dict[Any, Any] = {}
        self.failed_resets: dict[Any, ToolFailure] = {}
        self.warned_reset_text = False

    def __call__(self, request: tuple[str, Any, Any]) -> StepResult | ToolFailure | None:
        op, key, payload = request
        if op == "start":
            failure = guarded_call(lambda: self._reset(key, payload), self._unshown)
            if failure is not None:
                self.instances.pop(key, None)
                self.failed_resets[key] = ToolFailure(failure.kind, f"its environment's reset: {failure.message}")
            return None
        if op == "step":
            if key in self.failed_resets:
                return self.failed_resets[key]
            if key not in self.instances:
                return ToolFailure("bad_call", f"episode {key!r} has no environment: it did not start")
            return guarded_call(lambda: self.instances[key].step(payload), _step_result)
        self.instances.pop(key, None)  # "end"
        self.failed_resets.pop(key, None)
        return None

    def _reset(self, key: Any, row_kwargs: dict[str, Any]) -> Any:
        self.instances[key] = self.environment()
        return self.instances[key].reset(**row_kwargs)

    def _unshown(self, returned: Any) -> None:
        """What reset returned, which no prompt shows (the module's docstring): a warning, once."""
        if returned is not None and not self.warned_reset_text:
            self.warned_reset_text = True
            warnings.warn(f"{self.environment.__name__}.reset returned {type(returned).__name__} {returned!r:.80}, "
                          f"which is not shown: the model's first turn answers the row's prompt; put that text in "
                          f"the dataset's prompt (this warning is given once per process)", stacklevel=2)


def _environment_worker(spec: str) -> tuple[Callable[[Any], Any], None]:
    """An environment worker's setup: load the class; its handler plays the episodes sent to it."""
    return _Episodes(spec), None


class EnvironmentRunner(AsyncRunner):
    """Plays episodes of the environment `spec` (`load_environment`), one instance per episode key,
    each in one of `workers` worker processes (0: in this process, no deadline), with a deadline of
    `timeout_s` per reset or step (see the module's docstring). `start`, `step` and `end` return at
    once; the answers come from `poll`."""

    def __init__(self, spec: str, workers: int = 1, timeout_s: float = 60.0):
        super().__init__(_environment_worker, (spec,), workers, timeout_s, f"environment {spec!r}")
        self._homes: dict[Any, WorkerProcess | None] = {}  # each episode's worker (None: this process)
        self._lost: dict[Any, str] = {}  # episodes whose worker was killed or died: why

    def start(self, key: Any, row_kwargs: Mapping[str, Any] | None = None) -> None:
        """Start episode `key`: a new instance's `reset(**row_kwargs)` (verl's interaction_kwargs).
        Nothing comes back from `poll` for it; a reset that failed fails the episode's steps."""
        if key in self._homes or key in self._lost:
            raise ValueError(f"episode {key!r} has already started")
        self._homes[key] = self._emptiest_worker()
        self._send(key, ("start", key, dict(row_kwargs or {})), self._homes[key], reported=False)

    def step(self, key: Any, action: str) -> None:
        """Play the model's turn `action` in episode `key`; its StepResult or ToolFailure comes from `poll`."""
        if key in self._lost:
            self._done.append((key, ToolFailure("died", self._lost[key])))
            return
        if key not in self._homes:
            raise KeyError(f"episode {key!r} has not started (or has ended)")
        self._send(key, ("step", key, action), self._homes[key])

    def end(self, key: Any) -> None:
        """Episode `key` is over: its instance is dropped (a step still running finishes first)."""
        if key in self._lost:
            del self._lost[key]
        elif key in self._homes:
            self._send(key, ("end", key, None), self._homes.pop(key), reported=False)

    def poll(self, wait: bool = False) -> list[tuple[Any, StepResult | ToolFailure]]:
        """Every step answered since the last poll, as (key, StepResult or ToolFailure); with
        `wait`, block until at least one is, if any is pending."""
        return super().poll(wait)

    def _emptiest_worker(self) -> WorkerProcess | None:
        if self._pool is None:
            return None
        homes = list(self._homes.values())
        return min(self._pool.workers, key=lambda worker: sum(home is worker for home in homes))

    def _worker_lost(self, worker: WorkerProcess, failure: ToolFailure) -> None:
        for key in [key for key, home in self._homes.items() if home is worker]:
            del self._homes[key]
            self._lost[key] = f"the episode's environment was lost with its worker process ({failure.message})"

    def __enter__(self) -> EnvironmentRunner:
        return self
