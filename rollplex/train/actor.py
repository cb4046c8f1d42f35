"""The actor side: per-token logprob passes and the policy update over packed GRPO groups.

Micro-batches are cut by a token budget (`max_tokens_per_micro_batch`): a
group's prompt plus its responses when prompts are shared, prompt + response per
sample otherwise. A group too large for the budget is split into sub-groups of
its responses (its prompt is then computed once per sub-group). Every dp rank
runs the same number of micro-batches, because each one is a round of FSDP
collectives; a rank with too little work runs a zero-weight repeat.

A multi-turn sample's observation tokens (its tools' answers) are computed in
every pass and count in its budget, but the loss, KL, entropy, clip fractions,
the rollout/trainer probability difference, the MoE auxiliary loss and every
normaliser count only the tokens the policy sampled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rollplex.device import to_device
from rollplex.dist import all_reduce_values
from rollplex.models.inputs import Group, VisionEmbeds
from rollplex.models.moe import Routing, moe_args
from rollplex.models.packing import TrainBatch, pack_groups
from rollplex.models.protocol import VisionLanguageModel
from rollplex.train.flops import forward_flops, suffix_flops
from rollplex.train.kept_prefix import KeptPrefix, SuffixUnit, suffix_hidden
from rollplex.train.logprob_head import token_logprobs
from rollplex.train.loss import agg_loss, kl_penalty, policy_loss
from rollplex.train.optim import OptimizerOffload, global_grad_norm
from rollplex.train import routes as route_layouts
from rollplex.train.routes import RouteMode, routes_of

if TYPE_CHECKING:
    from rollplex.config import Config


def response_logprobs(model: VisionLanguageModel, batch: TrainBatch, vision: VisionEmbeds | None = None,
                      with_entropy: bool = False, temperature: float = 1.0,
                      routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob (float32) of every response token of the batch, flat in target
    order, and optionally the entropy of each predicting distribution, both at
    `temperature` (token_logprobs). Logits are computed only at the positions
    that predict a response token. An MoE model's layers route through `routing`
    (rollplex.models.moe) when given."""
    hidden = model.forward_packed(batch.packed, vision, routing)
    return token_logprobs(model, hidden[batch.target_index], batch.target_ids, with_entropy, temperature)


class TooManySkippedSteps(RuntimeError):
    """trainer.max_skipped_steps optimizer steps in a row were skipped for non-finite values: the run stops
    before it saves the step (rollplex.rl.loop), so its last checkpoint holds the last good weights."""


@dataclass
class PolicyBatch:
    """What one policy update needs, per response in group order."""

    groups: list[Group]
    advantages: list[float]
    old_logprobs: list[torch.Tensor]
    ref_logprobs: list[torch.Tensor] | None = None
    rollout_logprobs: list[torch.Tensor] | None = None
    kept: KeptPrefix | None = None  # the groups' prompts, computed earlier with their graph (KeptPrefix.boundary)
    # The model holds the weights that sampled the rollout (no optimizer step since): the update's own pass
    # then measures the engine/trainer mismatch (training/rollout_probs_diff_*) with no policy drift in it.
    rollout_weights: bool = True


@dataclass
class ActorConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # 0: no clipping (the norm is still reported)
    max_tokens_per_micro_batch: int = 8192
    share_prefix: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float = 0.0
    temperature: float = 1.0  # the rollout's sampling temperature (> 0): every logprob pass divides the logits by it
    max_response_len: int = 256  # the generation limit, for seq-mean-token-sum-norm
    offload_optimizer: bool = False  # keep AdamW's state in host memory except during the step
    routing_replay: str = "none"  # MoE models: algorithm.routing_replay (rollplex.train.routes.routes_of)
    moe_aux_loss_coef: float = -1.0  # MoE models: the load-balancing loss's weight; -1: the checkpoint's

    @classmethod
    def from_config(cls, cfg: Config, micro_batch_tokens: int) -> ActorConfig:
        """A run's actor: the optimizer of trainer.*, the objective of algorithm.*, and
        `micro_batch_tokens`, the budget the memory plan resolved (trainer.max_tokens_per_micro_batch
        or its own)."""
        a, t = cfg.algorithm, cfg.trainer
        return cls(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                   max_tokens_per_micro_batch=micro_batch_tokens, share_prefix=cfg.schedule.share_prefix,
                   clip_low=a.clip_low, clip_high=a.clip_high, clip_c=a.clip_c, loss_agg_mode=a.loss_agg_mode,
                   kl_coef=a.kl_coef, kl_kind=a.kl_kind, entropy_coef=a.entropy_coef, tis_cap=a.tis_cap,
                   # A greedy rollout (0) returns untempered logprobs (rollplex.engine.sampler): so does the trainer.
                   temperature=cfg.rollout.temperature or 1.0,
                   max_response_len=cfg.rollout.max_tokens, offload_optimizer=cfg.parallel.offload_optimizer,
                   routing_replay=a.routing_replay, moe_aux_loss_coef=a.moe_aux_loss_coef)


