"""A step's rollout: n responses per prompt from the engine, on the trainer's own weights.

Each dp rank rolls out its own share of the prompts (`balanced_share`); all n
samples of a prompt stay on one rank. Sampling seeds come from the prompt's
global index, so a prompt gets the same samples whatever rank, world size or
schedule handles it; validation's come from its own stream of seeds
(`RolloutRunner.validate`). `Rollout` is what the training phases read: a group
per prompt, each with its samples' tokens, the engine's logprobs and finish reasons.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cached_property
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from rollplex.config import RolloutConfig
from rollplex.dist import all_gather_objects, all_reduce_values
from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.engine.sampler import mix_seed
from rollplex.models.inputs import Group, Sample, VisionEmbeds
from rollplex.models.protocol import VisionLanguageModel
from rollplex.rl.weights import SharedWeights

if TYPE_CHECKING:
    from rollplex.agent.episodes import Agent

# The step a validation seed mixes in: a training prompt's seed mixes (run seed, step, index) with a step of 0 or
# more, so no validation draw repeats a training one, whatever the indices of the training and validation rows.
VALIDATION_STEP = -1


@dataclass
class Rollout:
    """One step's samples on this rank: a group per prompt, in batch order."""

    examples: list  # rollplex.data Example per prompt
    groups: list[Group]
    texts: list[str]  # each sample's decoded response, group by group (what the reward reads)

    @classmethod
    def of(cls, examples: list, groups: list[Group], tokenizer, decoded: dict[int, list[str]] | None = None) -> Rollout:
        """The rollout of `examples` from their groups (the engine's, or a disagg rollout rank's);
        `decoded`: the responses of the groups decoded already, by group (the decode window's)."""
        decoded = decoded or {}
        texts = [t for i, g in enumerate(groups) for t in decoded.get(i) or [response_text(tokenizer, s)
                                                                             for s in g.samples]]
        return cls(examples, groups, texts)

    # The per-sample views are built once: the groups do not change after `of`.
    @cached_property
    def samples(self) -> list[Sample]:
        """Every sample, group by group: the order of the per-sample lists (rewards, advantages)."""
        return [s for g in self.groups for s in g.samples]

    @cached_property
    def logprobs(self) -> list[torch.Tensor]:
        """The engine's logprobs of each sample's tokens."""
        return [torch.tensor(s.logprobs) for s in self.samples]

    @cached_property
    def finish_reasons(self) -> list[str]:
        return [s.finish_reason for s in self.samples]

    def responses_of(self, groups: slice) -> slice:
        """Where the samples of a run of groups lie in the per-sample lists."""
        first = sum(len(g.samples) for g in self.groups[:groups.indices(len(self.groups))[0]])
        return slice(first, first + sum(len(g.samples) for g in self.groups[groups]))

    @property
    def tokens(self) -> int:
        """Tokens the training passes read: each sample's prompt and response."""
        return sum(len(g.prompt.input_ids) * len(g.samples) + sum(map(len, g.responses)) for g in self.groups)


def response_text(tokenizer, sample: Sample) -> str:
    """What the reward reads as a sample's response: its decoded tokens, special tokens skipped; a
    multi-turn sample's last turn, its answer (the whole trajectory is its episode's messages)."""
    last_turn = sample.observations[-1].end if sample.observations else 0
    return tokenizer.decode(sample.token_ids[last_turn:], skip_special_tokens=True)


