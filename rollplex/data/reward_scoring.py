"""Scoring batches of responses with a reward function, so that a failing call
costs one sample (scored 0.0 and counted), not the run.

`RewardScorer` scores in this process (`score_all`: the built-in rewards, trusted
and fast), or in worker processes that score calls in parallel, where a call that
hangs is killed at a time limit and a crash takes down only its worker, which is
replaced (user functions, by default).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import time
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait

from rollplex.data.rewards import RewardFn, load_reward


def _check_batch(responses: Sequence[str], answers: Sequence[str]) -> None:
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")


def _score_one(fn: RewardFn, response: str, answer: str) -> tuple[float, str]:
    """(score, "") or, for a call that raises or returns something that is not a
    finite number, (0.0, the error)."""
    try:
        score = float(fn(response, answer))
        if not math.isfinite(score):
            raise ValueError(f"non-finite reward {score}")
    except Exception as e:  # noqa: BLE001 - a user function may raise anything; one sample pays
        return 0.0, f"{type(e).__name__}: {e}"
    return score, ""


@dataclass
class RewardScores:
    """A batch's rewards in input order. A sample that fails scores 0.0 and is counted
    once: in `errors` (it raised, returned no finite number, or its worker died) or in
    `timeouts` (it did not return within the time limit)."""

    scores: list[float]
    errors: int = 0
    timeouts: int = 0


def _warn_failures(name: str, result: RewardScores, first_error: str, timeout_s: float = 0.0) -> None:
    total = len(result.scores)
    if result.errors:
        warnings.warn(f"reward function {name} failed on {result.errors} of {total} responses (scored 0.0); "
                      f"first error: {first_error}", stacklevel=3)
    if result.timeouts:
        warnings.warn(f"reward function {name} did not return within {timeout_s:g} s on {result.timeouts} of "
                      f"{total} responses (scored 0.0; their workers were replaced)", stacklevel=3)


def score_all(fn: RewardFn, responses: Sequence[str], answers: Sequence[str]) -> tuple[list[float], int]:
    """Score every (response, answer) pair in this process. A call that raises, or
    returns something that is not a finite number, scores 0.0 and counts as an error;
    the others go on. Returns (scores, number of errors) and warns once, with the
    first error."""
    _check_batch(responses, answers)
    results = [_score_one(fn, response, answer) for response, answer in zip(responses, answers)]
    failures = [error for _, error in results if error]
    scores = RewardScores([score for score, _ in results], errors=len(failures))
    _warn_failures(getattr(fn, "__qualname__", repr(fn)), scores, failures[0] if failures else "")
    return scores.scores, scores.errors


# ----------------------------------------------------------------------------- worker processes

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


def _serve(fd: int, spec: str, trainer_pid: int) -> None:
    """A worker process: load the reward, say so (an empty message, or the load
    error), then score (response, answer) requests until the trainer closes the pipe."""
    _die_with(trainer_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle: it closes our pipe
    conn = Connection(fd)
    with contextlib.suppress(EOFError, ConnectionError):  # the trainer closed the pipe: we are done
        try:
            fn = load_reward(spec)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            conn.send(f"{type(e).__name__}: {e}")
            return
        conn.send("")
        while True:
            response, answer = conn.recv()
            conn.send(_score_one(fn, response, answer))


def _exit_reason(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


@dataclass(eq=False)  # workers are told apart by identity
class _Worker:
    """A worker process, the trainer's end of its pipe and what it is doing: starting
    (until it has loaded the reward), idle, or scoring sample `task`, each until `deadline`."""

    process: subprocess.Popen
    conn: Connection
    deadline: float
    started: bool = False
    task: int | None = None

    @classmethod
    def start(cls, spec: str) -> _Worker:
        # A fresh interpreter (fork + exec, safe beside CUDA and threads) that imports only the reward: unlike
        # multiprocessing's spawn, it does not re-import the trainer's main script (torch and all: ~20 s, 450 MB).
        # It gets this process's sys.path, so that a module:function spec resolves as it does here.
        conn, child_conn = Pipe()
        boot = (f"import sys; sys.path[:] = {[str(entry) for entry in sys.path]!r}; "
                f"from rollplex.data.reward_scoring import _serve; _serve({child_conn.fileno()}, {spec!r}, {os.getpid()})")
        process = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[child_conn.fileno()])
        child_conn.close()  # the worker holds the only other end: its death reads as EOF here
        return cls(process, conn, time.monotonic() + _START_TIMEOUT_S)

    @property
    def idle(self) -> bool:
        return self.started and self.task is None

    def assign(self, task: int, request: tuple[str, str], timeout_s: float) -> None:
        self.task, self.deadline = task, time.monotonic() + timeout_s
        with contextlib.suppress(OSError):  # a worker that died while idle reads as EOF, like one dying in the call
            self.conn.send(request)

    def finish_start(self, spec: str) -> None:
        """Read the worker's start message (it is waiting); raise if it could not load the reward."""
        try:
            error = self.conn.recv()
        except EOFError:
            error = f"the worker exited ({_exit_reason(self.stop())})"
        if error:
            raise ImportError(f"reward {spec!r} in a worker process: {error}")
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
    """`size` worker processes that each load the reward from `spec`, kept across
    batches. A call past `timeout_s` is killed with its worker, and a worker that dies
    in a call is replaced; the replacement starts while the others go on scoring."""

    def __init__(self, spec: str, size: int, timeout_s: float):
        self.spec, self.timeout_s = spec, timeout_s
        self.workers = [_Worker.start(spec) for _ in range(size)]
        # Stops the workers on close(), when the pool is collected, or at interpreter exit (a trainer that raised).
        self.close = weakref.finalize(self, _stop_all, self.workers)
        try:  # a reward that cannot load fails here, at the trainer's start
            for worker in self.workers:
                if not worker.conn.poll(max(0.0, worker.deadline - time.monotonic())):
                    raise TimeoutError(f"reward {spec!r}: a worker process did not start in {_START_TIMEOUT_S:g} s")
                worker.finish_start(spec)
        except BaseException:
            self.close()
            raise

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> tuple[RewardScores, str]:
        """The batch's scores and the first failed sample's error message."""
        if not self.workers:
            raise RuntimeError(f"reward {self.spec!r}: the worker processes are closed")
        requests = list(zip(responses, answers))
        todo = deque(range(len(requests)))
        result, failures = RewardScores([0.0] * len(requests)), {}
        while todo or any(worker.task is not None for worker in self.workers):
            for worker in self.workers:
                if worker.idle and todo:
                    task = todo.popleft()
                    worker.assign(task, requests[task], self.timeout_s)
            waiting = [worker for worker in self.workers if not worker.idle]
            earliest = min(worker.deadline for worker in waiting)
            wait([worker.conn for worker in waiting], timeout=min(max(0.0, earliest - time.monotonic()), _MAX_WAIT_S))
            for worker in waiting:
                if worker.conn.poll():  # a message, or EOF: the worker died
                    self._receive(worker, result, failures)
                elif time.monotonic() >= worker.deadline:
                    self._time_out(worker, result)
        result.errors = len(failures)
        return result, failures[min(failures)] if failures else ""

    def _receive(self, worker: _Worker, result: RewardScores, failures: dict[int, str]) -> None:
        """Take the worker's message: that it started, or its task's result."""
        if not worker.started:
            worker.finish_start(self.spec)
            return
        task, worker.task = worker.task, None
        try:
            result.scores[task], error = worker.conn.recv()
        except EOFError:  # a crash in user code: a segfault, os.abort, or a kill from outside
            error = f"its worker process died ({_exit_reason(worker.stop())})"
            self._replace(worker)
        if error:
            failures[task] = error

    def _time_out(self, worker: _Worker, result: RewardScores) -> None:
        if not worker.started:
            raise TimeoutError(f"reward {self.spec!r}: a replacement worker process did not start "
                               f"in {_START_TIMEOUT_S:g} s")
        worker.stop()  # kills it: its sample scores 0.0
        result.timeouts += 1
        self._replace(worker)

    def _replace(self, worker: _Worker) -> None:
        self.workers[self.workers.index(worker)] = _Worker.start(self.spec)