@dataclass
class _Unit:
    """A slice of a group (its prompt and some of its responses) with its response offsets."""

    group: Group
    first: int  # index of its first response in the batch's response order
    index: int  # index of its group in the batch
    shared_prompt: bool = True  # its pass computes the prompt once, else once per response

    @property
    def tokens(self) -> int:
        """The tokens its pass computes (a multi-turn response's observations included)."""
        prompts = 1 if self.shared_prompt else len(self.group.responses)
        return prompts * len(self.group.prompt.input_ids) + sum(len(r) for r in self.group.responses)


@dataclass
class LossNorm:
    """An optimizer step's global loss normalisers (rollplex.train.loss.agg_loss)."""

    global_tokens: float  # the tokens the policy sampled (not observations)
    global_seqs: float
    max_response_len: int

    def loss_divisor(self, agg: str) -> float:
        """What the loss aggregated with unit normalisers must be divided by to equal it normalised."""
        return self.global_tokens if agg == "token-mean" else self.global_seqs


class PolicyUpdate:
    """One optimizer step's forward and backward passes, micro-batch by micro-batch,
    with the metric sums, FLOPs and non-finite count they add up to.

    With `norm` None (a step started in the decode window, before its batch's
    response tokens are all known) each micro-batch's loss is aggregated with unit
    normalisers; `apply_norm` later divides the sums, and `grad_scale` the gradients,
    once: the loss is linear in 1 / normaliser (rollplex.train.loss.agg_loss). The
    same gradients up to the rounding of that one division."""

    def __init__(self, actor: Actor, kept: KeptPrefix | None, norm: LossNorm | None, measures_diff: bool):
        self.actor, self.kept, self.norm, self.measures_diff = actor, kept, norm, measures_diff
        # The sums stay on the device (float64, as Python floats were) until the step, which waits on them
        # anyway: a pass never reads a value back, so one streamed in the decode window never holds the host.
        zero = functools.partial(torch.zeros, (), dtype=torch.float64, device=actor.model.device)
        self.sums = {k: zero() for k in ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")}
        self.moe = MoEMetrics(actor.model.device) if moe_args(actor.model) is not None else None
        self.probs_diff_sum, self.probs_diff_max, self.flops = zero(), zero(), 0.0
        self.nonfinite = torch.zeros((), dtype=torch.long, device=actor.model.device)
        self.grad_scale = 1.0
        self.trained: set[int] = set()  # positions of the groups whose passes are in
        self.started_early = norm is None  # in the decode window (`Actor.start_update`)

    def add(self, units: list[_Unit], batch: PolicyBatch, weight: float) -> None:
        """Forward and backward over one micro-batch of `batch` (weight 0: a repeat that keeps
        the dp ranks' micro-batch counts equal)."""
        actor, cfg = self.actor, self.actor.config
        ids = _response_ids(units)
        lp, entropy, lens, pass_flops, routing = actor._pass(actor.model, units, self.kept, cfg.entropy_coef > 0,
                                                            routes=routes_of(cfg.routing_replay, "update"))
        self.flops += 3 * pass_flops  # forward + backward (2x)
        if weight:  # not the zero-weight repeat
            # Every token's, observations' too: the pass computed them all, and a non-finite one there comes from
            # non-finite logits, which poison the gradient as well.
            self.nonfinite += lp.detach().isfinite().logical_not().sum()
        norm = self.norm or LossNorm(1.0, 1.0, cfg.max_response_len)
        norms = dict(global_tokens=norm.global_tokens, global_seqs=norm.global_seqs,
                     max_response_len=norm.max_response_len)
        # Each term below counts the sampled tokens only: at observation tokens the old and rollout logprobs may be
        # the rollout's 0.0 placeholders, which the loss functions never read where the mask is False.
        mask = _sampled_mask(units, lp.device)
        pad = lambda xs: _pad([xs[i] for i in ids], mask)  # noqa: E731
        lp2d = _pad(list(lp.split(lens)), mask)
        adv = to_device([batch.advantages[i] for i in ids], lp.device)
        loss, m = policy_loss(lp2d, pad(batch.old_logprobs), adv, mask, cfg.clip_low, cfg.clip_high, cfg.clip_c,
                              cfg.loss_agg_mode, **norms,
                              rollout_logprobs=pad(batch.rollout_logprobs) if batch.rollout_logprobs else None,
                              tis_cap=cfg.tis_cap)
        self.sums["pg_loss"] += m.pg_loss.detach().double() * weight
        if cfg.kl_coef > 0:
            kl = agg_loss(kl_penalty(lp2d, pad(batch.ref_logprobs), cfg.kl_kind), mask, cfg.loss_agg_mode, **norms)
            loss = loss + cfg.kl_coef * kl
            self.sums["kl_loss"] += kl.detach().double() * weight
        if entropy is not None:
            ent = agg_loss(_pad(list(entropy.split(lens)), mask), mask, cfg.loss_agg_mode, **norms)
            loss = loss - cfg.entropy_coef * ent
            self.sums["entropy"] += ent.detach().double() * weight
        share = mask.sum().double() / norm.global_tokens * weight
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            self.sums[k] += getattr(m, k).detach().double() * share
        if self.moe is not None and weight:
            loss = loss + self.moe.add(routing, actor.aux_loss_coef, self._aux_share(mask, norm))
        if self.measures_diff and weight:
            diff = torch.where(mask, (lp2d.detach().exp() - pad(batch.rollout_logprobs).exp()).abs(), 0.0)
            self.probs_diff_sum += diff.sum().double() / norm.global_tokens
            self.probs_diff_max = torch.maximum(self.probs_diff_max, diff.max().double())
        # FSDP averages gradients over dp ranks; the losses are already globally normalised sums.
        (loss * weight * actor.dp_size).backward()

    def _aux_share(self, mask: torch.Tensor, norm: LossNorm) -> torch.Tensor:
        """A micro-batch's share of the step's MoE auxiliary loss: its response tokens' (token-mean) or
        responses' (the seq-mean modes) part of the step's, as its policy loss is normalised, so that a
        step started with unit normalisers (`apply_norm`) weighs it alike."""
        count = mask.sum() if self.actor.config.loss_agg_mode == "token-mean" else mask.any(-1).sum()
        return count.double() / norm.loss_divisor(self.actor.config.loss_agg_mode)

    def apply_norm(self, norm: LossNorm) -> None:
        """Normalise a step aggregated with unit normalisers: its sums now, its gradients
        (`grad_scale`) once they are all in."""
        divisor = norm.loss_divisor(self.actor.config.loss_agg_mode)
        for k in ("pg_loss", "kl_loss", "entropy"):
            self.sums[k] /= divisor
        if self.moe is not None:
            self.moe.aux_loss /= divisor
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            self.sums[k] /= norm.global_tokens
        self.probs_diff_sum /= norm.global_tokens
        self.norm, self.grad_scale = norm, 1.0 / divisor

    def add_group(self, group: PolicyBatch, position: int) -> None:
        """Add one finished group's passes (`group`: its responses' data, with the kept prompt
        of the step's chunk) to a started step (`Actor.start_update`); `position`: its index
        in the step's batch and kept prefix."""
        self.kept = group.kept
        for units in self.actor.micro_batches(group.groups, [position], agree=False):
            self.add(units, group, weight=1.0)
        self.trained.add(position)

    def finish(self, batch: PolicyBatch) -> dict[str, float]:
        """The step's remaining passes over `batch` (all of it, unless the step started in the
        decode window on the groups that finished first), then the optimizer step.

        The step is skipped (counted in skipped_steps) on every rank when any rank
        sees a non-finite loss or gradient, or a non-finite logprob in the batch's
        old or reference logprobs or in this update's own pass; `Actor.skip_cause`
        then says which, in the same words on every rank.

        Loss-like metrics (and the mean engine/trainer probability difference) are
        this rank's share of the global value: summed over dp ranks they give the
        batch's value. grad_norm, lr, skipped_steps_total and nonfinite_logprobs are
        global already, and rollout_probs_diff_max is this rank's maximum. The
        rollout_probs_diff metrics come only with rollout logprobs and the rollout's
        weights (PolicyBatch.rollout_weights)."""
        actor = self.actor
        actor.model.train()
        self.kept = batch.kept
        batches = actor.micro_batches(batch.groups, skip=frozenset(self.trained))
        if self.started_early and not batches:
            # FSDP prefetches in a backward by the order of the forwards since the last backward, which
            # the decode window's passes left different on each rank: one more backward (a zero-weight
            # repeat, on every rank alike) ends that history before the prompt's.
            batches = [[]]
        for i, mb in enumerate(batches):
            if self.started_early and batch.kept is None and i == len(batches) - 1:
                actor._sync_gradients()  # no prompt backward to reduce them: this last micro-batch's does
            self.add(mb or actor._fallback_units(batch.groups), batch, weight=1.0 if mb else 0.0)
            actor.on_micro_batch(i + 1, len(batches))
        if self.norm is None:  # started early: its normaliser is known now that every group is in
            self.apply_norm(actor._loss_norm(batch))
        flops = self.flops + (self._prompt_backward(batch.kept) if batch.kept is not None else 0.0)
        if self.grad_scale != 1.0:  # linear in the loss: the early step's normaliser, applied once
            torch._foreach_mul_([p.grad for p in actor.model.parameters() if p.grad is not None], self.grad_scale)
        nonfinite, cause = self._nonfinite_logprobs(batch)
        grad_norm = actor._clip_and_step(cause)
        metrics = {f"actor/{k}": v.item() for k, v in self.sums.items()}
        metrics["perf/actor_flops"] = flops
        if self.measures_diff:
            metrics["training/rollout_probs_diff_mean"] = self.probs_diff_sum.item()
            metrics["training/rollout_probs_diff_max"] = self.probs_diff_max.item()
        if self.moe is not None:
            replays = routes_of(actor.config.routing_replay, "update") is RouteMode.REPLAY
            metrics.update(self.moe.as_metrics(actor.dp_size, replays))
        metrics.update({"actor/grad_norm": grad_norm, "actor/lr": actor.lr_schedule.get_last_lr()[0],
                        "actor/skipped_steps_total": float(actor.skipped_steps),
                        "training/nonfinite_logprobs": nonfinite})
        return metrics

    def _nonfinite_logprobs(self, batch: PolicyBatch) -> tuple[float, str]:
        """The non-finite logprobs over every dp rank (this update's own pass, the batch's old and
        reference logprobs), and what they are as a skipped step's cause ("" when there are none)."""
        counts = [float(self.nonfinite.item()), count_nonfinite(batch.old_logprobs),
                  count_nonfinite(batch.ref_logprobs)]
        if self.actor.dp_size > 1:
            counts = all_reduce_values(counts, group=self.actor.dp_group)
        where = [f"{int(n)} in {what}" for n, what in zip(counts, ("the update's own pass", "the old logprobs",
                                                                   "the reference logprobs")) if n]
        return sum(counts), f"non-finite logprobs: {', '.join(where)}" if where else ""

    def _prompt_backward(self, kept: KeptPrefix) -> float:
        """The kept prompt's backward, which reduces the gradients (held by an early step until
        here); returns its FLOPs."""
        model = self.actor.model
        self.actor._sync_gradients()
        if isinstance(model, FSDPModule):
            # The prompt forward read the root unit's parameters (embedding, final norm, vision merger)
            # outside its FSDP hooks: gather them for the backward; FSDP's end-of-backward callback
            # reduces their gradients and reshards them.
            model.unshard()
        kept.backward_into_prompt()
        return 2 * kept.flops


class Actor:
    def __init__(self, model: VisionLanguageModel, config: ActorConfig, dp_group: dist.ProcessGroup | None = None,
                 lr_lambda=None):
        self.model, self.config, self.dp_group = model, config, dp_group
        params = [p for p in model.parameters() if p.requires_grad]
        # Fused on CPU too: the per-tensor loop took a third of the tiny demo's update (95 of 285 ms a step).
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or (lambda step: 1.0))
        self.skipped_steps = 0
        self.skipped_in_a_row = 0  # optimizer steps skipped since the last one taken (trainer.max_skipped_steps)
        self.skip_cause = ""  # why the latest optimizer step was skipped, the same on every rank; "" if it was taken
        self.offload = OptimizerOffload(self.optimizer) if config.offload_optimizer else None
        moe = moe_args(model)
        # -1: the checkpoint's router_aux_loss_coef (transformers adds it to the loss when asked for router logits).
        self.aux_loss_coef = (0.0 if moe is None else moe.router_aux_loss_coef if config.moe_aux_loss_coef < 0
                              else config.moe_aux_loss_coef)
        # Called with (done, total) after each micro-batch of an update or a logprob pass: the RL loop shows it
        # (rollplex.progress); a pass can run for minutes.
        self.on_micro_batch: Callable[[int, int], None] = lambda done, total: None

    @property
    def dp_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)

    # ------------------------------------------------------------------ micro-batches

    def micro_batches(self, groups: list[Group], positions: list[int] | None = None, skip: frozenset[int] = frozenset(),
                      agree: bool = True) -> list[list[_Unit]]:
        """The groups' units packed into micro-batches of at most the token budget. `positions`: each
        group's index in its kept prefix (default: its index in `groups`); groups at the positions in
        `skip` are left out (trained already, in the decode window). With `agree`, every dp rank gets as
        many micro-batches as the rank with the most (each is a round of FSDP collectives)."""
        budget = self.config.max_tokens_per_micro_batch
        units, first = [], 0
        for g, position in zip(groups, positions or range(len(groups))):
            if position not in skip:
                units += self._split_group(g, first, position, budget)
            first += len(g.responses)
        batches: list[list[_Unit]] = []
        tokens = budget + 1
        for u in units:
            if tokens + u.tokens > budget:
                batches.append([])
                tokens = 0
            batches[-1].append(u)
            tokens += u.tokens
        return self._same_count_on_all_ranks(batches) if agree else batches

    def _split_group(self, g: Group, first: int, index: int, budget: int) -> list[_Unit]:
        prompt = len(g.prompt.input_ids)
        per_sample = not self.config.share_prefix
        units, current, tokens = [], [], prompt
        for sample in g.samples:
            r = sample.token_ids
            need = len(r) + (prompt if per_sample else 0)
            if prompt + len(r) > budget:
                raise ValueError(f"max_tokens_per_micro_batch={budget} is smaller than one sequence: prompt "
                                 f"{prompt} + response {len(r)} = {prompt + len(r)} tokens")
            if current and tokens + need > budget:
                units.append(_Unit(Group(g.prompt, current), first, index, not per_sample))
                first += len(current)
                current, tokens = [], prompt
            current.append(sample)
            tokens += need
        units.append(_Unit(Group(g.prompt, current), first, index, not per_sample))
        return units

    def _same_count_on_all_ranks(self, batches: list[list[_Unit]]) -> list[list[_Unit]]:
        if self.dp_size == 1:
            return batches
        [count] = all_reduce_values([len(batches)], dist.ReduceOp.MAX, self.dp_group)
        # Split the largest micro-batches until the count matches; repeat one (at zero weight) if units run out.
        while len(batches) < count:
            batches.sort(key=lambda b: -sum(u.tokens for u in b))
            if batches and len(batches[0]) > 1:
                big = batches.pop(0)
                half = len(big) // 2
                batches += [big[:half], big[half:]]
            else:
                batches.append([])  # an empty micro-batch: runs the first unit again with zero weight
        return batches

    # ------------------------------------------------------------------ passes

    @torch.no_grad()
    def logprobs(self, model: VisionLanguageModel, groups: list[Group], kept: KeptPrefix | None = None,
                 positions: list[int] | None = None, skip: frozenset[int] = frozenset(), agree: bool = True,
                 to_host: bool = True, routes: RouteMode = RouteMode.LIVE) -> list[torch.Tensor | None]:
        """Per-response logprobs under `model` (the actor, or the reference model), None
        for the responses of groups at the positions in `skip`; suffix-only passes when the
        groups' prompts were kept by `model` (`positions`: their indices there, as
        `micro_batches` takes them). Without `agree` the passes issue no collective of
        their own (the decode window's: the model is whole on this rank then); without
        `to_host` the logprobs stay on the device, so that the host never waits for them. An MoE
        model's passes route as `routes` says (rollplex.train.routes)."""
        out: list[torch.Tensor | None] = [None] * sum(len(g.responses) for g in groups)
        batches = self.micro_batches(groups, positions, skip, agree)
        for done, mb in enumerate(batches, 1):
            units = mb or self._fallback_units(groups)
            lp, _, lens, _, _ = self._pass(model, units, kept, with_entropy=False,
                                           routes=routes if mb else RouteMode.LIVE)
            self.on_micro_batch(done, len(batches))
            if not mb:
                continue
            for i, piece in zip(_response_ids(units), lp.split(lens)):
                out[i] = piece.float().cpu() if to_host else piece.float()
        return out

    def _pass(self, model: VisionLanguageModel, units: list[_Unit], kept: KeptPrefix | None, with_entropy: bool,
              routes: RouteMode = RouteMode.LIVE) -> tuple[torch.Tensor, torch.Tensor | None, list[int], float,
                                                           Routing | None]:
        """Logprobs (and entropy) of the units' response tokens, their response
        lengths, the pass's forward FLOPs and, for an MoE model, its `Routing` (routed as
        `routes` says): a suffix-only pass over kept prompts, or a packed pass that
        computes the prompts too."""
        lens = [len(r) for u in units for r in u.group.responses]
        groups = [u.group for u in units]
        share = self.config.share_prefix and kept is None
        routing = _routing(model, groups, kept is not None, share, routes)
        if kept is not None:
            if routing is not None:  # the aux loss and load count the tokens the policy sampled
                routing.counted = to_device(torch.cat([s.sampled_mask() for g in groups for s in g.samples]),
                                            model.device)
            hidden = suffix_hidden(model, kept, [SuffixUnit(u.index, u.group) for u in units], routing)
            targets = to_device([t for u in units for r in u.group.responses for t in r], model.device)
            flops = suffix_flops(model.args, [(kept.prompt_lens[u.index], [len(r) for r in u.group.responses])
                                              for u in units])
            out = (*token_logprobs(model, hidden, targets, with_entropy, self.config.temperature), lens, flops)
        else:
            batch = batch_to(pack_groups(model.args, groups, share), model.device)
            if routing is not None and batch.packed.prompt_mask is not None:
                routing.counted = ~batch.packed.prompt_mask  # the aux loss and load count the sampled tokens
            out = (*response_logprobs(model, batch, with_entropy=with_entropy, temperature=self.config.temperature,
                                      routing=routing), lens, forward_flops(model.args, batch))
        if routes is RouteMode.RECORD and routing is not None:
            if kept is not None:
                route_layouts.store_responses(groups, routing)
            else:
                route_layouts.store_packed(groups, share, routing)
        return (*out, routing)

    def update(self, batch: PolicyBatch) -> dict[str, float]:
        """One optimizer step on the batch; returns verl-named metrics (`PolicyUpdate.finish`)."""
        measures_diff = batch.rollout_logprobs is not None and batch.rollout_weights
        return PolicyUpdate(self, batch.kept, self._loss_norm(batch), measures_diff).finish(batch)

    def start_update(self) -> PolicyUpdate:
        """The next optimizer step's passes, started before its whole batch exists: groups join
        one by one (`PolicyUpdate.add_group`) as they finish decoding, and `PolicyUpdate.finish`
        adds the rest. Gradients stay on this rank until the last backward in `finish` (FSDP
        reduces nothing before): a rank runs as many passes as its groups finish in the window,
        its peers others. Every dp rank must start the step, or none (the reductions in `finish`
        follow from it)."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(False)
        return PolicyUpdate(self, None, None, measures_diff=True)

    def _sync_gradients(self) -> None:
        """The next backward reduces the gradients over dp ranks (FSDP's default)."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(True)

    def _loss_norm(self, batch: PolicyBatch) -> LossNorm:
        """The batch's global normalisers: the tokens the policy sampled (not its observations) and the
        responses, over every dp rank."""
        local = [sum(s.sampled_tokens for g in batch.groups for s in g.samples), len(batch.advantages)]
        tokens, seqs = local if self.dp_size == 1 else all_reduce_values(local, group=self.dp_group)
        return LossNorm(tokens, seqs, self.config.max_response_len)

    def _clip_and_step(self, known_cause: str) -> float:
        """Clip and take the optimizer step, unless `known_cause` (why to skip it, found
        before the gradients: the same on every rank) or the global grad norm is not
        finite: then the step is skipped, counted, and its cause kept in `skip_cause`."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(global_grad_norm(grads))
        # `known_cause` and the norm are global: every rank skips, and finds the same cause.
        self.skip_cause = known_cause or ("" if math.isfinite(grad_norm) else self._nonfinite_gradient_cause())
        if self.skip_cause:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
        else:
            if self.config.grad_clip > 0 and grad_norm > self.config.grad_clip:
                torch._foreach_mul_(grads, self.config.grad_clip / (grad_norm + 1e-6))
            if self.offload:
                self.offload.load()
            self.optimizer.step()
            if self.offload:
                self.offload.offload()
            self.lr_schedule.step()
            self.skipped_in_a_row = 0
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _nonfinite_gradient_cause(self) -> str:
        """Why the global gradient norm is not finite, the same words on every rank: the first
        parameter (in the model's order) whose gradient holds NaN or inf on any rank, or, where
        every gradient is finite, the largest gradient (its square overflows float32). Costs a
        pass over the gradients and a reduction over the ranks: only for a step being skipped."""
        named = [(name.replace(_CHECKPOINT_PREFIX, ""), p.grad) for name, p in self.model.named_parameters()
                 if p.grad is not None]
        stats = [_gradient_stats(grad.to_local() if isinstance(grad, DTensor) else grad) for _, grad in named]
        stats = _max_over_ranks(torch.stack(stats).tolist() if stats else [], [grad for _, grad in named])
        bad = [(name, nan, inf) for (name, _), (nan, inf, _) in zip(named, stats) if nan or inf]
        if bad:
            name, nan, inf = bad[0]
            kind = " and ".join(word for word, present in (("NaN", nan), ("inf", inf)) if present)
            others = {1: "", 2: " (as does one other parameter's gradient)"}.get(
                len(bad), f" (as do {len(bad) - 1} other parameters' gradients)")
            return f"the gradient of {name} holds {kind}{others}"
        if not stats:
            return "the gradient norm is not finite"
        largest = max(range(len(stats)), key=lambda i: stats[i][2])
        return (f"every gradient is finite but their norm overflows float32: the largest |gradient| is "
                f"{stats[largest][2]:.3g}, in {named[largest][0]}")

    def _fallback_units(self, groups: list[Group]) -> list[_Unit]:
        return [_Unit(Group(groups[0].prompt, groups[0].samples[:1]), 0, 0)]


def _gradient_stats(grad: torch.Tensor) -> torch.Tensor:
    """(holds NaN, holds inf, largest finite |value|) of one gradient (a rank's shard of it: maybe empty)."""
    if not grad.numel():
        return torch.zeros(3, device=grad.device)
    finite = grad.detach().abs().nan_to_num(nan=0.0, posinf=0.0)
    return torch.stack([grad.isnan().any().float(), grad.isinf().any().float(), finite.amax().float()])


def _max_over_ranks(rows: list[list[float]], grads: list[torch.Tensor]) -> list[list[float]]:
    """Each value of `rows` (one row per gradient) maxed over the ranks of the gradients' meshes:
    over each dimension of the largest mesh in turn (dp, then tp), which covers every rank of it."""
    meshes = [grad.device_mesh for grad in grads if isinstance(grad, DTensor)]
    if not rows or not meshes:
        return rows
    mesh = max(meshes, key=lambda m: m.ndim)
    flat = [value for row in rows for value in row]
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            flat = all_reduce_values(flat, dist.ReduceOp.MAX, mesh.get_group(dim))
    width = len(rows[0])
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def _routing(model: VisionLanguageModel, groups: list[Group], suffix: bool, share_prefix: bool,
             routes: RouteMode) -> Routing | None:
    """The `Routing` a pass of an MoE model over `groups` runs with (None for a dense model): replaying
    the samples' routes in the pass's layout (its responses after kept prompts, or pack_groups'), or live."""
    if moe_args(model) is None:
        return None
    if routes is not RouteMode.REPLAY:
        return Routing()
    replay = route_layouts.responses(groups) if suffix else route_layouts.packed(groups, share_prefix)
    if replay is None:
        raise ValueError("routing replay: the samples carry no recorded routes (algorithm.routing_replay rollout "
                         "needs the engine to record them, old the old-logprob pass)")
    return Routing(replay.to(model.device))


class MoEMetrics:
    """An update's `moe/*` metrics, summed over its micro-batches on the device."""

    def __init__(self, device: torch.device):
        zero = functools.partial(torch.zeros, (), dtype=torch.float64, device=device)
        self.aux_loss, self.load_ratio, self.layers, self.agreed, self.replayed = (zero() for _ in range(5))

    def add(self, routing: Routing, coef: float, share: torch.Tensor) -> torch.Tensor:
        """One micro-batch's routing: its metrics added, and its auxiliary loss term (coef * aux *
        `share`, its part of the step's) returned for the loss."""
        aux = routing.aux_loss(routing_experts(routing)).to(share.device)
        self.aux_loss += aux.detach().double() * share
        sums = routing.metrics()
        if sums:
            self.load_ratio += sums["load_max_over_mean"].double()
            self.layers += sums["layers"].double()
        if "agreed" in sums:
            self.agreed += sums["agreed"].double()
            self.replayed += sums["replayed"].double()
        return coef * aux * share.to(aux.dtype) if coef else aux.new_zeros(())

    def as_metrics(self, dp_size: int, replays: bool) -> dict[str, float]:
        """moe/aux_loss (this rank's share, as the other losses), moe/expert_load_max_over_mean (the mean
        over layers and micro-batches of the busiest expert's load over the mean load) and, when the update
        `replays` routes, moe/routing_agreement (the fraction of replayed token-layer top-k sets the live
        router picks too); the last two as this rank's share (1 / `dp_size`) of their mean over the dp ranks,
        which sum them. Every rank gives the same keys (the ranks reduce them as one list); one that trained
        no token gives 0."""
        mean = lambda total, count: (total / count).item() / dp_size if count.item() else 0.0  # noqa: E731
        out = {"moe/aux_loss": self.aux_loss.item(),
               "moe/expert_load_max_over_mean": mean(self.load_ratio, self.layers)}
        if replays:
            out["moe/routing_agreement"] = mean(self.agreed, self.replayed)
        return out


def routing_experts(routing: Routing) -> int:
    """The experts of a routing's layers (every MoE layer has as many)."""
    return next(iter(routing.layers.values())).load.shape[0]


def count_nonfinite(logprobs: list[torch.Tensor] | None) -> int:
    """NaN and ±inf values among per-response logprobs (host tensors). At observation tokens they are a
    trainer pass's, or the rollout's 0.0 placeholders: finite, never counted."""
    return int(torch.cat(logprobs).isfinite().logical_not().sum()) if logprobs else 0


def _response_ids(units: list[_Unit]) -> list[int]:
    return [u.first + j for u in units for j in range(len(u.group.responses))]


def _sampled_mask(units: list[_Unit], device: torch.device) -> torch.Tensor:
    """(responses, longest) bool: True at the tokens the policy sampled, False at observations' tokens and
    past each response's end. Built on the host: no boolean work on the device that would read it back."""
    rows = [s.sampled_mask() for u in units for s in u.group.samples]
    return to_device(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), device)


def _pad(rows: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The rows, float32, as the rows of a (len(rows), longest) matrix zero-padded past each one's
    length (`mask`'s layout and device: no boolean-mask indexing, which would read the mask back on CUDA)."""
    return torch.nn.utils.rnn.pad_sequence([to_device(r, mask.device, torch.float32) for r in rows], batch_first=True)


def batch_to(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """Move a packed batch's tensors to the model's device."""
    p = batch.packed
    # cu_seqlens stays on the host, where the attention builds its index tensors from it once per pass.
    for name in ("input_ids", "position_ids", "prompt_mask", "pixel_values", "image_grid_thw",
                 "pixel_values_videos", "video_grid_thw"):
        t = getattr(p, name)
        if t is not None:
            setattr(p, name, t.to(device))
    batch.target_index, batch.target_ids = batch.target_index.to(device), batch.target_ids.to(device)
    return batch
