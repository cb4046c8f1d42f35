"""Progress inside a run's steps, on rank 0: what a step is doing now, while it runs.

The trainer names each phase of a step (gen, prefix, reward, old_log_prob, ref, update_actor: the names of its
timing_s/ metrics; then val and save), the engine reports the samples it finished and the tokens it generated, the actor the
micro-batches it ran. `Progress` shows them in one of two ways (logging.progress):

    live   one line redrawn in place at the foot of the console (tqdm), the run's other lines printed above it:
           step 3/100 gen: ████████▏           412/1,024 samples, 2,310 tok/s (41 s)
    lines  a plain line every logging.progress_every_s seconds while a phase runs, for logs that are files:
           step 3/100 gen: 412/1,024 samples, 2,310 tok/s (41 s)

`auto` is live when stdout is a terminal, lines otherwise. The seconds are the phase's so far. Reports only set
numbers (the engine makes one per decode step, which must stay cheap); a background thread draws them, so that a
phase that reports nothing (a slow reward function) still shows its time going by.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

MODES = ("auto", "live", "lines", "off")
TICK_S = 0.5  # how often the thread draws: the live line is redrawn, a line is printed if one is due
BAR_WIDTH = 20


def resolve_mode(mode: str, stream: TextIO) -> str:
    """`mode` with auto decided: live on a terminal, lines otherwise."""
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return "live" if stream.isatty() else "lines"


class Progress:
    """The step in progress, as reported, shown as `mode` says; off (the metrics logger's on ranks other than 0,
    and without a console) shows nothing, and `write` prints plain lines.

    `every_s`: seconds between lines (lines mode). `total_steps`: the run's length, shown after the step.
    `tick_s`: seconds between the thread's draws (`tick`); None: no thread, the caller ticks (the tests, with
    their own `clock` and `stream`)."""

    def __init__(self, mode: str = "auto", every_s: float = 30.0, total_steps: int | None = None,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic,
                 tick_s: float | None = TICK_S):
        self._stream = stream
        self.mode = resolve_mode(mode, self.stream)
        self.every_s, self.total_steps, self.clock = every_s, total_steps, clock
        self.tick_s = None if tick_s is None else min(tick_s, every_s)
        self.step: int | None = None
        self.phase_name: str | None = None
        self.phase_start = self.last_line = clock()
        self.own_phase = False  # the phase is a generation's own ("generate": no phase was named around it)
        self._reset_counts()
        self._bar: tqdm | None = None
        self._write_lock = threading.Lock()  # one line at a time from the thread and the caller
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def stream(self) -> TextIO:
        """Where it writes: the stream it was given, else sys.stdout as it is now (print's, which tests capture)."""
        return self._stream or sys.stdout

    def _reset_counts(self) -> None:
        self.samples_done = self.samples_total = self.tokens = 0
        self.generation_start = self.clock()
        self.micro_batches_done = self.micro_batches_total = 0

    # ------------------------------------------------------------------ reports

    def start_step(self, step: int) -> None:
        """A step begins: its lines are counted from now."""
        self.step = step
        self.last_line = self.clock()
        self._start_thread()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The step's phase `name` runs inside the block; its counts start from zero."""
        self._enter_phase(name)
        try:
            yield
        finally:  # between phases the seconds count the gap (the step's own work: advantages, metrics)
            self.phase_name, self.phase_start = None, self.clock()
            self._reset_counts()

    def _enter_phase(self, name: str) -> None:
        self.phase_name, self.phase_start = name, self.clock()
        self._reset_counts()
        self._start_thread()

    def generation(self, total: int) -> None:
        """A generation of `total` samples begins (the engine's). Outside any phase it is a phase of its own."""
        if self.phase_name is None:
            self._enter_phase("generate")
            self.own_phase = True
        self.samples_done, self.samples_total, self.tokens = 0, total, 0
        self.generation_start = self.clock()

    def samples(self, finished: int, tokens: int) -> None:
        """`finished` more samples are done; `tokens`: the tokens the generation has made so far."""
        self.samples_done += finished
        self.tokens = tokens

    def generation_done(self) -> None:
        """The generation ended; one that was a phase of its own takes its line away."""
        if self.own_phase:
            self.own_phase, self.phase_name = False, None
            self.close()

    def micro_batches(self, done: int, total: int) -> None:
        """`done` of the pass's `total` micro-batches have run (an update's or a logprob pass's)."""
        self.micro_batches_done, self.micro_batches_total = done, total

    # ------------------------------------------------------------------ what is shown

    def head(self) -> str:
        """'step 3/100 gen': the step and the phase, those known."""
        step = None if self.step is None else f"step {self.step}"
        if step and self.total_steps:
            step += f"/{self.total_steps}"
        return " ".join(part for part in (step, self.phase_name) if part)

    def counts(self, now: float) -> str:
        """'412/1,024 samples, 2,310 tok/s': the phase's counts, those it has ('' for none)."""
        parts = []
        if self.samples_total:
            seconds = now - self.generation_start
            rate = f", {self.tokens / seconds:,.0f} tok/s" if seconds > 0 else ""
            parts.append(f"{self.samples_done:,}/{self.samples_total:,} samples{rate}")
        if self.micro_batches_total:
            parts.append(f"{self.micro_batches_done}/{self.micro_batches_total} micro-batches")
        return ", ".join(parts)

    def line(self, now: float, bar: str = "") -> str:
        """The plain line: 'step 3/100 gen: 412/1,024 samples, 2,310 tok/s (41 s)', 'step 3/100 reward (12 s)';
        `bar`, when the phase has counts, goes before them."""
        counts, seconds = self.counts(now), f"({now - self.phase_start:.0f} s)"
        return f"{self.head()}: {bar}{counts} {seconds}" if counts else f"{self.head()} {seconds}"

    def tick(self) -> None:
        """Draw once: the live line redrawn, or in lines mode a line when every_s has passed in a step."""
        if self.phase_name is None and self.mode == "lines":
            return  # between the phases: nothing runs that the step's metrics line will not report
        now = self.clock()
        if self.mode == "live":
            self._draw(now)
        elif self.mode == "lines" and now - self.last_line >= self.every_s:
            self.last_line = now
            self.write(self.line(now))

    def _draw(self, now: float) -> None:
        """The plain line with a bar of the phase's main count (samples, else micro-batches) before the counts."""
        done, total = ((self.samples_done, self.samples_total) if self.samples_total
                       else (self.micro_batches_done, self.micro_batches_total))
        # tqdm's bar_format is a str.format template: the line holds no braces (numbers, and phase names from code).
        text = self.line(now, bar=f"{{bar:{BAR_WIDTH}}} ")
        with tqdm.get_lock():
            if self._bar is None:  # made with its first line (a bare tqdm would draw "0it" first)
                self._bar = tqdm(file=self.stream, leave=False, dynamic_ncols=True, mininterval=0, bar_format=text,
                                 total=total or None, initial=done)
                return
            self._bar.bar_format = text
            self._bar.total, self._bar.n = total or None, done
            self._bar.refresh()

    def write(self, text: str) -> None:
        """Print `text` as a line of its own (above the live line, which is drawn again under it)."""
        with self._write_lock:
            if self._bar is not None:
                self._draw(self.clock())  # tqdm draws the live line again under `text`: as it is now, not as it was
                tqdm.write(text, file=self.stream)
            else:
                self.stream.write(text + "\n")
                self.stream.flush()

    # ------------------------------------------------------------------ the drawing thread

    def _start_thread(self) -> None:
        if not self.enabled or self.tick_s is None or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rollplex-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()

    def close(self) -> None:
        """Stop drawing and take the live line away (a later report starts again)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        with tqdm.get_lock():
            if self._bar is not None:
                self._bar.close()
                self._bar = None
