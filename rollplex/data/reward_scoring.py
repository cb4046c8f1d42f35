"""Scoring batches of responses with a reward function, so that a failing call
costs only its samples (scored 0.0 and counted), not the run.

`RewardScorer` scores in this process (`score_all`: the built-in rewards, trusted
and fast), or in worker processes (rollplex.worker_processes) that score calls in
parallel, where the calls still running at a batch's time limit are killed and a
crash takes down only its worker; either way the worker is replaced (user
functions, by default). A per-sample function (rollplex, verl, EasyR1 sequential)
is called once per sample, so a failing call costs one; a batch function (EasyR1
batch, TRL) once per chunk of the batch, one chunk per worker.
"""

from __future__ import annotations

import functools
import json
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from rollplex.data.rewards import BATCH_KINDS, Reward, RewardSample, RewardTypeError, score_of
from rollplex.user_code import user_traceback
from rollplex.worker_processes import WorkerDied, WorkerPool, describe_error

if TYPE_CHECKING:
    from rollplex.models.inputs import EpisodeLog

# One sample's outcome: (score, components, error); a failed sample is (0.0, {}, its error).
Outcome = tuple[float, dict[str, float], str]


class CallOutcomes(NamedTuple):
    """One call's outcomes, one per sample it scored, and, when the call raised, its traceback from the
    reward function's frame on (text: it crosses the workers' pipe, and the run's error.log shows it)."""

    outcomes: list[Outcome]
    traceback: str = ""


def _outcome(result: Any, score_key: str) -> Outcome:
    try:
        score, components = score_of(result, score_key)
    except RewardTypeError:  # the function's mistake, not the sample's: it stops the run (RewardScorer.score)
        raise
    except Exception as e:  # noqa: BLE001 - a result may be anything; its sample pays
        return 0.0, {}, describe_error(e)
    return score, components, ""


def score_chunk(reward: Reward, samples: Sequence[RewardSample], score_key: str = "") -> CallOutcomes:
    """Call `reward` on `samples` (one sample, or a batched reward's chunk): a call that
    raises, or returns the wrong number of results, fails all of them; a result that is
    not a finite number (or a dict without its score) fails only its sample."""
    try:
        results = reward(samples)
    except Exception as e:  # noqa: BLE001 - a user function may raise anything; its samples pay
        return CallOutcomes([(0.0, {}, describe_error(e))] * len(samples), user_traceback(e))
    return CallOutcomes([_outcome(result, score_key) for result in results])


