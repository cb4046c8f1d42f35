"""Prompt work: the response-independent part of a step's training passes,
computed once per prompt, in the rollout's decode window.

A step's prompts are cut into chunks (the mini-batches of its optimizer
steps). Per chunk the work items (`PromptKind`) are:
  ref   - the reference model's prompt forward, K/V kept (no grad);
  actor - the actor's prompt forward with its autograd graph kept, for the
          chunk of the first optimizer step (later chunks train on weights that
          do not exist yet during rollout, so they take the serial path);
  old   - the actor's prompt forward without graph, for recomputed old
          logprobs of later chunks (the first chunk's old logprobs read the
          actor item's K/V: same weights, detached).
Vision features are encoded once per prompt before rollout; the engine's
prefill and every item whose tower weights equal the rollout's and needs no
gradient into the tower read them (`PromptWorkPlanner`).

`PromptWorkScheduler` runs the items one slice (vision tower, embedding, one
decoder layer, ...) at a time between the engine's steps, more slices per
step as the decode batch shrinks in the long tail. On CUDA the slices run on a
low-priority side stream, so the decode steps (CUDA graphs on the engine's
high-priority decode stream) keep the GPU first; the side stream waits for the
stream the scheduler was made on (its inputs: gathered weights, cached vision,
prepared chunks) before its first slice, and that stream waits for the side
stream before the suffix passes. On CPU the same slices run inline between the
steps. Items are admitted in order while their estimated state fits the byte
budget (rollplex.rl.memory: the memory plan sizes the budget and counts the
same estimates); the rest are deferred to the serial path, which gives the same
results.
An item that runs out of memory all the same is dropped and takes the serial
path too, when its forward issues no collectives (else its peers would wait
for it).

A slice must never make the host wait for the GPU: the decode loop issues it
between two steps, and a wait would hold the next decode step behind the slices
queued before it. So the scheduler prepares every admitted item's device
tensors when it is made, before decode (`prepare_prompts`), and the slices
read nothing back and copy nothing to the device (tests/test_prefix_sync.py).

The side stream is the trainer's, one for its lifetime: the caching allocator
keeps freed blocks for reuse on the stream that allocated them, so a new stream
per step would strand each step's prefix memory in the cache.

Every dp rank runs the same items (one per chunk and kind) with the same
slices, so the collectives inside them (FSDP gathers of the reference model)
line up across ranks. Side-stream collectives need process groups of their
own, so that the two streams' NCCL calls never meet on one communicator in an
order that can differ between ranks: the reference model's FSDP gathers use
the dp group, which decode does not use, and the engine's model has TP groups
of its own (rollplex.rl.weights), apart from the trainer's that the prompt
forwards use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from rollplex.dist import all_reduce_values
from rollplex.models.inputs import Group, Prompt, VisionEmbeds
from rollplex.models.protocol import VisionLanguageModel
from rollplex.rl.memory import MemoryPlan, admitted, kept_prompt_state
from rollplex.rl.schedules.prompt_items import PromptKind
from rollplex.train import routes as route_layouts
from rollplex.train.kept_prefix import KeptPrefix, PromptChunk, prepare_prompts, prompt_forward
from rollplex.train.routes import RouteMode, routes_of


@dataclass
class PromptWork:
    """One prompt forward of one chunk of prompts, run in slices."""

    kind: PromptKind
    chunk: int
    model: VisionLanguageModel
    prompts: list[Prompt]
    vision: VisionEmbeds | None  # cached features of the prompts, or None: the item runs the tower
    keep_graph: bool
    estimate: int  # bytes it keeps until its suffix passes: rollplex.rl.memory.kept_prompt_state, as the plan counts
    # Whether an out-of-memory error in this item may drop it on this rank alone: only when its forward
    # issues no collectives (a peer would wait in one forever otherwise).
    may_drop_alone: bool = True
    groups: slice = field(default_factory=lambda: slice(0))  # its prompts' groups among the step's (their routes, for routing replay)
    result: KeptPrefix | None = None
    inputs: PromptChunk | None = field(default=None, repr=False)  # from prepare()
    _slices: Iterator[KeptPrefix | None] | None = field(default=None, repr=False)

    def prepare(self) -> None:
        """Build the device tensors the slices read (before the decode window)."""
        self.inputs = prepare_prompts(self.model, self.prompts, self.vision)

    def advance(self) -> bool:
        """Run the next slice (after `prepare`); True once the item is done."""
        if self._slices is None:
            self._slices = prompt_forward(self.model, self.inputs)
        with torch.set_grad_enabled(self.keep_graph):
            out = next(self._slices)
        if out is not None:
            self.result = out.boundary() if self.keep_graph else out
            self._slices = None
        return out is not None


@dataclass
class PromptWorkTiming:
    hidden: float = 0.0  # prompt work done inside the decode window
    exposed: float = 0.0  # prompt work left after decode
    # Host time the decode loop spent issuing prompt-work slices (timing_s/decode_slowdown: the loop adds the
    # finished groups' work, rollplex.rl.step.StreamReport.decode_delay).
    decode_delay: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        total = self.hidden + self.exposed
        return {"timing_s/prefix_hidden": self.hidden, "timing_s/prefix_exposed": self.exposed,
                "timing_s/decode_slowdown": self.decode_delay,
                "perf/overlap_efficiency": self.hidden / total if total > 0 else 0.0}


class PromptWorkScheduler:
    """Runs admitted prompt work in slices between decode steps (see the module docstring)."""

    def __init__(self, items: list[PromptWork], budget_bytes: int | None,
                 side_stream: torch.cuda.Stream | None = None, max_slices_per_step: int = 8):
        """`side_stream`: the trainer's low-priority stream for the slices; None runs them inline
        (on CPU)."""
        fits = admitted([item.estimate for item in items], budget_bytes)  # the memory plan's rule
        self.admitted = [item for item, ok in zip(items, fits) if ok]
        self.deferred = [item for item, ok in zip(items, fits) if not ok]
        self.planned_bytes = sum(item.estimate for item in self.admitted)
        self.budget_left = None if budget_bytes is None else budget_bytes - self.planned_bytes
        for item in self.admitted:
            item.prepare()
        self.queue = list(self.admitted)
        self.max_slices = max_slices_per_step
        self.peak_running = 0
        self.timing = PromptWorkTiming()
        self.cuda = side_stream is not None
        self.side_stream = side_stream
        # Where the inputs were made (and the suffix passes will run): the caller's stream, not the engine's
        # decode stream, which orders itself against the caller's stream at each step.
        self.main_stream = torch.cuda.current_stream(side_stream.device) if self.cuda else None
        self.slice_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.started = False
        # Host-side timeline (time.perf_counter): each slice as (kind, start, end), and when each engine step
        # handed over. On CUDA these are issue times; the profiler's trace shows the streams themselves.
        self.spans: list[tuple[str, float, float]] = []
        self.step_ends: list[float] = []
        self.dropped_for_memory = 0  # items that ran out of memory and took the serial path

    def result(self, kind: PromptKind, chunk: int) -> KeptPrefix | None:
        return next((w.result for w in self.admitted if w.kind == kind and w.chunk == chunk), None)

    def replay_routes(self, groups: list[Group], routing_replay: str) -> None:
        """Before the items run (after the rollout: serial-prefix), give each item that replays
        routes (rollplex.train.routes.routes_of: its forward is the old pass's prompt, or the
        reference's) its prompts' routes from `groups`, the step's groups."""
        for item in self.admitted:
            if routes_of(routing_replay, _PASS_OF[item.kind]) is RouteMode.REPLAY:
                item.inputs.routes = route_layouts.prompts(groups[item.groups])

    def record_routes(self, groups: list[Group], routing_replay: str) -> None:
        """After the items ran, store the prompt routes of each item that records them (R2's old pass)
        in its groups' samples."""
        for item in self.admitted:
            if routes_of(routing_replay, _PASS_OF[item.kind]) is RouteMode.RECORD and item.result is not None:
                route_layouts.store_prompts(groups[item.groups], item.result.routing)

    def between_steps(self, running: int) -> None:
        """Called by the engine after each step: a slice at full decode batch, up
        to `max_slices` as the batch empties."""
        self.peak_running = max(self.peak_running, running)
        free = 1.0 - running / self.peak_running if self.peak_running else 1.0
        start = time.perf_counter()
        self.step_ends.append(start)
        self._run(1 + int((self.max_slices - 1) * free))
        elapsed = time.perf_counter() - start
        self.timing.decode_delay += elapsed
        if not self.cuda:
            self.timing.hidden += elapsed

    def drain(self) -> None:
        """Finish what the decode window left (exposed time), then make the main
        stream wait for the side stream before the suffix passes."""
        start = time.perf_counter()
        self._run(None)
        if self.cuda:
            self.main_stream.wait_stream(self.side_stream)
            self.side_stream.synchronize()
            side = sum(a.elapsed_time(b) for a, b in self.slice_events) / 1e3
            exposed = time.perf_counter() - start
            self.timing.exposed = exposed
            self.timing.hidden = max(0.0, side - exposed)
        else:
            self.timing.exposed += time.perf_counter() - start
        # Made on the main stream, so freed only once it has waited for the slices that read them.
        for item in self.admitted + self.deferred:
            item.inputs = None

    def _run(self, slices: int | None) -> None:
        if not self.queue:
            return
        if self.cuda:
            if not self.started:  # inputs (gathered weights, cached vision) come from the main stream
                self.side_stream.wait_stream(self.main_stream)
                self.started = True
            with torch.cuda.stream(self.side_stream):
                self._advance(slices)
        else:
            self._advance(slices)

    def _drop(self, item: PromptWork) -> None:
        """Free an item's partial state and hand it to the serial path (same results)."""
        item._slices, item.result = None, None
        self.queue.remove(item)
        self.admitted.remove(item)
        self.deferred.append(item)
        self.dropped_for_memory += 1
        if self.cuda:
            torch.cuda.empty_cache()

    def _advance(self, slices: int | None) -> None:
        done = 0
        while self.queue and (slices is None or done < slices):
            item = self.queue[0]
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            host_start = time.perf_counter()
            try:
                finished = item.advance()
            except torch.OutOfMemoryError:
                if not item.may_drop_alone:
                    raise
                self._drop(item)  # more than the estimate: this item takes the serial path instead
                continue
            self.spans.append((item.kind, host_start, time.perf_counter()))
            if self.cuda:
                end.record()
                self.slice_events.append((start, end))
            done += 1
            if finished:
                self.queue.pop(0)
                if self.cuda:  # the result is read on the main stream after the join
                    for t in item.result.tensors():
                        t.record_stream(self.main_stream)


# The pass whose prompt each kind of item computes: the actor item's forward is the first chunk's old pass's too.
_PASS_OF = {PromptKind.REF: "ref", PromptKind.OLD: "old", PromptKind.ACTOR: "old"}


def update_chunks(n_groups: int, updates: int) -> list[slice]:
    """The groups of each of a batch's `updates` optimizer steps (contiguous, as even as possible)."""
    return [slice(i * n_groups // updates, (i + 1) * n_groups // updates) for i in range(updates)]


@dataclass
class PromptWorkPlanner:
    """A step's prompt work as the memory plan counts it: the items the schedule
    declares (rollplex.rl.schedules.prompt_items), each with the plan's estimate of the state it
    keeps, and the byte budget the scheduler admits them by."""

    plan: MemoryPlan
    actor: VisionLanguageModel
    ref: VisionLanguageModel | None  # the reference model (kl_coef > 0)
    tp: int  # the trainer's
    dp_shard: int
    dp_group: dist.ProcessGroup | None
    side_stream: torch.cuda.Stream | None  # the trainer's (module docstring); None on CPU
    ep: int = 1  # parallel.ep: above 1 an MoE forward all-to-alls its tokens over the ep group

    def work(self, prompts: list[Prompt], vision: list[VisionEmbeds | None]) -> list[PromptWork]:
        """The step's items for `prompts`, with their cached vision features (None: not encoded)."""
        options, tp = self.plan.options, self.tp
        chunks = update_chunks(len(prompts), options.updates_per_batch)
        items = []
        for spec in self.plan.prompt_items:  # the schedule's (rollplex.rl.schedules.prompt_items), as counted
            chunk = chunks[spec.chunk]
            if chunk.start == chunk.stop:
                continue
            ps = prompts[chunk]
            patches = sum(t.shape[0] for p in ps for t in (p.pixel_values, p.pixel_values_videos) if t is not None)
            estimate = kept_prompt_state(self.actor.args, spec, len(ps), sum(len(p.input_ids) for p in ps), patches,
                                    options, tp).total
            # Collectives in its passes: TP all-reduces; expert parallelism's all-to-alls; with dp_shard > 1,
            # the sharded reference model's FSDP gathers in its forward, and the actor item's in the prompt's
            # backward after rollout (a rank without the item would not run it).
            alone = tp == 1 and self.ep == 1 and (self.dp_shard == 1 or spec.kind == PromptKind.OLD)
            model = self.ref if spec.kind == PromptKind.REF else self.actor
            items.append(PromptWork(spec.kind, spec.chunk, model, ps,
                                    VisionEmbeds.concat(vision[chunk]) if spec.reuses_vision else None,
                                    spec.keep_graph, estimate, may_drop_alone=alone, groups=chunk))
        return items

    def scheduler(self, items: list[PromptWork], pool_bytes: int) -> PromptWorkScheduler:
        """The step's scheduler for `items`, beside a KV pool of `pool_bytes`."""
        return PromptWorkScheduler(items, self.budget(items, pool_bytes), self.side_stream)

    def budget(self, items: list[PromptWork], pool_bytes: int) -> int:
        """The step's prefix budget: the memory plan's beside this rank's KV pool.
        Every dp rank must admit the same items, or their collectives (the reference
        model's FSDP gathers) would not line up: the items take the largest estimate
        of any rank, and the budget is the smallest."""
        budget = self.plan.sizes.prefix_budget_for(pool_bytes)
        if self.dp_shard == 1:
            return budget
        # One collective: min = -max(-x).
        *estimates, least_budget = all_reduce_values([w.estimate for w in items] + [-budget], dist.ReduceOp.MAX,
                                                     self.dp_group)
        for item, estimate in zip(items, estimates):
            item.estimate = int(estimate)
        return int(-least_budget)
