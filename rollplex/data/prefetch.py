"""The next training batch, prepared in a background thread while this step runs.

Rendering a batch (chat template, image and video decoding, the processor,
the tokenizer) is host work that does not depend on the step before it, so it
runs one step ahead: the step then only waits for whatever of it is not done
yet (`wait_s`, the loop's `timing_s/data`). The batches and their order are
those of the stream it reads; an error preparing a batch is raised by the
`next` call that asks for that batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Calls `produce` in a background thread, one call ahead of `next`."""

    def __init__(self, produce: Callable[[], T]):
        self._produce = produce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollplex-data")
        self._pending: Future[T] | None = self._pool.submit(produce)
        self.wait_s = 0.0  # how long the last `next` waited for its item

    def next(self, ahead: bool = True) -> T:
        """The next item; with `ahead`, the one after it starts being prepared at once."""
        if self._pending is None:
            raise RuntimeError("the prefetcher was asked for nothing ahead of its last item")
        start = time.perf_counter()
        try:
            item = self._pending.result()
        finally:
            self.wait_s = time.perf_counter() - start
            self._pending = None
        if ahead:
            self._pending = self._pool.submit(self._produce)
        return item

    def close(self) -> None:
        """Stops after the item being prepared, if any (it is dropped)."""
        if self._pending is not None:
            self._pending.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
