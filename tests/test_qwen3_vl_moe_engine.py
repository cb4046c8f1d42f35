"""The decode engine on a tiny Qwen3-VL-MoE that transformers wrote: Qwen3-VL's engine cases
(greedy tokens equal transformers' generate, logprobs equal transformers' full-sequence
log-softmax, the graph stand-in and group-shared decode give the eager engine's tokens), run on
this module's pair (pytest gives a test the fixture of the module it collects it in). The
experts route each token by its own hidden state, at prefill and at every decode step alike,
padded graph rows too, which change no real row's tokens."""

import pytest

from test_qwen3_vl_engine import (test_graphs_and_group_shared_decode_give_eager_tokens,  # noqa: F401
                                  test_greedy_equals_transformers_generate,
                                  test_logprobs_equal_transformers_log_softmax)
from test_qwen3_vl_moe_model import make_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, seed=5)
    return hf, ours
