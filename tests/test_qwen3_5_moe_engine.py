"""The decode engine on a tiny Qwen3.5-MoE that transformers wrote: the Qwen3.5 engine
tests' requests (text over two chunks of the gated delta rule, an image, a video, both
with text between), each a group whose samples fork their prompt's DeltaNet state, now
through sparse MoE layers. Greedy tokens equal transformers' generate, sampled logprobs
equal transformers' log-softmax over each sample's own full sequence, and the graph
stand-in with group-shared decode gives the eager engine's tokens."""

import pytest
import torch

from test_qwen3_5_engine import GREEDY, SAMPLED, engine, hf_response_logprobs, requests, tokens, vision_of
from test_qwen3_5_moe_model import make_pair
from test_qwen3_vl_model import mm_types


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory)
    return hf, ours


# Qwen3.5's greedy case on this module's `pair` (pytest gives a test the fixture of the module it collects it in).
from test_qwen3_5_engine import test_greedy_equals_transformers_generate  # noqa: E402, F401


def test_sampled_forks_match_transformers_on_their_full_sequences(pair):
    """Three samples per prompt: every sampled token's logprob is transformers' over that sample's
    whole sequence (its prompt's cache copied per sample)."""
    hf, ours = pair
    rs = requests(n=3)
    for r, out in zip(rs, engine(ours).generate(rs, SAMPLED)):
        responses = [s.token_ids for s in out.samples]
        assert len(set(map(tuple, responses))) > 1, "the samples should differ"
        for s, ref in zip(out.samples, hf_response_logprobs(hf, r.prompt, responses)):
            assert (torch.tensor(s.logprobs) - ref).abs().max() <= 1e-4


def test_graphs_and_group_shared_decode_give_eager_tokens(pair):
    _, ours = pair
    expected = tokens(engine(ours).generate(requests(n=3), SAMPLED))
    other = engine(ours, shared_prefix_decode=True, max_num_seqs=16)
    other.runner.use_cuda_graphs = True
    assert tokens(other.generate(requests(n=3), SAMPLED)) == expected
