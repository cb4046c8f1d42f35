"""The decode engine on a tiny Qwen3-VL-MoE that transformers wrote: Qwen3-VL's engine cases
(greedy tokens equal transformers' generate, logprobs equal transformers' full-sequence
log-softmax, the graph stand-in and group-shared decode give the eager engine's tokens), run on
this module's pair (pytest gives a test the fixture of the module it collects it in). The
experts route each token by its own hidden state, at prefill and at every decode step alike,
padded graph rows too, which change no real row's tokens. Multi-turn episodes (tests/test_agent_engine.py's
cases, through Qwen3-VL's `model` and `image` fixtures): an observation's continuation prefill routes its tokens
as any prefill does."""

import pytest

from test_agent_engine import test_observations_prefilled_onto_kv_and_logprobs_equal_whole_trajectory  # noqa: F401
from test_qwen3_vl_engine import (image, model, test_graphs_and_group_shared_decode_give_eager_tokens,  # noqa: F401
                                  test_greedy_equals_transformers_generate,
                                  test_logprobs_equal_transformers_log_softmax)
from test_qwen3_vl_moe_model import make_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, seed=5)
    return hf, ours
