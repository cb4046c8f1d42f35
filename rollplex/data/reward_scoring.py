"""Scoring batches of responses with a reward function, so that a failing call
costs only its samples (scored 0.0 and counted), not the run.

`RewardScorer` scores in this process (`score_all`: the built-in rewards, trusted
and fast), or in worker processes that score calls in parallel, where the calls
still running at a batch's time limit are killed and a crash takes down only its
worker; either way the worker is replaced (user functions, by default). A
per-sample function (rollplex, verl, EasyR1 sequential) is called once per
sample, so a failing call costs one; a batch function (EasyR1 batch, TRL) once
per chunk of the batch, one chunk per worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any, NamedTuple

from rollplex.data.rewards import BATCH_KINDS, Reward, RewardSample, RewardTypeError, score_of
from rollplex.user_code import carry_user_traceback, last_user_frame, user_traceback

# One sample's outcome: (score, components, error); a failed sample is (0.0, {}, its error).
Outcome = tuple[float, dict[str, float], str]


def _describe(error: BaseException) -> str:
    """The error's one line, with where the user's code raised it ("... (reward.py:3 in reward)")."""
    where = last_user_frame(error)
    return f"{type(error).__name__}: {error}" + (f" ({where})" if where else "")


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
        return 0.0, {}, _describe(e)
    return score, components, ""


def score_chunk(reward: Reward, samples: Sequence[RewardSample], score_key: str = "") -> CallOutcomes:
    """Call `reward` on `samples` (one sample, or a batched reward's chunk): a call that
    raises, or returns the wrong number of results, fails all of them; a result that is
    not a finite number (or a dict without its score) fails only its sample."""
    try:
        results = reward(samples)
    except Exception as e:  # noqa: BLE001 - a user function may raise anything; its samples pay
        return CallOutcomes([(0.0, {}, _describe(e))] * len(samples), user_traceback(e))
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
_START_TIMEOUT_S = 300.0  # a worker's interpreter start and reward import (which may load a model)
_STOP_GRACE_S = 1.0  # an idle worker exits on its own once its pipe closes
_MAX_WAIT_S = 3600.0  # poll() rejects timeouts past ~24 days: a longer limit is waited out hour by hour


def _die_with(trainer_pid: int) -> None:
    """Linux: the kernel kills this worker when the trainer dies, even by SIGKILL while a
    call hangs here (an idle worker would see its pipe close, a hung one would not)."""
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: no prctl
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != trainer_pid:  # it died before that took effect
        os._exit(1)


def _serve(fd: int, spec: str, kind: str, score_key: str, kwargs_json: str, trainer_pid: int) -> None:
    """A worker process: load the reward, say so (("", "", its kind), or (the load error, its
    traceback, "")), then score chunks of samples until the trainer closes the pipe."""
    _die_with(trainer_pid)
    # Ctrl-C and SIGTERM are the trainer's to handle (SLURM and Ctrl-C signal every process): it closes our pipe,
    # after the step it finishes on SIGTERM, which its rewards still score here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    with contextlib.suppress(EOFError, ConnectionError):  # the trainer closed the pipe: we are done
        try:
            reward = Reward(spec, kind, json.loads(kwargs_json))
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            conn.send((_describe(e), "".join(traceback.format_exception(e)), ""))
            return
        conn.send(("", "", reward.kind))
        while True:
            conn.send(_score_in_worker(reward, conn.recv(), score_key))


def _score_in_worker(reward: Reward, samples: Sequence[RewardSample], score_key: str) -> CallOutcomes | RewardTypeError:
    """`score_chunk` in a worker process; a score of the wrong type comes back as its RewardTypeError, which
    the trainer raises (RewardScorer.score), where the worker would otherwise die of it."""
    try:
        return score_chunk(reward, samples, score_key)
    except RewardTypeError as mistake:
        return mistake


def _exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


@dataclass(frozen=True)
class _RewardSpec:
    """What a worker loads: the function, its calling convention, a dict result's score entry
    and the keyword arguments of every call (JSON)."""

    spec: str
    kind: str = "auto"
    score_key: str = ""
    kwargs_json: str = "{}"


@dataclass(eq=False)  # workers are told apart by identity
class _Worker:
    """A worker process, the trainer's end of its pipe and what it is doing: starting
    (until it has loaded the reward, by `start_deadline`), idle, or scoring chunk `task`.
    `kind` is the calling convention the worker found, once it has started."""

    process: subprocess.Popen
    conn: Connection
    start_deadline: float
    started: bool = False
    task: int | None = None
    kind: str = ""

    @classmethod
    def start(cls, reward: _RewardSpec) -> _Worker:
        # A fresh interpreter (fork + exec, safe beside CUDA and threads) that imports only the reward: unlike
        # multiprocessing's spawn, it does not re-import the trainer's main script (torch and all: ~20 s, 450 MB).
        # It gets this process's sys.path, so that a module:function spec resolves as it does here.
        conn, child_conn = Pipe()
        boot = (f"import sys; sys.path[:] = {[str(entry) for entry in sys.path]!r}; "
                f"from rollplex.data.reward_scoring import _serve; _serve({child_conn.fileno()}, {reward.spec!r}, "
                f"{reward.kind!r}, {reward.score_key!r}, {reward.kwargs_json!r}, {os.getpid()})")
        process = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[child_conn.fileno()])
        child_conn.close()  # the worker holds the only other end: its death reads as EOF here
        return cls(process, conn, time.monotonic() + _START_TIMEOUT_S)

    @property
    def idle(self) -> bool:
        return self.started and self.task is None

    def assign(self, task: int, request: list[RewardSample]) -> None:
        self.task = task
        with contextlib.suppress(OSError):  # a worker that died while idle reads as EOF, like one dying in the call
            self.conn.send(request)

    def finish_start(self, spec: str) -> None:
        """Read the worker's start message (it is waiting); raise if it could not load the reward."""
        error_traceback = ""
        try:
            error, error_traceback, self.kind = self.conn.recv()
        except EOFError:
            error = f"the worker exited ({_exit_reason(self.stop())})"
        if error:
            raise carry_user_traceback(ImportError(f"reward {spec!r} in a worker process: {error}"),
                                       f"Loading reward {spec} in a worker process:", error_traceback)
        self.started = True

    def stop(self, grace_s: float = 0.0) -> int:
        """Close the pipe, give the process `grace_s` to exit, kill it if it has not;
        its exit code."""
        self.conn.close()
        try:
            return self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.conn.close()  # all at once: idle workers exit together
    for worker in workers:
        worker.stop(_STOP_GRACE_S)
    workers.clear()


class _WorkerPool:
    """`size` worker processes that each load `reward`, kept across batches. A batch's
    calls share one time limit, `timeout_s`: the calls still running then are killed
    with their workers, which are replaced, as is a worker that dies in a call; a
    replacement starts while the others go on scoring."""

    def __init__(self, reward: _RewardSpec, size: int, timeout_s: float):
        self.reward, self.spec, self.timeout_s = reward, reward.spec, timeout_s
        self.workers = [_Worker.start(reward) for _ in range(size)]
        # Stops the workers on close(), when the pool is collected, or at interpreter exit (a trainer that raised).
        self.close = weakref.finalize(self, _stop_all, self.workers)
        try:  # a reward that cannot load fails here, at the trainer's start
            for worker in self.workers:
                if not worker.conn.poll(max(0.0, worker.start_deadline - time.monotonic())):
                    raise TimeoutError(f"reward {self.spec!r}: a worker process did not start in "
                                       f"{_START_TIMEOUT_S:g} s")
                worker.finish_start(self.spec)
        except BaseException:
            self.close()
            raise
        self.kind = self.workers[0].kind

    def score(self, tasks: Sequence[list[RewardSample]]) -> list[CallOutcomes | None]:
        """Each task's (a call's samples) outcomes, or None for a task not done within `timeout_s`
        of the first call. One deadline for all: a function that hangs costs the batch one time
        limit, where one per call would cost tasks x limit / workers."""
        if not self.workers:
            raise RuntimeError(f"reward {self.spec!r}: the worker processes are closed")
        todo = deque(range(len(tasks)))
        results: list[CallOutcomes | None] = [None] * len(tasks)
        deadline = math.inf  # set by the first call: waiting for workers to start does not use up the limit
        while (todo or self._calling()) and time.monotonic() < deadline:
            for worker in self.workers:
                if worker.idle and todo:
                    deadline = min(deadline, time.monotonic() + self.timeout_s)
                    task = todo.popleft()
                    worker.assign(task, tasks[task])
            self._take_messages(tasks, results, deadline)
        self._kill_calls()
        return results

    def _calling(self) -> list[_Worker]:
        return [worker for worker in self.workers if worker.task is not None]

    def _take_messages(self, tasks: Sequence[list[RewardSample]], results: list[CallOutcomes | None],
                       deadline: float) -> None:
        """Wait for a message from a busy or starting worker, or for `deadline`, and take in those that came."""
        waiting = [worker for worker in self.workers if not worker.idle]
        until = min([deadline, *(worker.start_deadline for worker in waiting if not worker.started)])
        wait([worker.conn for worker in waiting], timeout=min(max(0.0, until - time.monotonic()), _MAX_WAIT_S))
        for worker in waiting:
            if worker.conn.poll():  # a message, or EOF: the worker died
                self._receive(worker, tasks, results)
            elif not worker.started and time.monotonic() >= worker.start_deadline:
                raise TimeoutError(f"reward {self.spec!r}: a replacement worker process did not start "
                                   f"in {_START_TIMEOUT_S:g} s")

    def _receive(self, worker: _Worker, tasks: Sequence[list[RewardSample]],
                 results: list[CallOutcomes | None]) -> None:
        """Take the worker's message: that it started, or its task's outcomes."""
        if not worker.started:
            worker.finish_start(self.spec)
            return
        task, worker.task = worker.task, None
        try:
            results[task] = worker.conn.recv()
        except EOFError:  # a crash in user code: a segfault, os.abort, or a kill from outside
            died = f"its worker process died ({_exit_reason(worker.stop())})"
            results[task] = CallOutcomes([(0.0, {}, died)] * len(tasks[task]))
            self._replace(worker)

    def _kill_calls(self) -> None:
        """Kill the workers whose calls ran to the deadline (their samples score 0.0), and replace them."""
        for worker in self._calling():
            worker.stop()
            self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        self.workers[self.workers.index(worker)] = _Worker.start(self.reward)


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
        self._pool = _WorkerPool(_RewardSpec(spec, kind, score_key, json.dumps(kwargs or {})), self.workers,
                                 timeout_s) if self.workers else None
        self.kind = self._reward.kind if self._reward else self._pool.kind  # the calling convention in use

    def score(self, responses: Sequence[str], answers: Sequence[str], response_ids: Sequence[list[int]] | None = None,
              columns: Sequence[dict[str, Any]] | None = None, warn: bool = True) -> RewardScores:
        """Score each response against its answer; `response_ids` (its tokens) and `columns`
        (its dataset row's, see `RewardSample`) are what the anchors' functions also read.
        Warns once when some failed (with `warn`; else the caller does: `warn_failures`).

        A score of the wrong type (a string, a list: see `score_of`) raises RewardTypeError,
        naming the function: its mistake, not the sample's. With `clip`, every score comes
        back clipped into [-clip, clip], as it trains (`_bounded`)."""
        samples = _samples(responses, answers, response_ids, columns)
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
