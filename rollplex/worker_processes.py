"""Worker processes for user code (reward functions, tools, environments): a call that hangs can be killed at
its deadline, and a crash costs its worker, never the trainer.

A worker is a fresh interpreter that imports only what it serves. `WorkerPool` starts `size` of them; each calls
`setup(*args)`, a "module:function" of Rollplex's that loads the user's code and returns `(handle, info)`, and
then answers the requests sent to it one at a time, `handle(request) -> reply`. The pool waits until every worker
has loaded (a load error is raised in the trainer, at its start). When a call has run too long is the pool user's
to say, and it kills and replaces that worker (`replace`): reward scoring gives a batch one deadline
(rollplex.data.reward_scoring), tools and environments one per call (rollplex.agent.workers).

A worker dies with its trainer (Linux), and leaves Ctrl-C and SIGTERM to the trainer, which closes its pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from rollplex.user_code import carry_user_traceback, last_user_frame

START_TIMEOUT_S = 300.0  # a worker's interpreter start and its user code's import (which may load a model)
_STOP_GRACE_S = 1.0  # an idle worker exits on its own once its pipe closes
_MAX_WAIT_S = 3600.0  # wait() rejects timeouts past ~24 days: a longer limit is waited out hour by hour


def describe_error(error: BaseException) -> str:
    """The error's one line, with where the user's code raised it ("... (reward.py:3 in reward)")."""
    where = last_user_frame(error)
    return f"{type(error).__name__}: {error}" + (f" ({where})" if where else "")


def exit_reason(code: int) -> str:
    """A process's exit code in words: "killed by SIGKILL", "exit code 1"."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _die_with(trainer_pid: int) -> None:
    """Linux: the kernel kills this worker when the trainer dies, even by SIGKILL while a
    call hangs here (an idle worker would see its pipe close, a hung one would not)."""
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: no prctl
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != trainer_pid:  # it died before that took effect
        os._exit(1)


def serve(fd: int, setup: str, args: tuple, trainer_pid: int) -> None:
    """A worker process: `setup(*args)` for its handler, say so (("", "", info), or (the load error,
    its traceback, None)), then answer requests with the handler until the trainer closes the pipe."""
    _die_with(trainer_pid)
    # Ctrl-C and SIGTERM are the trainer's to handle (SLURM and Ctrl-C signal every process): it closes our pipe,
    # after the step it finishes on SIGTERM, whose calls still run here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    with contextlib.suppress(EOFError, ConnectionError):  # the trainer closed the pipe: we are done
        module, _, name = setup.partition(":")
        try:
            handle, info = getattr(importlib.import_module(module), name)(*args)
        except Exception as e:  # noqa: BLE001 - reported to the trainer, which raises it
            conn.send((describe_error(e), "".join(traceback.format_exception(e)), None))
            return
        conn.send(("", "", info))
        while True:
            conn.send(handle(conn.recv()))


@dataclass(frozen=True)
class WorkerDied:
    """The reply of a worker that died in a call (a segfault, os.abort, a kill from outside): `reason` says how."""

    reason: str


@dataclass(eq=False)  # workers are told apart by identity
class WorkerProcess:
    """A worker process, the trainer's end of its pipe and what it is doing: starting (until it
    has loaded, by `start_deadline`), idle, or busy with `task` (the pool user's record of the call,
    never None) since `assigned_at`. `info` is what its setup returned besides the handler."""

    process: subprocess.Popen
    conn: Connection
    start_deadline: float
    started: bool = False
    task: Any = None
    assigned_at: float = 0.0
    info: Any = None

    @classmethod
    def start(cls, setup: str, args: tuple) -> WorkerProcess:
        # A fresh interpreter (fork + exec, safe beside CUDA and threads) that imports only what it serves: unlike
        # multiprocessing's spawn, it does not re-import the trainer's main script (torch and all: ~20 s, 450 MB).
        # It gets this process's sys.path, so that a module:function spec resolves as it does here.
        conn, child_conn = Pipe()
        boot = (f"import sys; sys.path[:] = {[str(entry) for entry in sys.path]!r}; "
                f"from rollplex.worker_processes import serve; "
                f"serve({child_conn.fileno()}, {setup!r}, {tuple(args)!r}, {os.getpid()})")
        process = subprocess.Popen([sys.executable, "-c", boot], pass_fds=[child_conn.fileno()])
        child_conn.close()  # the worker holds the only other end: its death reads as EOF here
        return cls(process, conn, time.monotonic() + START_TIMEOUT_S)

    @property
    def idle(self) -> bool:
        return self.started and self.task is None

    @property
    def busy(self) -> bool:
        return self.task is not None

    def assign(self, task: Any, request: Any) -> None:
        """Send `request`; the worker is busy with `task` until its reply is taken (`WorkerPool.receive`)."""
        self.task, self.assigned_at = task, time.monotonic()
        with contextlib.suppress(OSError):  # a worker that died while idle reads as EOF, like one dying in the call
            self.conn.send(request)

    def finish_start(self, what: str) -> None:
        """Read the worker's start message (it is waiting); raise if it could not load `what`."""
        error_traceback = ""
        try:
            error, error_traceback, self.info = self.conn.recv()
        except EOFError:
            error = f"the worker exited ({exit_reason(self.stop())})"
        if error:
            raise carry_user_traceback(ImportError(f"{what} in a worker process: {error}"),
                                       f"Loading {what} in a worker process:", error_traceback)
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