def balanced_share(examples: list, ranks: int, rank: int) -> list:
    """This rank's prompts: as many per rank as possible, prompt tokens balanced
    (longest first, each to the rank with the fewest tokens and room left), kept
    in batch order. Every rank computes the same assignment."""
    cap = -(-len(examples) // ranks)
    load, count, owner = [0] * ranks, [0] * ranks, {}
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i].prompt.input_ids)):
        r = min((r for r in range(ranks) if count[r] < cap), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += len(examples[i].prompt.input_ids)
        count[r] += 1
    return [e for i, e in enumerate(examples) if owner[i] == rank]


def build_engine(weights: SharedWeights, r: RolloutConfig, num_blocks: int, max_model_len: int,
                 group: dist.ProcessGroup | None = None, record_routes: bool = False) -> Engine:
    """The engine on the rollout layout of the weights: built inside `for_rollout`,
    where it reads its KV head count and dtype off the parameters (outside, FSDP's
    dp shard of k_proj holds a fraction of the heads). Every rank of `group` (None:
    the world) gets the same KV pool size, the smallest any of them can hold, so that
    the ranks of a TP group schedule alike: the memory plan's `num_blocks`, allocated
    here and kept for the run (the plan counts it in every phase), since the decode
    graphs read it by address. `record_routes`: an MoE model's samples carry the experts the
    engine routed each token to (routing replay R3)."""
    config = EngineConfig.from_config(r, num_blocks, max_model_len)
    config.record_routes = record_routes
    with weights.for_rollout() as engine_model:
        engine = Engine(engine_model, config)
        if dist.get_world_size(group) > 1:
            [blocks] = all_reduce_values([engine.cache.num_blocks], dist.ReduceOp.MIN, group)
            if blocks != engine.cache.num_blocks:
                config.num_blocks = int(blocks)
                engine.release_kv()  # before the smaller pool is allocated
                engine = Engine(engine_model, config)
    return engine


class RolloutRunner:
    """This rank's engine as the loop drives it: requests with the prompts' seeds
    and limits, sampled as rollout.* says (training) or as trainer.val_* says
    (evaluation: greedy by default), on the trainer's weights."""

    def __init__(self, engine: Engine, weights: SharedWeights, model: VisionLanguageModel, tokenizer, r: RolloutConfig,
                 seed: int, tp_group: dist.ProcessGroup | None = None, agent: Agent | None = None):
        """`tp_group`: the engine's TP group when it spans several dp ranks (rollout.tp >
        parallel.tp); the group then generates all its ranks' requests together. `agent`:
        multi-turn rollouts' tools or environment (rollplex.agent), None for single-turn."""
        self.engine, self.weights, self.model, self.tokenizer = engine, weights, model, tokenizer
        self.config, self.seed, self.tp_group, self.agent = r, seed, tp_group, agent
        self.sampling = SamplingParams.from_config(r)
        self.tool_wait_s = 0.0  # the last generation's wait on tools with nothing else to run

    @contextmanager
    def session(self) -> Iterator[None]:
        """The model in eval mode and the weights in their rollout layout."""
        self.model.eval()
        with self.weights.for_rollout():
            yield

    def requests(self, examples: list, step: int, vision: list[VisionEmbeds | None]) -> list[Request]:
        """n samples per prompt, seeded by the run's seed, the step and the prompt's index."""
        r = self.config
        seeds = [mix_seed(self.seed, step, e.index) for e in examples]
        # With min_tokens, each prompt's own limit, drawn from its seed (the same on any rank and schedule).
        limits = [r.min_tokens + s % (r.max_tokens - r.min_tokens + 1) if r.min_tokens else None for s in seeds]
        return [Request(e.prompt, n=r.n, seed=seed, max_tokens=limit, vision=v)
                for e, v, seed, limit in zip(examples, vision, seeds, limits)]

    def generate(self, requests: list[Request], params: SamplingParams | None = None,
                 between_steps: Callable[[int], None] | None = None,
                 on_finished: Callable[[int, Group], None] | None = None, examples: list | None = None) -> list[Group]:
        """Generate on this rank's engine (`params`: the rollout's sampling by default),
        with the TP group's requests when it has one; each rank keeps its own outputs
        (seeds come from the prompts, so the samples do not depend on the grouping),
        and hears of its own finished groups (`Engine.generate`). With an agent, the
        samples are multi-turn episodes over `examples`' rows (one per request)."""
        params = params or self.sampling
        if self.agent is not None:  # the config keeps multi-turn rollouts to engines of one dp rank's requests
            episodes = self.agent.episodes(examples)
            groups = self.engine.generate(requests, params, between_steps, on_finished, episodes)
            self.tool_wait_s = episodes.waited_s
            return groups
        if self.tp_group is None:
            return self.engine.generate(requests, params, between_steps, on_finished)
        # Vision features are left out: a peer's engine encodes its own (they are device tensors).
        everyone = all_gather_objects([replace(q, vision=None) for q in requests], self.tp_group)
        first = sum(len(qs) for qs in everyone[:dist.get_rank(self.tp_group)])
        def mine(index: int, group: Group) -> None:  # this rank's groups, by their index in `requests`
            if first <= index < first + len(requests):
                on_finished(index - first, group)

        outputs = self.engine.generate([q for qs in everyone for q in qs], params, between_steps,
                                       mine if on_finished is not None else None)
        return outputs[first:first + len(requests)]

    def validate(self, examples: list, n: int = 1, temperature: float = 0.0, top_p: float = 1.0) -> list[Group]:
        """`n` responses to each example (evaluation), at `temperature` (0: greedy) and `top_p`,
        up to rollout.max_tokens. The seeds mix the run's seed and the prompt's index, not the
        step: every evaluation draws alike, so the val/score curve moves with the weights rather
        than with the draws, and a rerun or resumed run draws the same. The engine's sampling
        is counter-based, keyed by each request's seed, so this leaves the training's draws as
        they were."""
        params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=self.config.max_tokens)
        requests = [Request(e.prompt, n=n, seed=mix_seed(self.seed, VALIDATION_STEP, e.index)) for e in examples]
        with self.session():
            return self.generate(requests, params, examples=examples)
