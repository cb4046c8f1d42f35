"""overlap-stream: overlap, and the finished groups' work in the decode tail (schedule.stream_groups).

In a synchronous GRPO step, a group whose n samples have all finished needs
nothing from the groups still decoding for:
  reward   - its samples' scores (and so its advantages: normalised within the group);
  ref, old - its reference and recomputed old logprobs: suffix passes over its
             chunk's kept prompt (rollplex.rl.prompt_work) once that prompt item is
             done;
  update   - the actor's forward and backward over it, for the first optimizer
             step's groups (`Actor.start_update`): gradients accumulate, and the
             loss normaliser, global over the step's batch, is applied after
             decode once every group is in (the loss is linear in it).
The engine reports each group as its last sample finishes (`on_finished`).
`between_steps` then scores it: at once with an in-process reward, or in the
reward's worker processes, which a thread of ours waits for while decode goes
on. Once its scores are in, its model passes are queued; they run after the
step's prompt-work slices, one per step at a full decode batch and more as the batch
empties, as the prompt-work slices do. On CUDA they go on the prompt work's side stream,
and only while fewer than `SideStreamBacklog.limit` of the passes issued are
unfinished there: nothing else holds the host back from issuing them faster
than the side stream runs them, and the decode steps would compete with the
queue. A logprob pass streams only where its chunk's prompt item was kept: for
an item deferred by the budget or dropped for memory it would be a full pass,
outside the budget, that reads values back and copies to the device blocking
between two decode steps; such groups' passes, and the update that reads their
logprobs, are left to the loop's phases. They run what the window does not
finish, after it, through the same functions: what the window does goes into
the step's state (rollplex.rl.step.StepState), which the phases after decode
complete. The host time `between_steps` takes counts in
timing_s/decode_slowdown beside the prompt-work slices'.

No streamed pass may issue a collective: each dp rank finishes its groups in its
own order, so collectives would not line up; on CPU every pass runs under
`no_collectives` (rollplex.dist), which raises at one. A pass streams only
where its model is whole on this rank during rollout: the actor's when parallel.tp and parallel.ep
are 1 (every FSDP unit is gathered for the engine and stays so through backward,
rollplex.rl.weights), the reference model's when it is not sharded (one dp
rank) or when holding it gathered through the window fits the prefix budget
left after the prompt items (`MemoryPlan.gathered_ref_bytes`; `StreamPlan`
decides, the same on every rank). The streamed update keeps FSDP from
reducing gradients until the prompt's backward after rollout, which reduces
them all at once. It is admitted when its gradients and one micro-batch fit the prefix budget left after the
prompt items (`MemoryPlan.streamed_update_bytes`), the same on every rank, since
the update's collectives after rollout depend on it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rollplex.config import Config
from rollplex.data.reward_scoring import RewardScorer, RewardScores
from rollplex.dist import no_collectives
from rollplex.engine import Request
from rollplex.models.inputs import Group
from rollplex.models.protocol import VisionLanguageModel
from rollplex.rl.prompt_work import PromptWorkScheduler, update_chunks
from rollplex.rl.schedules.base import DecodeWindow
from rollplex.rl.schedules.overlap import Overlap
from rollplex.rl.schedules.prompt_items import PromptKind
from rollplex.rl.rollout import response_text
from rollplex.rl.step import StepState, StreamReport, norm_by_std, score_groups
from rollplex.train.actor import Actor, PolicyBatch
from rollplex.train.kept_prefix import KeptPrefix
from rollplex.train.loss import group_advantages
from rollplex.train.parallelize import fsdp_units, hold_gathered, release_gathered

if TYPE_CHECKING:
    from rollplex.rl.loop import RLTrainer


@dataclass(frozen=True)
class StreamPlan:
    """Which of a step's finished-group passes may stream on this rank's layout."""

    ref: bool  # the reference model's logprobs (kl_coef > 0, the model whole on this rank)
    old: bool  # recomputed old logprobs (the actor whole on this rank)
    update: bool  # the first optimizer step's forward and backward (and it fits the budget)
    gather_ref: bool = False  # the reference model held gathered through the window (dp_shard > 1), for `ref`

    @classmethod
    def of(cls, cfg: Config, dp_shard: int, prefix: PromptWorkScheduler, update_bytes: int,
           gathered_ref_bytes: int) -> StreamPlan:
        """What streams, the same on every dp rank (the prefix budget is agreed): the
        passes that issue no collective. The actor's units are gathered for the engine
        (at parallel.tp 1); the reference model's are too when it is not sharded, or when
        holding them gathered fits the budget the prompt items leave. The update streams
        where its gradients and a micro-batch fit what is left after that."""
        # Under expert parallelism a forward sends its tokens to the ranks holding their experts (all-to-alls).
        a, whole = cfg.algorithm, cfg.parallel.tp == 1 and cfg.parallel.ep == 1
        left = prefix.budget_left

        def fits(size: int) -> bool:
            return left is None or size <= left

        gather_ref = a.kl_coef > 0 and whole and dp_shard > 1 and fits(gathered_ref_bytes)
        ref = a.kl_coef > 0 and whole and (dp_shard == 1 or gather_ref)
        kept_actor = any(w.kind == PromptKind.ACTOR for w in prefix.admitted)
        update_fits = fits(update_bytes + (gathered_ref_bytes if gather_ref else 0))
        # The update's loss reads the group's reference logprobs (kl_coef > 0): they must stream too.
        return cls(ref=ref, old=a.recompute_old_logprobs and whole,
                   update=whole and kept_actor and update_fits and (ref or a.kl_coef == 0), gather_ref=gather_ref)


class SideStreamBacklog:
    """The passes issued on the side stream and not finished yet, by their end events
    (`query()` does not block): room for another while fewer than `limit` are unfinished.
    Two keep the side stream busy (one running, one queued behind it) without a queue
    that the decode steps would compete with."""

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._unfinished: list[torch.cuda.Event] = []

    def issued(self, end: torch.cuda.Event) -> None:
        self._unfinished.append(end)

    def has_room(self) -> bool:
        self._unfinished = [end for end in self._unfinished if not end.query()]
        return len(self._unfinished) < self.limit


@dataclass
class GroupStream:
    """A step's finished groups and the work done on them in the decode window."""

    cfg: Config
    state: StepState  # what the window does goes here: the loop's phases do the rest
    tokenizer: object
    scorer: RewardScorer
    actor: Actor
    ref_model: VisionLanguageModel | None
    plan: StreamPlan
    max_passes_per_step: int = 8
    backlog: SideStreamBacklog = field(default_factory=SideStreamBacklog)  # stays empty on CPU: passes run inline
    advantages: dict[int, list[float]] = field(default_factory=dict)  # of the groups whose update streams
    report: StreamReport = field(default_factory=StreamReport)
    finished: dict[int, Group] = field(default_factory=dict)
    _new: list[int] = field(default_factory=list)
    _passes: list[tuple[str, int]] = field(default_factory=list)  # (kind, group) waiting
    _peak_running: int = 0
    _waited: bool = False
    _pass_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    _scoring: dict[int, Future] = field(default_factory=dict)  # groups whose scores the reward workers compute

    def __post_init__(self):
        self.state.stream = self.report
        self.chunks = update_chunks(len(self.state.examples), self.cfg.algorithm.updates_per_batch)
        self.prefix = self.state.prompt_work
        self.side_stream = self.prefix.side_stream  # None on CPU: the passes run inline
        if self.plan.update:  # on every dp rank alike, whether or not its groups finish in the window
            self.state.update = self.actor.start_update()
        if self.plan.gather_ref:  # a collective, on every dp rank alike
            hold_gathered(fsdp_units(self.ref_model))
        # Rewards in worker processes are waited for in a thread of ours, so that the decode loop never
        # waits for them; an in-process reward runs inline (it would hold the interpreter anyway, and
        # math-verify's time limit needs the main thread).
        self._scorer_thread = ThreadPoolExecutor(1, "rollplex-reward") if self.scorer.workers else None

    def on_finished(self, index: int, group: Group) -> None:
        """The engine's report: every sample of group `index` has finished."""
        self.finished[index] = group
        self._new.append(index)

    def between_steps(self, running: int) -> None:
        """Score the groups that finished in the last step (or have them scored), take the
        scores that are in, then issue the queued passes that are ready, as many as the
        decode batch leaves room for and the side stream's backlog takes."""
        start = time.perf_counter()
        self._score_finished()
        self._issue_ready_passes(running)
        self.report.decode_delay += time.perf_counter() - start

    def _score_finished(self) -> None:
        for g in self._new:
            if self._scorer_thread is None:
                self._take_scores(g, *self._score(g))
            else:
                self._scoring[g] = self._scorer_thread.submit(self._score, g)
        self._new = []
        for g, scoring in list(self._scoring.items()):
            if scoring.done():
                self._take_scores(g, *self._scoring.pop(g).result())

    def _issue_ready_passes(self, running: int) -> None:
        self._peak_running = max(self._peak_running, running)
        free = 1.0 - running / self._peak_running if self._peak_running else 1.0
        budget = 1 + int((self.max_passes_per_step - 1) * free)
        while budget and self.backlog.has_room() and (job := next((j for j in self._passes if self._ready(*j)), None)):
            self._passes.remove(job)
            budget -= 1
            job_start = time.perf_counter()
            end = self._issue(*job)
            if end is not None:
                self.backlog.issued(end)
            self.report.done[job[0]] += 1
            self.report.spans.append((f"group {job[0]}", job_start, time.perf_counter()))

    def _issue(self, kind: str, g: int) -> torch.cuda.Event | None:
        """Run a pass inline (on CPU: None), or issue it on the side stream: its end event."""
        if self.side_stream is None:
            start = time.perf_counter()
            with no_collectives(f"the decode window's {kind} pass of group {g}"):
                self._run(kind, g)
            self.report.hidden += time.perf_counter() - start
            return None
        if not self._waited:  # once: the caller's stream made the inputs (gathered weights, cached vision)
            self.side_stream.wait_stream(torch.cuda.current_stream(self.side_stream.device))
            self._waited = True
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.side_stream):
            events[0].record()
            self._run(kind, g)
            events[1].record()
        self._pass_events.append(events)
        return events[1]

    def join(self) -> None:
        """After decode: the scores still being computed are taken, the caller's stream
        waits for the streamed passes, and their logprobs come to the host."""
        for g, scoring in self._scoring.items():
            self._take_scores(g, *scoring.result(), queue_passes=False)  # the loop runs the passes now
        self._scoring.clear()
        if self._scorer_thread is not None:
            self._scorer_thread.shutdown()
        if self.plan.gather_ref:
            release_gathered(fsdp_units(self.ref_model))
        if self.side_stream is not None:
            main = torch.cuda.current_stream(self.side_stream.device)
            main.wait_stream(self.side_stream)
            self.side_stream.synchronize()  # done already: the prefix drain waited for this stream
            self.report.hidden += sum(a.elapsed_time(b) for a, b in self._pass_events) / 1e3
            # Made on the side stream, used and freed on the caller's from here on.
            for p in self.actor.model.parameters():
                if p.grad is not None:
                    p.grad.record_stream(main)
        for done in (self.state.ref, self.state.old):
            for g, logprobs in done.items():
                done[g] = [lp.cpu() for lp in logprobs]

    def _score(self, g: int) -> tuple[RewardScores, float, float]:
        """Group `g`'s scores, and when scoring started and ended (time.perf_counter)."""
        start, group = time.perf_counter(), self.finished[g]
        texts = self.state.texts[g] = [response_text(self.tokenizer, s) for s in group.samples]
        return score_groups(self.scorer, [self.state.examples[g]], [group], texts, warn=False), start, time.perf_counter()

    def _take_scores(self, g: int, scores: RewardScores, start: float, end: float, queue_passes: bool = True) -> None:
        self.state.scores[g] = scores
        self.report.done["scored"] += 1
        self.report.hidden += end - start
        self.report.spans.append(("group reward", start, end))
        if not queue_passes:
            return
        update = self.plan.update and g < self.chunks[0].stop
        self._passes += [(kind, g) for kind, wanted in (("ref", self.plan.ref), ("old", self.plan.old),
                                                        ("update", update)) if wanted]
        if update:  # on the host, here: the pass itself only launches device work
            self.advantages[g] = group_advantages(torch.tensor(scores.scores), torch.zeros(len(scores.scores)),
                                                  norm_by_std=norm_by_std(self.cfg)).tolist()

    # ------------------------------------------------------------------ the passes

    def _chunk(self, g: int) -> int:
        return next(c for c, s in enumerate(self.chunks) if s.start <= g < s.stop)

    def _kept(self, kind: str, c: int) -> KeptPrefix | None:
        """Chunk `c`'s kept prompt that a `kind` logprob pass reads: None until its item is
        done, and for good where the item was deferred or dropped."""
        kinds = (PromptKind.REF,) if kind == "ref" else (PromptKind.ACTOR, PromptKind.OLD)
        return next((k for k in (self.prefix.result(k, c) for k in kinds) if k is not None), None)

    def _ready(self, kind: str, g: int) -> bool:
        """Whether what the pass reads is there. Where a chunk's kept prompt never comes (its
        item deferred or dropped), its groups' logprob passes, and their updates, never are:
        the loop's phases run them after decode."""
        if kind != "update":
            return self._kept(kind, self._chunk(g)) is not None
        return ((not self.plan.ref or g in self.state.ref) and (not self.plan.old or g in self.state.old)
                and self.prefix.result(PromptKind.ACTOR, 0) is not None)

    def _run(self, kind: str, g: int) -> None:
        c = self._chunk(g)
        position = g - self.chunks[c].start
        if kind == "update":
            self._add_to_update(g, position)
            return
        model = self.ref_model if kind == "ref" else self.actor.model
        logprobs = self.actor.logprobs(model, [self.finished[g]], self._kept(kind, c), positions=[position],
                                       agree=False, to_host=False)
        (self.state.ref if kind == "ref" else self.state.old)[g] = logprobs

    def _add_to_update(self, g: int, position: int) -> None:
        kept = self.prefix.result(PromptKind.ACTOR, 0)
        group = self.finished[g]
        rollout_logprobs = [torch.tensor(s.logprobs) for s in group.samples]
        self.state.update.add_group(PolicyBatch([group], self.advantages[g], self.state.old.get(g, rollout_logprobs),
                                                self.state.ref.get(g), rollout_logprobs, kept), position)


class OverlapStream(Overlap):
    """overlap, with each finished group's reward, logprob passes and (first optimizer
    step's groups) update in the decode tail (the module docstring)."""

    name = "overlap-stream"

    def before_decode(self, trainer: RLTrainer, state: StepState) -> tuple[list[Request], DecodeWindow | None]:
        requests, window = super().before_decode(trainer, state)
        plan = StreamPlan.of(self.cfg, trainer.dims.dp_shard, state.prompt_work,
                             trainer.memory.streamed_update_bytes(), trainer.memory.gathered_ref_bytes())
        self._stream = GroupStream(self.cfg, state, trainer.tokenizer, trainer.reward_scorer, trainer.actor,
                                   trainer.ref_model, plan)

        def between_steps(running: int) -> None:  # the prompt work's slices, then the finished groups' passes
            window.between_steps(running)
            self._stream.between_steps(running)
        return requests, DecodeWindow(between_steps, self._stream.on_finished)

    def after_decode(self, trainer: RLTrainer, state: StepState) -> None:
        super().after_decode(trainer, state)
        self._stream.join()
        self._stream = None
