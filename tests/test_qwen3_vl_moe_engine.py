"""The decode engine on a tiny Qwen3-VL-MoE that transformers wrote: greedy tokens equal
transformers' generate, logprobs equal transformers' full-sequence log-softmax, and the graph
stand-in and group-shared decode give the eager engine's tokens. The experts route each token
by its own hidden state, at prefill and at every decode step alike; the requests are Qwen3-VL's
engine test's (text, images, a video, both)."""

import pytest
import torch

from rollplex.engine import Engine, EngineConfig, SamplingParams
from test_qwen3_vl_engine import hf_greedy, requests
from test_qwen3_vl_model import mm_types
from test_qwen3_vl_moe_model import make_pair

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, seed=5)
    return hf, ours


def engine(model, **config) -> Engine:
    return Engine(model, EngineConfig(**{"block_size": 4, "num_blocks": 256, **config}))


def tokens(groups) -> list[list[list[int]]]:
    return [[s.token_ids for s in g.samples] for g in groups]


def test_greedy_equals_transformers_generate(pair):
    """Every request in one batch (a mixed prefill), each a group of two."""
    hf, ours = pair
    rs = requests(n=2)
    for r, out in zip(rs, engine(ours).generate(rs, GREEDY)):
        expected = hf_greedy(hf, r, GREEDY.max_tokens)
        assert [s.token_ids for s in out.samples] == [expected, expected]


def test_logprobs_equal_transformers_log_softmax(pair):
    """Each sampled token's logprob equals the log-softmax of transformers' logits over the
    whole sequence (prompt and response) at that token."""
    hf, ours = pair
    rs = requests()
    outputs = engine(ours).generate(rs, SamplingParams(temperature=1.0, max_tokens=6, seed=1))
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
    """The runner's graph stand-in (CUDA graphs' bookkeeping, replayed on CPU) and the cascade
    decode of a group's shared prompt blocks, alone and together: padded decode rows go through
    the router and experts too, and change no real row's tokens."""
    _, ours = pair
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    expected = tokens(engine(ours).generate(requests(n=3), params))
    other = engine(ours, shared_prefix_decode=shared)
    other.runner.use_cuda_graphs = graphs
    assert tokens(other.generate(requests(n=3), params)) == expected