class RewardScorer:
    """Scores batches with the reward `spec` (see `load_reward`), in one of two ways:

    - `workers` = 0: in this process, one call after another (`score_all`). Fast, and
      right for the built-in rewards, but a call cannot be time-limited, and a hang or
      crash in it is the trainer's.
    - `workers` > 0: in that many worker processes, kept across batches, that each load
      the reward themselves and score calls in parallel. A call that does not return
      within `timeout_s` scores 0.0 and counts as a timeout (its worker is killed and
      replaced); a worker that dies in a call (a segfault, os.abort) costs that sample
      an error, and is replaced.

    -1 = auto: in this process for a built-in reward, else `USER_REWARD_WORKERS`
    processes. Either way a call that raises or returns no finite number scores 0.0
    and counts as an error, and each batch warns once with its first error.
    `close()` stops the workers (so does interpreter exit).
    """

    def __init__(self, spec: str, workers: int = -1, timeout_s: float = 60.0):
        self.spec, self.timeout_s = spec, timeout_s
        self.workers = (0 if ":" not in spec else USER_REWARD_WORKERS) if workers == -1 else workers
        self._fn = load_reward(spec) if self.workers == 0 else None
        self._pool = _WorkerPool(spec, self.workers, timeout_s) if self.workers else None

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardScores:
        _check_batch(responses, answers)
        if self._pool is None:
            return RewardScores(*score_all(self._fn, responses, answers))
        result, first_error = self._pool.score(responses, answers)
        _warn_failures(self.spec, result, first_error, self.timeout_s)
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
