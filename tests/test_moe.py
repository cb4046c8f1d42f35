"""The sparse MoE block (rollplex.models.moe) and the grouped GEMM under it
(rollplex.ops.grouped_mm): against transformers' Qwen3.5-MoE block and its
load-balancing loss, both GEMM backends against each other, and routing replay."""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock, load_balancing_loss_func

from rollplex.models.moe import UNRECORDED, MoEArgs, Routing, SparseMoE, sort_by_expert
from rollplex.ops.grouped_mm import grouped_mm
from test_prefix_sync import HostSyncGuard

HIDDEN, INTER, SHARED, EXPERTS, TOP_K = 32, 16, 24, 8, 3


def block(shared: bool = True, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, MoEArgs(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER,
                                    shared_expert_intermediate_size=SHARED if shared else 0), layer=1)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-2] ** -0.5 if p.ndim == 3 else p.shape[-1] ** -0.5)
    return moe


def transformers_block(moe: SparseMoE) -> Qwen3_5MoeSparseMoeBlock:
    """transformers' block with `moe`'s weights (its experts stored transposed: (experts, out, in))."""
    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K, shared_expert_intermediate_size=SHARED)
    ref = Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        ref.gate.weight.copy_(moe.gate.weight)
        ref.experts.gate_up_proj.copy_(moe.experts.gate_up_proj.transpose(1, 2))
        ref.experts.down_proj.copy_(moe.experts.down_proj.transpose(1, 2))
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(ref.shared_expert, name).weight.copy_(getattr(moe.shared_expert, name).weight)
        ref.shared_expert_gate.weight.copy_(moe.shared_expert_gate.weight)
    return ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_backends_agree_with_gradients(dtype):
    torch.manual_seed(0)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 16, 8, dtype=dtype, requires_grad=True)
    ends = torch.tensor([3, 3, 9, 12], dtype=torch.int32)  # expert 1 gets no rows
    results = []
    for backend in ("grouped", "loop"):
        x.grad = w.grad = None
        out = grouped_mm(x, w, ends, backend)
        out.float().pow(2).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(results[1][0][3:9], (x[3:9] @ w[2]).detach())


def test_sort_by_expert_groups_pairs_by_expert_then_token():
    chosen = torch.tensor([[2, 0], [0, 3], [2, 1]])
    order, token_of, ends = sort_by_expert(chosen, 4)
    assert chosen.flatten()[order].tolist() == [0, 0, 1, 2, 2, 3]
    assert token_of.tolist() == [0, 1, 2, 0, 2, 1]
    assert ends.tolist() == [2, 3, 5, 6]


@pytest.mark.parametrize("backend", ["loop", "grouped"])
def test_block_matches_transformers(backend):
    moe = block()
    moe.experts.backend = backend
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        expected = transformers_block(moe)(x)
        got = moe(x.view(-1, HIDDEN)).view_as(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_aux_loss_matches_transformers():
    moe = block()
    x = torch.randn(10, HIDDEN)
    routing = Routing()
    moe(x, routing)
    moe.layer = 2
    moe(x * 2, routing)  # a second layer
    logits = (moe.gate(x), moe.gate(x * 2))
    expected = load_balancing_loss_func(logits, EXPERTS, TOP_K)
    torch.testing.assert_close(routing.aux_loss(EXPERTS), expected)


def test_replay_fixes_the_experts_and_keeps_the_router_gradient():
    moe = block()
    x = torch.randn(6, HIDDEN)
    recording = Routing()
    with torch.no_grad():
        moe(x, recording)
    routes = recording.routes()
    assert routes.shape == (6, 2, TOP_K) and (routes[:, 0] == UNRECORDED).all()
    # Replayed on other weights, the block routes as recorded, except the token never recorded.
    other = block(seed=1)
    routes[5] = UNRECORDED
    replay = Routing(replay=routes)
    out = other(x, replay)
    chosen = replay.layers[1].chosen
    assert torch.equal(chosen[:5], routes[:5, 1])
    live = torch.softmax(other.gate(x), -1).topk(TOP_K).indices
    assert torch.equal(chosen[5].long(), live[5])
    out.pow(2).sum().backward()
    assert other.gate.weight.grad.abs().sum() > 0
    metrics = replay.metrics()
    assert metrics["replayed"].item() == 5
    assert 0 <= metrics["agreed"].item() <= 5
    # Replaying a block's own routes: every replayed token agrees.
    own = Routing(replay=recording.routes())
    moe(x, own)
    assert own.metrics()["agreed"].item() == 6


def test_grouped_backend_routes_without_host_syncs():
    moe = block()
    moe.experts.backend = "grouped"
    x = torch.randn(5, HIDDEN)
    with torch.no_grad(), HostSyncGuard() as guard:
        moe(x, Routing())
    assert guard.calls == []
