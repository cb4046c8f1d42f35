"""Tool calls run in worker processes, with the reward's isolation and deadline (rollplex.worker_processes):
a call that raises, hangs, returns a value `tool_result` refuses, cannot be made or kills its worker
comes back as a `ToolFailure`, which the model reads as the tool's answer. The run never dies of a tool.

    with ToolRunner(["tools.py:crop"], workers=2, timeout_s=30) as runner:
        runner.submit(key, call, context)           # returns at once; the engine decodes on
        ...
        for key, result in runner.poll(wait=False): # each a ToolResult or a ToolFailure
            ...

(`call` from `parse_tool_call`, `context` from `row_context`: rollplex.agent.tools.) The workers load
the tools themselves from their specs (a function need not pickle); results cross back pickled (PIL
images do). `workers=0` runs each call in this process as it is submitted, as rewards do: fast, but a
call cannot be time-limited, and a hang or a crash in it is the trainer's.

A call's deadline, `timeout_s`, runs from when a worker takes it, not from its submit: a call that
waits for a free worker is not slow itself (as a reward batch's limit starts with its first call).
A call past it is killed with its worker, which is replaced; the other calls go on. `AsyncRunner`
is the machinery, shared with environments (rollplex.agent.environment).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollplex.agent.tools import Tool, ToolCall, ToolResult, check_arguments, load_tools, tool_result
from rollplex.worker_processes import WorkerDied, WorkerPool, WorkerProcess

FailureKind = Literal["raised", "timeout", "bad_result", "bad_call", "died"]


@dataclass
class ToolFailure:
    """A tool call (or environment step) that gave no answer, and why: it `raised` (message: the
    exception's type and text), ran past its deadline (`timeout`: its worker was killed), returned
    a value no observation is made of (`bad_result`), could not be made (`bad_call`: an unknown
    tool, arguments that do not fit, context the row lacks), or its worker process `died`."""

    kind: FailureKind
    message: str


def guarded_call(call: Callable[[], Any], normalise: Callable[[Any], Any]) -> Any:
    """`normalise(call())`, or the ToolFailure of user code that raised (`raised`) or returned a
    value that `normalise` refuses with a TypeError or ValueError (`bad_result`)."""
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - user code may raise anything; its call pays, not the run
        return ToolFailure("raised", f"{type(e).__name__}: {e}")
    try:
        return normalise(value)
    except (TypeError, ValueError) as e:
        return ToolFailure("bad_result", str(e))


def run_tool_call(tools: Mapping[str, Tool], call: ToolCall, context: Mapping[str, Any]) -> ToolResult | ToolFailure:
    """Run `call` on the tool it names, with the row's `context` for it (`row_context`): its
    ToolResult, or the ToolFailure that says why there is none."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolFailure("bad_call", f"there is no tool {call.name!r} (the tools: {', '.join(tools)})")
    try:
        check_arguments(tool, call.arguments)
    except TypeError as e:
        return ToolFailure("bad_call", str(e))
    return guarded_call(lambda: tool.fn(**call.arguments, **context), tool_result)


@dataclass(eq=False)
class _Request:
    """A request to a handler: whose (`key`), what it asks, the worker it must run on (None: any), and
    whether its reply goes to `poll` (an environment's `end` needs none)."""

    key: Any
    message: Any
    worker: WorkerProcess | None = None
    reported: bool = True


class AsyncRunner:
    """Requests answered by a handler, `setup(*args)` -> (handle, info) (a function of Rollplex's at
    a module's top level), in `workers` worker processes or (0) in this process. `_send` queues a
    request and returns; `poll` gives the replies that came since, each with its request's key. A
    request runs on the worker it names, or on any idle one; past `timeout_s` from when its worker
    took it, the worker is killed and replaced, and its request fails as a `timeout`."""

    def __init__(self, setup: Callable[..., tuple[Callable[[Any], Any], Any]], args: tuple, workers: int,
                 timeout_s: float, what: str):
        if workers < 0 or not timeout_s > 0:
            raise ValueError(f"{what}: workers must be >= 0 and timeout_s > 0, got {workers} and {timeout_s}")
        self.timeout_s = timeout_s
        self._pool: WorkerPool | None = None
        self._handle: Callable[[Any], Any] | None = None
        if workers:
            self._pool = WorkerPool(f"{setup.__module__}:{setup.__qualname__}", args, workers, what)
        else:
            self._handle, _ = setup(*args)
        self._queue: deque[_Request] = deque()
        self._done: list[tuple[Any, Any]] = []

    def _send(self, key: Any, message: Any, worker: WorkerProcess | None = None, reported: bool = True) -> None:
        if self._pool is None:
            reply = self._handle(message)
            if reported:
                self._done.append((key, reply))
            return
        self._pool.check_open()
        self._queue.append(_Request(key, message, worker, reported))
        self._dispatch()

    def poll(self, wait: bool = False) -> list[tuple[Any, Any]]:
        """Every reply that came since the last poll, as (key, reply); with `wait`, block until
        at least one comes, if any is pending."""
        if self._pool is not None:
            self._pool.check_open()
            self._take_replies(wait)
        done, self._done = self._done, []
        return done

    def pending(self) -> int:
        """Requests sent whose replies `poll` has yet to give (taken in or not)."""
        running = [worker.task for worker in self._pool.busy()] if self._pool else []
        return sum(request.reported for request in [*self._queue, *running]) + len(self._done)

    def _take_replies(self, wait: bool) -> None:
        while True:
            deadlines = [worker.assigned_at + self.timeout_s for worker in self._pool.busy()]
            until = min(deadlines, default=math.inf) if wait and not self._done and self.pending() else 0.0
            for worker, request, reply in self._pool.receive(until):
                if isinstance(reply, WorkerDied):
                    self._lose(worker, request, ToolFailure("died", f"its worker process died ({reply.reason})"))
                elif request.reported:
                    self._done.append((request.key, reply))
            for worker in self._pool.busy():
                if time.monotonic() >= worker.assigned_at + self.timeout_s:
                    request = worker.task
                    self._pool.replace(worker)
                    self._lose(worker, request, ToolFailure(
                        "timeout", f"no answer within {self.timeout_s:g} s: its worker process was killed"))
            self._dispatch()
            if not wait or self._done or not self.pending():
                return

    def _dispatch(self) -> None:
        """Give each idle worker the first queued request it may run."""
        for worker in self._pool.idle():
            request = next((r for r in self._queue if r.worker in (None, worker)), None)
            if request is not None:
                self._queue.remove(request)
                worker.assign(request, request.message)

    def _lose(self, worker: WorkerProcess, request: _Request, failure: ToolFailure) -> None:
        """`worker` is gone, killed or dead, in `request`: it fails with `failure`, and so do the
        requests queued for that worker alone (`_worker_lost` says what else was lost with it)."""
        stranded = [r for r in self._queue if r.worker is worker]
        for queued in stranded:
            self._queue.remove(queued)
        for lost in [request, *stranded]:
            if lost.reported:
                self._done.append((lost.key, failure if lost is request else ToolFailure(
                    "died", f"its worker process was lost ({failure.message})")))
        self._worker_lost(worker, failure)

    def _worker_lost(self, worker: WorkerProcess, failure: ToolFailure) -> None:
        """What a runner whose requests keep state in their worker loses with it (nothing here)."""

    def close(self) -> None:
        """Stop the worker processes (interpreter exit does too)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> AsyncRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _tool_worker(specs: list[str]) -> tuple[Callable[[Any], ToolResult | ToolFailure], None]:
    """A tool worker's setup: load the tools (their schemas are the trainer's: `load_tools`); its
    handler runs a (call, context) request."""
    tools = {tool.name: tool for tool in load_tools(specs, schemas=False)}
    return (lambda request: run_tool_call(tools, *request)), None


class ToolRunner(AsyncRunner):
    """Runs the model's tool calls: the tools `specs` name (`load_tools`), in `workers` worker
    processes (0: in this process, no deadline) with a deadline of `timeout_s` per call (see the
    module's docstring). The schemas the chat template renders are `load_tools(specs)`'s, in the
    trainer."""

    def __init__(self, specs: list[str], workers: int = 1, timeout_s: float = 60.0):
        super().__init__(_tool_worker, (list(specs),), workers, timeout_s, f"tools {', '.join(specs)}")

    def submit(self, key: Any, call: ToolCall, context: Mapping[str, Any] | None = None) -> None:
        """Run `call` with the row's context for its tool (the keyword-only arguments, from the
        row's verl `extra_info.tools_kwargs`: `row_context`); its ToolResult or ToolFailure comes
        back from `poll` with `key`. Returns at once when the calls run in workers."""
        self._send(key, (call, dict(context or {})))

    def poll(self, wait: bool = False) -> list[tuple[Any, ToolResult | ToolFailure]]:
        """Every call finished since the last poll, as (key, ToolResult or ToolFailure); with
        `wait`, block until at least one finishes, if any is pending."""
        return super().poll(wait)

    def __enter__(self) -> ToolRunner:
        return self