def chunks(size: int, batched: bool, parts: int) -> list[range]:
    """The calls that score a batch of `size`: one per sample, or for a batched reward
    `parts` contiguous chunks of about equal size (one call in this process, one per worker)."""
    if not batched:
        return [range(i, i + 1) for i in range(size)]
    step = max(1, -(-size // max(parts, 1)))
    return [range(i, min(i + step, size)) for i in range(0, size, step)]


@dataclass
class RewardScores:
    """A batch's rewards in input order. A sample that fails scores 0.0 and is counted
    once: in `errors` (it raised, returned no finite number, or its worker died) or in
    `timeouts` (it was not scored within the batch's time limit). `components` holds each
    sample's dict entries ({} for a number result or a failure)."""

    scores: list[float]
    errors: int = 0
    timeouts: int = 0
    components: list[dict[str, float]] = field(default_factory=list)
    first_error: str = ""  # the first failed sample's error ("" when none raised)
    first_traceback: str = ""  # its call's traceback, when the call raised ("" when none did)

    @classmethod
    def of(cls, outcomes: Sequence[Outcome | None], tracebacks: Sequence[str] = ()) -> RewardScores:
        """From each sample's outcome, None for one not scored within the time limit, and each sample's call's
        traceback (`tracebacks`, when known: `of_calls`)."""
        done = [o if o is not None else (0.0, {}, "") for o in outcomes]
        failed = [i for i, (_, _, error) in enumerate(done) if error]
        first = failed[0] if failed else None
        return cls([score for score, _, _ in done], errors=len(failed), timeouts=sum(o is None for o in outcomes),
                   components=[components for _, components, _ in done],
                   first_error=done[first][2] if first is not None else "",
                   first_traceback=tracebacks[first] if first is not None and tracebacks else "")

    @classmethod
    def of_calls(cls, calls: Sequence[range], results: Sequence[CallOutcomes | None]) -> RewardScores:
        """From each call's samples (`chunks`) and its outcomes, None for a call not done within the time limit."""
        outcomes: list[Outcome | None] = []
        tracebacks: list[str] = []
        for call, result in zip(calls, results):
            outcomes += result.outcomes if result is not None else [None] * len(call)
            tracebacks += [result.traceback if result is not None else ""] * len(call)
        return cls.of(outcomes, tracebacks)

    @property
    def failed(self) -> int:
        return self.errors + self.timeouts

    @classmethod
    def concat(cls, parts: Sequence[RewardScores]) -> RewardScores:
        """Batches scored apart, as one batch in their order."""
        first = next((p for p in parts if p.first_error), None)
        return cls([x for p in parts for x in p.scores], sum(p.errors for p in parts), sum(p.timeouts for p in parts),
                   [c for p in parts for c in p.components], first.first_error if first else "",
                   first.first_traceback if first else "")


def _warn_failures(name: str, result: RewardScores, timeout_s: float = 0.0) -> None:
    total = len(result.scores)
    if result.errors:
        warnings.warn(f"reward function {name} failed on {result.errors} of {total} responses (scored 0.0); "
                      f"first error: {result.first_error}", stacklevel=3)
    if result.timeouts:
        warnings.warn(f"reward function {name}: {result.timeouts} of {total} responses were not scored within "
                      f"{timeout_s:g} s (data.reward_timeout_s, shared by the calls that score a batch) and score "
                      f"0.0 (the calls still running were killed, their workers replaced); one slow, not hung, "
                      f"needs a higher data.reward_timeout_s or more data.reward_workers", stacklevel=3)


def score_all(reward: Reward, samples: Sequence[RewardSample], score_key: str = "") -> RewardScores:
    """Score `samples` in this process, one call per sample or, for a batched reward,
    one call for all; a failing call costs its samples (scored 0.0, counted in
    `errors`) and the others go on."""
    calls = chunks(len(samples), reward.batched, 1)
    return RewardScores.of_calls(calls, [score_chunk(reward, [samples[i] for i in call], score_key) for call in calls])


# ----------------------------------------------------------------------------- worker processes

# Beyond this magnitude a score warns (once per run, RewardScorer._bounded): no bounded reward gets near it, and
# with Dr.GRPO's unnormalised advantages the gradient norm grows with the reward (the tiny demo's is ~3x it): a
# reward of 1e19 overflows it in float32 there, sooner on a larger model, and each such step is skipped.
LARGE_REWARD = 1e6
USER_REWARD_WORKERS = 2  # worker processes for a user function when data.reward_workers is -1 (auto)


def _reward_worker(spec: str, kind: str, score_key: str, kwargs_json: str) -> tuple[Callable, str]:
    """A reward worker's setup (rollplex.worker_processes.serve): load the reward; its handler scores a
    chunk of samples, and the calling convention it found goes back to the trainer."""
    reward = Reward(spec, kind, json.loads(kwargs_json))
    return functools.partial(_score_in_worker, reward, score_key=score_key), reward.kind


def _score_in_worker(reward: Reward, samples: Sequence[RewardSample], score_key: str) -> CallOutcomes | RewardTypeError:
    """`score_chunk` in a worker process; a score of the wrong type comes back as its RewardTypeError, which
    the trainer raises (RewardScorer.score), where the worker would otherwise die of it."""
    try:
        return score_chunk(reward, samples, score_key)
    except RewardTypeError as mistake:
        return mistake


class _RewardWorkers(WorkerPool):
    """Worker processes that each load the reward `spec` (called as `kind`, a dict result's score
    its `score_key` entry, `kwargs_json` on every call), kept across batches. A batch's calls share
    one time limit, `timeout_s`: the calls still running then are killed with their workers, which
    are replaced, as is a worker that dies in a call; a replacement starts while the others go on
    scoring."""

    def __init__(self, spec: str, kind: str, score_key: str, kwargs_json: str, size: int, timeout_s: float):
        super().__init__("rollplex.data.reward_scoring:_reward_worker", (spec, kind, score_key, kwargs_json), size,
                         f"reward {spec!r}")
        self.timeout_s = timeout_s
        self.kind = self.info

    def score(self, tasks: Sequence[list[RewardSample]]) -> list[CallOutcomes | RewardTypeError | None]:
        """Each task's (a call's samples) outcomes, or None for a task not done within `timeout_s`
        of the first call. One deadline for all: a function that hangs costs the batch one time
        limit, where one per call would cost tasks x limit / workers."""
        self.check_open()
        todo = deque(range(len(tasks)))
        results: list[CallOutcomes | RewardTypeError | None] = [None] * len(tasks)
        deadline = math.inf  # set by the first call: waiting for workers to start does not use up the limit
        while (todo or self.busy()) and time.monotonic() < deadline:
            for worker in self.idle()[:len(todo)]:
                deadline = min(deadline, time.monotonic() + self.timeout_s)
                task = todo.popleft()
                worker.assign(task, tasks[task])
            for _, task, reply in self.receive(deadline):
                died = f"its worker process died ({reply.reason})" if isinstance(reply, WorkerDied) else ""
                results[task] = CallOutcomes([(0.0, {}, died)] * len(tasks[task])) if died else reply
        for worker in self.busy():  # their calls ran to the deadline: their samples score 0.0
            self.replace(worker)
        return results


class RewardScorer:
    """Scores batches with the reward `spec` (see `load_reward`), called as `kind` says
    (see `Reward`; "auto": from its parameter names), a dict result's score being its
    `score_key` entry (see `score_of`). In one of two ways:

    - `workers` = 0: in this process, one call after another (`score_all`). Fast, and
      right for the built-in rewards, but a call cannot be time-limited, and a hang or
      crash in it is the trainer's.
    - `workers` > 0: in that many worker processes, kept across batches, that each load
      the reward themselves and score calls in parallel. A batch's calls share one time
      limit, `timeout_s` from its first call: the samples not scored by then score 0.0
      and count as timeouts (the workers still in a call are killed and replaced), so a
      function that hangs costs a batch `timeout_s`, however many samples it has. A
      worker that dies in a call (a segfault, os.abort) costs that call's samples an
      error each, and is replaced.

    -1 = auto: in this process for a built-in reward, else `USER_REWARD_WORKERS`
    processes. Either way a call that raises or returns no finite number scores 0.0
    and counts as an error, and each batch warns once with its first error; a score
    that is not a number at all (a string) stops the run (`score`).
    `close()` stops the workers (so does interpreter exit).
    """

    def __init__(self, spec: str, workers: int = -1, timeout_s: float = 60.0, kind: str = "auto",
                 score_key: str = "", kwargs: dict[str, Any] | None = None, clip: float = 0.0):
        self.spec, self.timeout_s, self.score_key = spec, timeout_s, score_key
        self.clip = clip  # data.reward_clip: every score into [-clip, clip]; 0 = off
        self._warned_large = False  # a score beyond LARGE_REWARD warns once (a run's scorer: once per run)
        self.workers = (0 if ":" not in spec else USER_REWARD_WORKERS) if workers == -1 else workers
        self._reward = Reward(spec, kind, kwargs) if self.workers == 0 else None
        self._pool = _RewardWorkers(spec, kind, score_key, json.dumps(kwargs or {}), self.workers,
                                    timeout_s) if self.workers else None
        self.kind = self._reward.kind if self._reward else self._pool.kind  # the calling convention in use

    def score(self, responses: Sequence[str], answers: Sequence[str], response_ids: Sequence[list[int]] | None = None,
              columns: Sequence[dict[str, Any]] | None = None, warn: bool = True,
              episodes: Sequence[EpisodeLog | None] | None = None) -> RewardScores:
        """Score each response against its answer; `response_ids` (its tokens) and `columns`
        (its dataset row's, see `RewardSample`) are what the anchors' functions also read, and
        a multi-turn sample's `episodes` entry its trajectory and environment rewards.
        Warns once when some failed (with `warn`; else the caller does: `warn_failures`).

        A score of the wrong type (a string, a list: see `score_of`) raises RewardTypeError,
        naming the function: its mistake, not the sample's. With `clip`, every score comes
        back clipped into [-clip, clip], as it trains (`_bounded`)."""
        samples = _samples(responses, answers, response_ids, columns)
        for sample, episode in zip(samples, episodes or ()):
            if episode is not None:
                sample.messages, sample.env_rewards = episode.messages, episode.rewards
        try:
            scores = self._score(samples)
        except RewardTypeError as mistake:
            raise RewardTypeError(f"reward function {self.spec} {mistake}") from mistake
        if warn:
            self.warn_failures(scores)
        return self._bounded(scores)

    def _score(self, samples: list[RewardSample]) -> RewardScores:
        if self._pool is None:
            return score_all(self._reward, samples, self.score_key)
        calls = chunks(len(samples), self.kind in BATCH_KINDS, self.workers)
        results = self._pool.score([[samples[i] for i in chunk] for chunk in calls])
        if mistake := next((r for r in results if isinstance(r, RewardTypeError)), None):  # from _score_in_worker
            raise mistake
        return RewardScores.of_calls(calls, results)

    def _bounded(self, scores: RewardScores) -> RewardScores:
        """`scores` clipped into [-clip, clip] (clip 0: as they are). The first score that would train
        beyond LARGE_REWARD in magnitude warns, once for the scorer's life (a run's)."""
        largest = max(scores.scores, key=abs, default=0.0)
        if not self._warned_large and min(abs(largest), self.clip or math.inf) > LARGE_REWARD:
            self._warned_large = True
            warnings.warn(f"reward function {self.spec} returned {largest:.3g}: a reward beyond ±{LARGE_REWARD:g} "
                          f"swamps the advantages and can overflow the gradients, which skips optimizer steps "
                          f"(trainer.max_skipped_steps in a row stop the run). Clip the rewards with "
                          f"data.reward_clip (every reward into [-c, c]) or bound the function. "
                          f"This warning is given once per run", stacklevel=3)
        if self.clip:
            scores.scores = [min(max(score, -self.clip), self.clip) for score in scores.scores]
        return scores

    def warn_failures(self, scores: RewardScores) -> None:
        """One warning per kind of failure in `scores`, with the first error."""
        _warn_failures(self.spec, scores, self.timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _samples(responses: Sequence[str], answers: Sequence[str], response_ids: Sequence[list[int]] | None,
             columns: Sequence[dict[str, Any]] | None) -> list[RewardSample]:
    size = len(responses)
    for name, values in (("answers", answers), ("response_ids", response_ids), ("columns", columns)):
        if values is not None and len(values) != size:
            raise ValueError(f"{size} responses but {len(values)} {name}")
    return [RewardSample(response, answer, list(response_ids[i]) if response_ids is not None else [],
                         dict(columns[i]) if columns is not None else {})
            for i, (response, answer) in enumerate(zip(responses, answers))]
