"""The policy update: micro-batch splitting, shared prefix and data/tensor
parallelism leave the updated weights unchanged; bad input is caught."""

import json
import math

import pytest
import torch

from distributed import run_distributed
from rollplex.models import build_model
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch
from rollplex.train.loss import group_advantages
from test_model import tiny_args
from test_shared_prefix import groups


def policy_batch(model, cfg: ActorConfig) -> PolicyBatch:
    gs = groups()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 0.9, 0.1, 0.4])
    index = torch.tensor([g for g, grp in enumerate(gs) for _ in grp.responses])
    old = Actor(model, cfg).logprobs(model, gs)
    return PolicyBatch(gs, group_advantages(rewards, index).tolist(), old, ref_logprobs=[o - 0.1 for o in old])


def updated_params(steps: int = 2, **overrides) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-3, kl_coef=0.1, entropy_coef=0.01, **overrides)
    actor = Actor(model, cfg)
    batch = policy_batch(model, cfg)
    for _ in range(steps):
        metrics = actor.update(batch)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b, tol=1e-5):
    """Adam divides by sqrt(v), so rounding noise in near-zero gradients (e.g. the vision
    key bias, whose true gradient is 0) moves weights by up to ~lr * 1e-3."""
    for name in a:
        assert (a[name] - b[name]).abs().max() <= tol, name


@pytest.fixture(scope="module")
def reference():
    return updated_params(max_tokens_per_micro_batch=4096)


def test_micro_batch_split_does_not_change_the_update(reference):
    assert_same(updated_params(max_tokens_per_micro_batch=40), reference)  # splits groups too


def test_shared_prefix_update_equals_per_sample(reference):
    assert_same(updated_params(max_tokens_per_micro_batch=4096, share_prefix=False), reference)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_other_aggregations_are_split_invariant(agg):
    assert_same(updated_params(max_tokens_per_micro_batch=40, loss_agg_mode=agg),
                updated_params(max_tokens_per_micro_batch=4096, loss_agg_mode=agg))


def test_budget_smaller_than_one_sequence():
    model = build_model(tiny_args(), seed=5, init_std=None)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=10 is smaller than one sequence.*= \d+ tokens"):
        Actor(model, ActorConfig(max_tokens_per_micro_batch=10)).micro_batches(groups())


def test_nan_step_is_skipped_and_counted():
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3))
    batch = policy_batch(model, actor.config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = PolicyBatch(batch.groups, [float("nan")] * len(batch.advantages), batch.old_logprobs)
    metrics = actor.update(bad)
    assert metrics["actor/skipped_steps"] == 1 and not math.isfinite(metrics["actor/grad_norm"])
    assert_same({n: p.detach() for n, p in model.named_parameters()}, before, tol=0)
    assert math.isfinite(actor.update(batch)["actor/grad_norm"])  # the run goes on


def parallel_update(rank: int, world: int, tp: int, out: str) -> None:
    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-4, kl_coef=0.1, entropy_coef=0.01, max_tokens_per_micro_batch=120)
    full = policy_batch(model, cfg)  # computed before sharding: same numbers as the single process
    mesh = build_mesh(ParallelDims.resolve(world, -1, tp), "cpu")
    parallelize(model, mesh)
    dp, dp_rank = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    # Each dp rank takes whole groups; response indices stay in batch order.
    mine = [g for g in range(len(full.groups)) if g % dp == dp_rank]
    firsts = [sum(len(g.responses) for g in full.groups[:i]) for i in range(len(full.groups))]
    ids = [firsts[g] + j for g in mine for j in range(len(full.groups[g].responses))]
    batch = PolicyBatch([full.groups[g] for g in mine], [full.advantages[i] for i in ids],
                        [full.old_logprobs[i] for i in ids], [full.ref_logprobs[i] for i in ids])
    actor = Actor(model, cfg, dp_group=mesh["dp_shard"].get_group())
    for _ in range(3):
        actor.update(batch)
    params = {n.replace("._checkpoint_wrapped_module", ""): p.full_tensor().tolist()
              for n, p in model.named_parameters()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(params, f)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_ranks_equal_one(tmp_path, tp):
    """dp_shard=2 (each rank half the groups) or tp=2: same weights after 3 steps."""
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    # lr 1e-4 keeps Adam's amplification of rounding noise (see assert_same) well under the tolerance.
    cfg = ActorConfig(lr=1e-4, kl_coef=0.1, entropy_coef=0.01, max_tokens_per_micro_batch=120)
    batch = policy_batch(model, cfg)
    actor = Actor(model, cfg)
    for _ in range(3):
        actor.update(batch)
    out = tmp_path / "params.json"
    run_distributed(parallel_update, 2, tp, str(out))
    got = json.loads(out.read_text())
    for name, p in model.named_parameters():
        assert (torch.tensor(got[name]) - p.detach()).abs().max() <= 1e-5, name


def test_optimizer_offload_gives_the_same_parameters(reference):
    """Offloading AdamW's state between steps changes where it lives, not the update."""
    assert_same(updated_params(max_tokens_per_micro_batch=4096, offload_optimizer=True), reference, tol=0)


def test_offloaded_state_holds_no_device_storage_between_steps():
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3, offload_optimizer=True))
    actor.update(policy_batch(model, actor.config))
    moments = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(t.untyped_storage().size() == 0 for t in moments)
    actor.offload.load()
    assert all(t.untyped_storage().size() == t.numel() * t.element_size() for t in moments)