def _stop_all(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        worker.conn.close()  # all at once: idle workers exit together
    for worker in workers:
        worker.stop(_STOP_GRACE_S)
    workers.clear()


class WorkerPool:
    """`size` worker processes serving `setup(*args)` (see the module's docstring), kept until
    `close()` (or the pool's collection, or interpreter exit). `what` names the user's code in
    errors ("reward 'my.py:score'"). A worker that dies in a call is replaced by `receive`; one
    whose call ran past its deadline, by the pool's user (`replace`). A replacement starts while
    the others go on."""

    def __init__(self, setup: str, args: tuple, size: int, what: str):
        self.setup, self.args, self.what = setup, args, what
        self.workers = [WorkerProcess.start(setup, args) for _ in range(size)]
        # Stops the workers on close(), when the pool is collected, or at interpreter exit (a trainer that raised).
        self.close = weakref.finalize(self, _stop_all, self.workers)
        try:  # user code that cannot load fails here, at the trainer's start
            for worker in self.workers:
                if not worker.conn.poll(max(0.0, worker.start_deadline - time.monotonic())):
                    raise TimeoutError(f"{what}: a worker process did not start in {START_TIMEOUT_S:g} s")
                worker.finish_start(what)
        except BaseException:
            self.close()
            raise
        self.info = self.workers[0].info  # every worker's setup returned the same

    def check_open(self) -> None:
        if not self.workers:
            raise RuntimeError(f"{self.what}: the worker processes are closed")

    def idle(self) -> list[WorkerProcess]:
        return [worker for worker in self.workers if worker.idle]

    def busy(self) -> list[WorkerProcess]:
        return [worker for worker in self.workers if worker.busy]

    def receive(self, until: float) -> list[tuple[WorkerProcess, Any, Any]]:
        """Wait for a message from a busy or starting worker (none: no wait), or until `until`
        (time.monotonic()), and take in those that came: a replacement that started becomes idle (one that cannot load
        raises), and each busy worker that answered is idle again, its call's (worker, task, reply).
        A worker that died in its call gives a `WorkerDied` reply and is replaced."""
        waiting = [worker for worker in self.workers if not worker.idle]
        if not waiting:
            return []
        wake = min([until, *(worker.start_deadline for worker in waiting if not worker.started)])
        wait([worker.conn for worker in waiting], timeout=min(max(0.0, wake - time.monotonic()), _MAX_WAIT_S))
        replies = []
        for worker in waiting:
            if worker.conn.poll():  # a message, or EOF: the worker died
                if not worker.started:
                    worker.finish_start(self.what)
                else:
                    replies.append((worker, worker.task, self._reply(worker)))
            elif not worker.started and time.monotonic() >= worker.start_deadline:
                raise TimeoutError(f"{self.what}: a replacement worker process did not start "
                                   f"in {START_TIMEOUT_S:g} s")
        return replies

    def _reply(self, worker: WorkerProcess) -> Any:
        worker.task = None
        try:
            return worker.conn.recv()
        except EOFError:  # a crash in user code: a segfault, os.abort, or a kill from outside
            died = WorkerDied(exit_reason(worker.stop()))
            self.replace(worker)
            return died

    def replace(self, worker: WorkerProcess) -> WorkerProcess:
        """Kill `worker` (if it still runs) and start another in its place; the new one."""
        worker.stop()
        replacement = WorkerProcess.start(self.setup, self.args)
        self.workers[self.workers.index(worker)] = replacement
        return replacement
