"""The decode engine on a tiny Qwen3.5 that transformers wrote: its Gated DeltaNet
layers keep a state slot per decode row (rollplex.engine.recurrent_state), which a
group's samples fork from their prompt's one prefill. Greedy tokens equal transformers'
generate and sampled logprobs equal transformers' log-softmax over each sample's own
full sequence, for prompts longer than a chunk of the gated delta rule, images, video
and mixed batches; the graph stand-in, group-shared decode, preemption and a group
larger than max_num_seqs give the eager engine's tokens."""

import copy

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams
from rollplex.models import Prompt
from test_agent_engine import (test_an_observation_past_the_length_limit_ends_the_episode_as_length,  # noqa: F401
                               test_graph_stand_in_preemption_and_cascade_give_the_same_episodes,
                               test_observations_prefilled_onto_kv_and_logprobs_equal_whole_trajectory)
from test_qwen3_5_model import long_text, make_pair
from test_qwen3_vl_engine import image  # noqa: F401
from test_qwen3_vl_model import image_tokens, mm_types, pixels, video_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=8, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory)
    return hf, ours


@pytest.fixture(scope="module")
def model(pair):
    """What the multi-turn cases (tests/test_agent_engine.py) run on: a waiting episode keeps its DeltaNet state,
    and its next turn's prefill continues from it."""
    return pair[1]


def requests(n: int = 1) -> list[Request]:
    """Text over two chunks of 64, an image, a video, and an image and a video with text between."""
    a, ga = pixels(1, 4, 6, seed=20)
    v, gv = pixels(2, 4, 4, seed=22)
    return [
        Request(Prompt(torch.tensor(long_text(100, seed=1))), n=n),
        Request(Prompt(torch.tensor([3, *image_tokens(ga), 11, 12]), pixel_values=a, image_grid_thw=ga), n=n),
        Request(Prompt(torch.tensor([6, *video_tokens(gv), 10]), pixel_values_videos=v, video_grid_thw=gv), n=n),
        Request(Prompt(torch.tensor([2, *image_tokens(ga), *long_text(70, seed=2), *video_tokens(gv), 9]),
                       pixel_values=a, image_grid_thw=ga, pixel_values_videos=v, video_grid_thw=gv), n=n),
    ]


def vision_of(p: Prompt) -> dict:
    return {k: getattr(p, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if getattr(p, k) is not None}


def engine(model, **config) -> Engine:
    return Engine(model, EngineConfig(**{"block_size": 4, "num_blocks": 256, **config}))


def tokens(groups) -> list[list[list[int]]]:
    return [[s.token_ids for s in g.samples] for g in groups]


def test_greedy_equals_transformers_generate(pair):
    """Every request in one batch (a mixed prefill), each a group of two that forks its prompt's state."""
    hf, ours = pair
    rs = requests(n=2)
    for r, out in zip(rs, engine(ours).generate(rs, GREEDY)):
        ids = r.prompt.input_ids[None]
        expected = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types(ids),
                               do_sample=False, max_new_tokens=GREEDY.max_tokens, **vision_of(r.prompt))
        assert [s.token_ids for s in out.samples] == [expected[0, ids.shape[1]:].tolist()] * 2


def hf_response_logprobs(hf, prompt: Prompt, responses: list[list[int]]) -> list[torch.Tensor]:
    """Transformers' logprob of each response token: the prompt run once with its cache, then each
    response fed after its own copy of that cache (generate's path, so a sampled vision pad id is
    a text token, as in the engine)."""
    ids = prompt.input_ids[None]
    hf.model.rope_deltas = None  # transformers keeps the last prompt's M-RoPE offset, and a text prompt sets none
    with torch.no_grad():
        out = hf(input_ids=ids, mm_token_type_ids=mm_types(ids), use_cache=True, **vision_of(prompt))
        result = []
        for response in responses:
            tokens = torch.tensor(response)[None]
            cache = copy.deepcopy(out.past_key_values)
            logits = hf(input_ids=tokens[:, :-1], past_key_values=cache, use_cache=True).logits[0]
            logits = torch.cat([out.logits[0, -1:], logits]).float()
            result.append(torch.log_softmax(logits, -1).gather(1, tokens[0, :, None])[:, 0])
    return result


def test_sampled_forks_match_transformers_on_their_full_sequences(pair):
    """Three samples per prompt, each decoding from its own copy of the prompt's state: every
    sampled token's logprob is transformers' over that sample's whole sequence."""
    hf, ours = pair
    rs = requests(n=3)
    for r, out in zip(rs, engine(ours).generate(rs, SAMPLED)):
        responses = [s.token_ids for s in out.samples]
        assert len(set(map(tuple, responses))) > 1, "the samples should differ"
        for s, ref in zip(out.samples, hf_response_logprobs(hf, r.prompt, responses)):
            assert (torch.tensor(s.logprobs) - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("graphs", [True, False], ids=["graph stand-in", "eager"])
@pytest.mark.parametrize("shared", [True, False], ids=["group-shared decode", "plain decode"])
def test_graphs_and_group_shared_decode_give_eager_tokens(pair, graphs, shared):
    """The graph stand-in replays the decode through the state pool as captured (padded rows
    update the sink slot), and cascade decode changes only the attention layers."""
    _, ours = pair
    expected = tokens(engine(ours).generate(requests(n=3), SAMPLED))
    other = engine(ours, shared_prefix_decode=shared, max_num_seqs=16)
    other.runner.use_cuda_graphs = graphs
    assert tokens(other.generate(requests(n=3), SAMPLED)) == expected
    if graphs:  # a second generation replays the same graphs over the same pools
        assert tokens(other.generate(requests(n=3), SAMPLED)) == expected
        assert other.stats["graph_captures"] == 0


def test_preempted_samples_recompute_their_state(pair):
    """A pool too small for every sample at once preempts some; each resumes by prefilling its
    prompt and the tokens it had, which recomputes its state into its new row."""
    _, ours = pair
    rs = requests(n=3)[1:3]
    expected = tokens(engine(ours).generate(rs, SAMPLED))
    small = engine(ours, num_blocks=20)
    assert tokens(small.generate(requests(n=3)[1:3], SAMPLED)) == expected
    assert small.stats["preemptions"] > 0


def test_a_group_larger_than_max_num_seqs_grows_the_state_pool(pair):
    _, ours = pair
    rs = requests(n=5)[:2]
    expected = tokens(engine(ours).generate(rs, SAMPLED))
    narrow = engine(ours, max_num_seqs=2)
    narrow.runner.use_cuda_graphs = True
    assert narrow.states.rows == 2
    assert tokens(narrow.generate(requests(n=5)[:2], SAMPLED)) == expected
    assert narrow.states.rows == 5


def test_the_pools_hold_what_the_layers_need(pair):
    """K/V for the full-attention layer only; a conv tail and an fp32 state per DeltaNet layer and row,
    plus the sink row; released and allocated again with the KV pool."""
    _, ours = pair
    e = engine(ours, max_num_seqs=8)
    assert e.cache.num_layers == 1 and e.cache.layer_index == {2: 0}
    assert e.states.conv.shape == (2, 9, 160, 3) and e.states.conv.dtype == torch.float32
    assert e.states.recurrent.shape == (2, 9, 4, 16, 24) and e.states.recurrent.dtype == torch.float32
    e.release_kv()
    assert e.states.nbytes == 0
    e.generate(requests()[:1], GREEDY)
    assert e.states.nbytes == 9 * 2 * (160 * 3 + 4 * 16 * 24) * 4
