"""The decode engine on a tiny Qwen3.5-MoE that transformers wrote: the Qwen3.5 engine
tests' requests (text over two chunks of the gated delta rule, an image, a video, both
with text between), each a group whose samples fork their prompt's DeltaNet state, now
through sparse MoE layers. Qwen3.5's greedy and sampled-fork cases run on this module's
pair (pytest gives a test the fixture of the module it collects it in): greedy tokens equal
transformers' generate, sampled logprobs equal transformers' log-softmax over each sample's
own full sequence. The graph stand-in with group-shared decode gives the eager engine's tokens."""

import pytest

from test_qwen3_5_engine import (SAMPLED, engine, requests, tokens,  # noqa: F401
                                 test_greedy_equals_transformers_generate,
                                 test_sampled_forks_match_transformers_on_their_full_sequences)
from test_qwen3_5_moe_model import make_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory)
    return hf, ours


def test_graphs_and_group_shared_decode_give_eager_tokens(pair):
    _, ours = pair
    expected = tokens(engine(ours).generate(requests(n=3), SAMPLED))
    other = engine(ours, shared_prefix_decode=True, max_num_seqs=16)
    other.runner.use_cuda_graphs = True
    assert tokens(other.generate(requests(n=3), SAMPLED)) == expected
