"""The decode engine on a tiny Qwen3-VL that transformers wrote (and multi-turn episodes, whose cases
tests/test_agent_engine.py holds): greedy tokens equal
transformers' generate, logprobs equal transformers' full-sequence log-softmax, and the graph
stand-in and group-shared decode give the eager engine's tokens. DeepStack's
additions enter at prefill only (the prompt's vision tokens); decode steps are text."""

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.models import Prompt
from test_agent_engine import (test_an_observation_past_the_length_limit_ends_the_episode_as_length,  # noqa: F401
                               test_graph_stand_in_preemption_and_cascade_give_the_same_episodes,
                               test_observations_prefilled_onto_kv_and_logprobs_equal_whole_trajectory)
from test_qwen3_vl_model import image_tokens, make_pair, mm_types, pixels, video_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, seed=5)
    return hf, ours


@pytest.fixture(scope="module")
def model(pair):
    """What the multi-turn cases (tests/test_agent_engine.py) run on: ours, DeepStack adding an observation's
    image features at its continuation prefill."""
    return pair[1]


@pytest.fixture(scope="module")
def image():
    def make(h: int, w: int, seed: int):
        rows, grid = pixels(1, h, w, seed)
        return rows, grid, image_tokens(grid)

    return make


def requests(n: int = 1) -> list[Request]:
    a, ga = pixels(1, 4, 6, seed=20)
    b, gb = pixels(1, 8, 4, seed=21)
    v, gv = pixels(2, 4, 4, seed=22)
    return [
        Request(Prompt(torch.tensor([1, 5, 9, 13, 2, 7])), n=n),
        Request(Prompt(torch.tensor([3, *image_tokens(ga), 11, 12]), pixel_values=a, image_grid_thw=ga), n=n),
        Request(Prompt(torch.tensor([4, *image_tokens(ga), *image_tokens(gb), 8]), pixel_values=torch.cat([a, b]),
                       image_grid_thw=torch.cat([ga, gb])), n=n),
        Request(Prompt(torch.tensor([6, *video_tokens(gv), 10]), pixel_values_videos=v, video_grid_thw=gv), n=n),
        Request(Prompt(torch.tensor([2, *image_tokens(gb), 5, *video_tokens(gv), 9]), pixel_values=b,
                       image_grid_thw=gb, pixel_values_videos=v, video_grid_thw=gv), n=n),
    ]


def hf_greedy(hf, r: Request, max_new: int) -> list[int]:
    ids = r.prompt.input_ids[None]
    vision = {k: getattr(r.prompt, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                "video_grid_thw") if getattr(r.prompt, k) is not None}
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types(ids),
                      do_sample=False, max_new_tokens=max_new, **vision)
    return out[0, ids.shape[1]:].tolist()


def test_greedy_equals_transformers_generate(pair):
    hf, ours = pair
    rs = requests(n=2)
    outputs = Engine(ours, EngineConfig(block_size=4, num_blocks=128)).generate(rs, GREEDY)
    for r, out in zip(rs, outputs):
        expected = hf_greedy(hf, r, GREEDY.max_tokens)
        assert [s.token_ids for s in out.samples] == [expected, expected]


def test_logprobs_equal_transformers_log_softmax(pair):
    """Each sampled token's logprob equals the log-softmax of transformers' logits over the
    whole sequence (prompt and response) at that token."""
    hf, ours = pair
    rs = requests()
    outputs = Engine(ours, EngineConfig(block_size=4, num_blocks=128)).generate(
        rs, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    for r, out in zip(rs, outputs):
        p, s = r.prompt, out.samples[0]
        ids = torch.cat([p.input_ids, torch.tensor(s.token_ids)])[None]
        vision = {k: getattr(p, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                             "video_grid_thw") if getattr(p, k) is not None}
        with torch.no_grad():
            logits = hf(input_ids=ids, mm_token_type_ids=mm_types(ids), **vision).logits[0]
        start = len(p.input_ids) - 1
        ref = torch.log_softmax(logits.float(), -1)[start:start + len(s.token_ids)]
        ref = ref.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert (torch.tensor(s.logprobs) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("graphs", [True, False], ids=["graph stand-in", "eager"])
@pytest.mark.parametrize("shared", [True, False], ids=["group-shared decode", "plain decode"])
def test_graphs_and_group_shared_decode_give_eager_tokens(pair, graphs, shared):
    """The runner's graph stand-in (CUDA graphs' bookkeeping, replayed on CPU) and the
    cascade decode of a group's shared prompt blocks, alone and together."""
    _, ours = pair
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    eager = Engine(ours, EngineConfig(block_size=4, num_blocks=256)).generate(requests(n=3), params)
    engine = Engine(ours, EngineConfig(block_size=4, num_blocks=256, shared_prefix_decode=shared))
    engine.runner.use_cuda_graphs = graphs
    other = engine.generate(requests(n=3), params)
    assert [[s.token_ids for s in o.samples] for o in other] == [[s.token_ids for s in o.samples] for o in eager]
