"""Multi-turn episodes in the engine (rollplex.engine.episodes): a sample whose turn ends
waits for its observation without holding a decode row, and the observation (text and
an image) is prefilled onto the K/V it has, never its history again. The engine's
logprobs after observations equal a plain forward of the whole trajectory; the graph
stand-in, preemption and group-shared decode give the same samples; limits end an
episode with a finish reason. Another family's engine tests run these cases on their own
`model` and `image` fixtures (tests/test_qwen3_vl_engine.py)."""

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.models import Prompt, build_model
from rollplex.models.inputs import EpisodeLog, Observation
from rollplex.models.packing import PackedBatch
from rollplex.models.rope import mrope_positions
from test_model import IMG, VEND, VSTART, tiny_args
from test_model import image as random_image


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_args(), seed=3, init_std=None).eval()


@pytest.fixture(scope="module")
def image():
    """A random image of (h, w) patches as the family lays it out: (pixel rows, grid, its tokens)."""
    def make(h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        pixels, grid, pads = random_image(1, h, w, seed)
        return pixels, grid, [VSTART] + [IMG] * pads + [VEND]

    return make


def observation_prompts(image) -> list[Prompt]:
    """Two observations: one with an image (a tool that returns a picture), one text only."""
    pixels, grid, tokens = image(4, 6, seed=30)
    return [Prompt(torch.tensor([2, 14, *tokens, 15, 16]), pixel_values=pixels, image_grid_thw=grid),
            Prompt(torch.tensor([2, 17, 18, 19]))]


class ScriptedEpisodes:
    """Each turn ends at a token of `turn_end_ids`; after its k-th turn an episode gets
    `observations[k]`, one ready per poll (as tools finish one by one), and ends after the last."""

    def __init__(self, model, observations: list[Prompt], turn_end_ids: frozenset[int]):
        self.spec, self.observations, self.turn_end_ids = model.args.rope_spec, observations, turn_end_ids
        self.turns: dict = {}
        self.pending: list = []
        self.finished: dict = {}

    def end_turn(self, key, response):
        k = self.turns[key] = self.turns.get(key, 0) + 1
        if k > len(self.observations):
            return "stop"
        self.pending.append((key, Observation.of(self.observations[k - 1], len(response), self.spec)))
        return None

    def poll(self, wait):
        ready, self.pending = self.pending[:1], self.pending[1:]
        return ready

    def finish(self, key, sample):
        self.finished[key] = sample.finish_reason
        return EpisodeLog(turns=self.turns.get(key, 1))


def prompts(image, n: int = 2) -> list[Request]:
    pixels, grid, tokens = image(4, 4, seed=31)
    return [Request(Prompt(torch.tensor([3, *tokens, 11, 12]), pixel_values=pixels, image_grid_thw=grid), n=n, seed=5),
            Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=n, seed=6)]


# A turn ends at any token id divisible by 5 (random turn lengths); nothing else stops it.
TURN_ENDS = frozenset(range(0, 90, 5))
SAMPLING = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)


def run(model, image, config: EngineConfig, **kw):
    episodes = ScriptedEpisodes(model, observation_prompts(image), TURN_ENDS)
    engine = Engine(model, config)
    for name, value in kw.items():
        setattr(engine.runner, name, value)
    groups = engine.generate(prompts(image), SAMPLING, episodes=episodes)
    return groups, engine, episodes


@torch.no_grad()
def trajectory_logprobs(model, request: Request, sample) -> torch.Tensor:
    """log-softmax at each response token of ONE forward over the whole trajectory: positions from
    mrope_positions over all of it, every image (the prompt's, then the observations'), vision features
    at the pads the policy did not sample (a random model samples pad ids too: those are text)."""
    p = request.prompt
    ids = torch.cat([p.input_ids, torch.tensor(sample.token_ids)])
    context = torch.cat([torch.ones(len(p.input_ids), dtype=torch.bool), ~sample.sampled_mask()])
    images = [x for x in [p.pixel_values] + [o.prompt.pixel_values for o in sample.observations] if x is not None]
    grids = [x for x in [p.image_grid_thw] + [o.prompt.image_grid_thw for o in sample.observations] if x is not None]
    grids = torch.cat(grids) if grids else None
    positions, delta = mrope_positions(torch.where(context, ids, 0), model.args.rope_spec, grids)
    batch = PackedBatch(ids, positions, torch.tensor([0, len(ids)], dtype=torch.int32), len(ids), [delta],
                        prompt_mask=context, pixel_values=torch.cat(images) if images else None, image_grid_thw=grids)
    logprobs = torch.log_softmax(model.logits(model.forward_packed(batch)).float(), -1)
    start = len(p.input_ids) - 1
    return logprobs[start:start + len(sample.token_ids)].gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]


