"""The engine's one-line progress display on stderr."""

from __future__ import annotations

import sys
import time

from rollplex.dist import rank


class Progress:
    """Samples done and output tokens/s, for generations that last more than a couple
    of seconds, on an interactive stderr, on rank 0 only."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and rank() == 0 and sys.stderr.isatty()
        self.start = self.last = time.perf_counter()
        self.done, self.shown = 0, False

    def update(self, finished: int, tokens: int) -> None:
        """After a step that finished `finished` samples, `tokens` generated so far."""
        self.done += finished
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.5 or now - self.start < 2.0:
            return
        self.last, self.shown = now, True
        rate = tokens / (now - self.start)
        sys.stderr.write(f"\rgenerate: {self.done}/{self.total} samples, {rate:,.0f} tok/s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
