"""How a run stops on a signal: Ctrl-C (SIGINT) at once; SIGTERM (SLURM, Kubernetes, `timeout`, torchrun passing
its own on) once the step under way is done and saved (trainer.save_on_term), or at once.

    with handling_stop_signals() as received:   # the entry point, for the run's lifetime
        ...
        with finishing_steps(lambda: self.step, last_step, announce=rank == 0, save_on_term=True) as boundary:
            while ...:
                ...one step...
                if boundary.requested():        # at each step boundary, on every rank
                    save the step; raise Terminated(step)

Both handlers raise at once in the main thread (KeyboardInterrupt, Terminated) and record that they did: Python
swallows an exception raised inside a finalizer or a weakref callback (it prints "Exception ignored in ..." and
goes on), so a signal that lands there would be lost; `requested` raises it again at the next step boundary. And
a library may turn the exception into one of its own (DCP's save wraps whatever it raises): the run's end still
names the signal (`ReceivedSignals.signal_that_stopped`).

While the loop runs its steps with save_on_term, SIGTERM is a request instead: rank 0 says which step it
finishes, the step runs to its end, and at the step boundary the ranks agree (one all_reduce MAX of a flag, when
there are several) to stop there, since torchrun passes SIGTERM to each rank at a moment of its own and a rank
that stopped a step early would leave the others waiting in a collective. A second SIGTERM (3 s or more after
the first: SLURM signals every process of a job, torchrun too, which passes it on, so one stop arrives twice) or
a Ctrl-C stops at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from rollplex.dist import all_reduce_values

TERM_STATUS = 128 + signal.SIGTERM  # 143: what a shell reports for a command SIGTERM stopped
REPEAT_WINDOW_S = 3.0  # a SIGTERM this soon after the first is the same stop, told twice


class Terminated(BaseException):
    """SIGTERM stopped the run: at once, or after finishing and saving `saved_step` (trainer.save_on_term). A
    BaseException, as KeyboardInterrupt is: no `except Exception` on the way out swallows it."""

    def __init__(self, saved_step: int | None = None):
        super().__init__("SIGTERM" if saved_step is None else f"SIGTERM: step {saved_step} finished and saved")
        self.saved_step = saved_step


@dataclass
class ReceivedSignals:
    """What the handlers got while `handling_stop_signals` ran."""

    interrupt_raised: bool = False  # Ctrl-C: its KeyboardInterrupt was raised
    term_raised: bool = False  # SIGTERM, raised at once
    term_requested_at: float | None = None  # SIGTERM during the steps: finish the step under way, then stop

    def signal_that_stopped(self, error: BaseException) -> BaseException:
        """What stopped the run that ends on `error`: the Ctrl-C or SIGTERM whose exception was raised, when one
        was, even where a library turned that exception into one of its own (DCP wraps whatever its save raises, a
        KeyboardInterrupt too, into a CheckpointException, which a failed save then reports); else `error`."""
        if isinstance(error, (KeyboardInterrupt, Terminated)):
            return error
        if self.interrupt_raised:
            return KeyboardInterrupt()
        return Terminated() if self.term_raised else error


_received = ReceivedSignals()  # the running `handling_stop_signals`' (a blank one outside it)
# While the loop runs its steps with trainer.save_on_term: says what SIGTERM now does (None: stop at once).
_on_term_request: Callable[[], None] | None = None


def _on_sigint(signum: int, frame: object) -> None:
    _received.interrupt_raised = True
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: object) -> None:
    now = time.monotonic()
    if _on_term_request is not None:
        first = _received.term_requested_at
        if first is None:
            _received.term_requested_at = now
            _on_term_request()
            return
        if now - first < REPEAT_WINDOW_S:
            return
    _received.term_raised = True
    raise Terminated()


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # the only thread that may set handlers


@contextmanager
def handling_stop_signals() -> Iterator[ReceivedSignals]:
    """Ctrl-C and SIGTERM stop the body at once (KeyboardInterrupt, Terminated), recorded in what it yields, which
    keeps the record after it; the handlers that were there before come back after it."""
    global _received
    received = ReceivedSignals()
    if not _in_main_thread():
        yield received
        return
    _received = received
    previous = {number: signal.signal(number, handler)
                for number, handler in ((signal.SIGINT, _on_sigint), (signal.SIGTERM, _on_sigterm))}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _received = ReceivedSignals()  # a trainer fitted later without the entry point sees no old signal


class StepBoundary:
    """The training loop's view of the stop signals, at a step boundary."""

    def __init__(self, save_on_term: bool):
        self.save_on_term = save_on_term

    def requested(self) -> bool:
        """Whether a SIGTERM asks every rank to stop after this step (collective when there are several ranks
        and save_on_term); a Ctrl-C or SIGTERM whose exception was swallowed is raised again here."""
        if _received.interrupt_raised:
            raise KeyboardInterrupt
        if _received.term_raised:
            raise Terminated()
        if not self.save_on_term:
            return False
        requested = _received.term_requested_at is not None
        if dist.is_initialized() and dist.get_world_size() > 1:
            requested = all_reduce_values([float(requested)], dist.ReduceOp.MAX)[0] > 0
        return requested


@contextmanager
def finishing_steps(step: Callable[[], int], last_step: int, announce: bool,
                    save_on_term: bool) -> Iterator[StepBoundary]:
    """The loop's steps: with `save_on_term`, a SIGTERM asks the loop to stop after the step under way (`step()`),
    which it learns at the step boundary (`StepBoundary.requested`); `announce`: this rank says so on receipt.
    Outside, SIGTERM stops at once again (the entry point's handler) or as it did before (without one)."""
    global _on_term_request, _received
    if not save_on_term or not _in_main_thread():
        yield StepBoundary(save_on_term=False)
        return

    def say_what_happens() -> None:
        if not announce:
            return
        now = step()
        what = "then ending the run (its last step)" if now >= last_step else \
            "then saving it and stopping (trainer.save_on_term)"
        # os.write, not print: the main thread may be inside a print to stderr, which a print here would re-enter.
        os.write(2, f"rollplex: SIGTERM received: finishing step {now}, {what}\n".encode())

    _received.term_requested_at = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _on_term_request = say_what_happens
    try:
        yield StepBoundary(save_on_term=True)
    finally:
        _on_term_request = None
        signal.signal(signal.SIGTERM, previous)
        if previous is not _on_sigterm:  # no entry point keeps this record for its end line: the next fit starts blank
            _received = ReceivedSignals()
