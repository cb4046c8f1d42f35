"""Memory measured on CPU, where torch keeps no allocator statistics: the bytes
the process's tensors hold, and each phase's peak within a step."""

from __future__ import annotations

import gc
import warnings
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the process still references."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on some of gc's objects trips torch's deprecation shims
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        # A DTensor (FSDP's sharded parameters) has no storage of its own; gc finds its local tensor. Nor has
        # a fake tensor, which torch.compile's caches keep alive (compiled FlexAttention): it holds no memory.
        if t.device.type != "meta" and not isinstance(t, DTensor) and not is_fake(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


PHASE_MARK = "rollplex/phase/"


class CpuPhasePeaks:
    """Each phase's peak of live tensor bytes on CPU, where torch keeps no
    allocator statistics: the counterpart of torch.cuda.max_memory_allocated.

    A step runs under the torch profiler with memory events (every allocation
    and free of torch's CPU allocator, in time order); the loop marks its phases
    with `record_function(PHASE_MARK + name)`. The level at the first step's
    start is counted from the tensors the process references
    (`live_tensor_bytes`); each later step starts where the previous one ended.
    The profiler makes a step about 3x slower."""

    def __init__(self):
        self.level: int | None = None

    @contextmanager
    def step(self) -> Iterator[dict[str, int]]:
        """Profile one step; the yielded dict holds each phase's peak bytes once the step is done."""
        if self.level is None:
            self.level = live_tensor_bytes()
        peaks: dict[str, int] = {}
        # One cycle per step; acc_events only keeps torch 2.11 from warning that cycles drop events.
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True) as prof:
            yield peaks
        phases, changes = [], []
        for e in prof.profiler.kineto_results.events():
            if e.name() == "[memory]":
                changes.append((e.start_ns(), e.nbytes()))
            elif e.name().startswith(PHASE_MARK):
                phases.append((e.name()[len(PHASE_MARK):], e.start_ns(), e.start_ns() + e.duration_ns()))
        changes.sort()
        times = [t for t, _ in changes]
        levels = list(accumulate((n for _, n in changes), initial=self.level))  # [i]: after i changes
        for name, start, end in phases:
            first, last = bisect_left(times, start), bisect_right(times, end)
            peaks[name] = max(peaks.get(name, 0), *levels[first:last + 1])
        self.level = levels[-1]