def test_observations_prefilled_onto_kv_and_logprobs_equal_whole_trajectory(model, image):
    # Without run-ahead no decode step feeds a turn's last token: each continuation prefills it, then the observation.
    groups, engine, episodes = run(model, image, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True,
                                                              run_ahead=False))
    observations = sum(len(s.observations) for g in groups for s in g.samples)
    assert observations == 8  # every sample got both observations (none ran out of room)
    prefilled = sum(len(r.prompt.input_ids) for r in prompts(image))  # each group's prompt, once
    prefilled += sum(len(o) for g in groups for s in g.samples for o in s.observations)
    assert engine.stats["prefill_tokens"] == prefilled + observations  # + each turn's last token
    # Run ahead, the decode step after a turn's end may have fed its last token already: then only the observation.
    _, ahead, _ = run(model, image, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True))
    assert prefilled <= ahead.stats["prefill_tokens"] <= prefilled + observations
    for request, group in zip(prompts(image), groups):
        for s in group.samples:
            assert s.finish_reason == "stop" and s.episode.turns == 3
            for o in s.observations:
                assert s.token_ids[o.start:o.end] == o.prompt.input_ids.tolist()
                assert s.token_ids[o.start - 1] in TURN_ENDS
            expected = trajectory_logprobs(model, request, s)
            mask = s.sampled_mask()
            got = torch.tensor(s.logprobs)
            torch.testing.assert_close(got[mask], expected[mask], atol=1e-5, rtol=0)
            assert (got[~mask] == 0).all()


def same_samples(a, b) -> None:
    for ga, gb in zip(a, b):
        for sa, sb in zip(ga.samples, gb.samples):
            assert sa.token_ids == sb.token_ids and sa.finish_reason == sb.finish_reason
            torch.testing.assert_close(torch.tensor(sa.logprobs), torch.tensor(sb.logprobs), atol=1e-5, rtol=0)


def test_graph_stand_in_preemption_and_cascade_give_the_same_episodes(model, image):
    """Against an engine that never runs ahead (every turn's last token re-fed at its continuation), the others
    run ahead: a turn's last token may have been fed by the decode step after it (its K/V, a hybrid's state)."""
    reference, _, _ = run(model, image, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True,
                                                     run_ahead=False))
    graphs, engine, _ = run(model, image, EngineConfig(block_size=4, num_blocks=256), use_cuda_graphs=True)
    assert engine.runner.captures > 0
    same_samples(reference, graphs)
    # A pool of 20 blocks cannot hold the four episodes at once: decode preempts, and blocks held by paused
    # episodes are given up (recomputed whole, their observations' images included).
    small, engine, _ = run(model, image, EngineConfig(block_size=4, num_blocks=20, max_num_seqs=4,
                                                      enforce_eager=True))
    assert engine.stats["preemptions"] + engine.stats["released_episodes"] > 0
    same_samples(reference, small)
    cascade, _, _ = run(model, image, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True,
                                                   shared_prefix_decode=True))
    same_samples(reference, cascade)


def test_an_observation_past_the_length_limit_ends_the_episode_as_length(model, image):
    long_observation = Prompt(torch.arange(20, 80))  # 60 tokens: past what is left of max_tokens 60
    episodes = ScriptedEpisodes(model, [long_observation], TURN_ENDS)
    groups = Engine(model, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True)).generate(
        prompts(image), SAMPLING, episodes=episodes)
    for g in groups:
        for s in g.samples:
            assert s.finish_reason == "length" and not s.observations
            assert s.token_ids[-1] in TURN_ENDS  # trained as far as it went: its turn, whole
    assert set(episodes.finished.values()) == {"length"}


class SlowEncode:
    """The runner's encode_aside as on a GPU, where an observation's images are encoded on the vision stream
    while decode goes on: its stand-in event is not done for the first `polls` queries (a real event is not done
    until the stream gets there), and synchronize() waits it out. Counts the encodes."""

    def __init__(self, encode_aside, polls: int):
        self.encode_aside, self.polls, self.encodes, self.queries_while_busy = encode_aside, polls, 0, 0

    def __call__(self, observation):
        features, _ = self.encode_aside(observation)
        self.encodes += 1
        return features, SlowEncode.Event(self)

    class Event:
        def __init__(self, owner):
            self.owner, self.left = owner, owner.polls

        def query(self) -> bool:
            self.left -= 1
            self.owner.queries_while_busy += self.left >= 0
            return self.left < 0

        def synchronize(self) -> None:
            self.left = -1


def test_observation_images_are_encoded_once_while_decode_goes_on(model, image):
    """Each image observation is encoded once, when it comes (not by its prefill, nor again after a preemption);
    while its images are not ready the sample waits and the others decode; the samples are the same."""
    reference, _, _ = run(model, image, EngineConfig(block_size=4, num_blocks=256, enforce_eager=True,
                                                     run_ahead=False))
    episodes = ScriptedEpisodes(model, observation_prompts(image), TURN_ENDS)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=20, max_num_seqs=4, enforce_eager=True))
    slow = engine.runner.encode_aside = SlowEncode(engine.runner.encode_aside, polls=3)
    groups = engine.generate(prompts(image), SAMPLING, episodes=episodes)
    same_samples(reference, groups)
    with_images = sum(o.prompt.has_vision for g in groups for s in g.samples for o in s.observations)
    assert slow.encodes == with_images == 4 and slow.queries_while_busy > 0
    assert engine.stats["preemptions"] + engine.stats["released_episodes"] > 0  # recomputed, not encoded again
