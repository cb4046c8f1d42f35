"""The policy update: micro-batch splitting, shared prefix and data/tensor
parallelism leave the update unchanged; bad input is caught.

The comparisons are on the gradient the optimizer receives (first step), not
only on the weights after AdamW: AdamW is invariant to the scale of the
gradient, so a wrong loss normaliser would not show in the weights."""

import json
import math

import pytest
import torch

from distributed import run_distributed
from rollplex.config import load_config
from rollplex.models import build_model
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch
from rollplex.train.logprob_head import token_logprobs
from rollplex.train.loss import group_advantages
from test_model import tiny_args
from test_shared_prefix import groups

# record_gradients wraps optimizer.step, which the LR scheduler notices and warns about.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def policy_batch(model, cfg: ActorConfig) -> PolicyBatch:
    gs = groups()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.2, 0.9, 0.1, 0.4])
    index = torch.tensor([g for g, grp in enumerate(gs) for _ in grp.responses])
    old = Actor(model, cfg).logprobs(model, gs)
    return PolicyBatch(gs, group_advantages(rewards, index).tolist(), old, ref_logprobs=[o - 0.1 for o in old])


def record_gradients(actor: Actor) -> list[dict[str, torch.Tensor]]:
    """The (full) gradient of every parameter each time the optimizer steps."""
    seen, step = [], actor.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({n.replace("._checkpoint_wrapped_module", ""):
                     (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                     for n, p in actor.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    actor.optimizer.step = recording_step
    return seen


def updated(steps: int = 2, **overrides) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(first step's gradients, weights after `steps` updates)."""
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-4, kl_coef=0.1, entropy_coef=0.01, grad_clip=0.0, **overrides)
    actor = Actor(model, cfg)
    grads = record_gradients(actor)
    batch = policy_batch(model, cfg)
    for _ in range(steps):
        metrics = actor.update(batch)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    return grads[0], {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_update(a, b, weight_tol=1e-5):
    """Gradients equal to 1e-5 relative per tensor; weights within `weight_tol` (AdamW
    divides by sqrt(v), so rounding noise in near-zero gradients, e.g. the vision key
    bias whose true gradient is 0, moves weights by up to ~lr * 1e-3)."""
    (grads_a, weights_a), (grads_b, weights_b) = a, b
    for name, g in grads_b.items():
        err = (grads_a[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-5 or (grads_a[name] - g).abs().max() <= 1e-9, f"{name}: relative gradient error {err:.2e}"
    assert_same(weights_a, weights_b, weight_tol)


def assert_same(a, b, tol=1e-5):
    for name in a:
        assert (a[name] - b[name]).abs().max() <= tol, name


@pytest.fixture(scope="module")
def reference():
    return updated(max_tokens_per_micro_batch=4096)


def test_micro_batch_split_does_not_change_the_update(reference):
    assert_same_update(updated(max_tokens_per_micro_batch=40), reference)  # splits groups too


def test_shared_prefix_update_equals_per_sample(reference):
    assert_same_update(updated(max_tokens_per_micro_batch=4096, share_prefix=False), reference)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_other_aggregations_are_split_invariant(agg):
    assert_same_update(updated(max_tokens_per_micro_batch=40, loss_agg_mode=agg),
                       updated(max_tokens_per_micro_batch=4096, loss_agg_mode=agg))


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
    assert metrics["actor/skipped_steps_total"] == 1 and not math.isfinite(metrics["actor/grad_norm"])
    assert_same({n: p.detach() for n, p in model.named_parameters()}, before, tol=0)
    assert math.isfinite(actor.update(batch)["actor/grad_norm"])  # the run goes on


def test_logprobs_and_entropy_are_of_the_tempered_distribution():
    # What the rollout sampled from at temperature 0.7: softmax(logits / 0.7).
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    hidden, targets = torch.randn(7, model.args.text.hidden_size), torch.randint(0, 100, (7,))
    logprobs, entropy = token_logprobs(model, hidden, targets, with_entropy=True, temperature=0.7)
    tempered = (model.logits(hidden).double() / 0.7).log_softmax(-1)
    torch.testing.assert_close(logprobs.double(), tempered.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(tempered.exp() * tempered).sum(-1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rollout_temperature, trainer_temperature", [(0.7, 0.7), (1.0, 1.0), (0.0, 1.0)])
def test_the_actor_computes_logprobs_at_the_rollout_temperature(rollout_temperature, trainer_temperature):
    # A greedy rollout (0) returns untempered logprobs: the trainer's are too.
    cfg = load_config(["--rollout.temperature", str(rollout_temperature)])
    assert ActorConfig.from_config(cfg, micro_batch_tokens=4096).temperature == trainer_temperature


def test_rollout_probs_diff_only_on_the_weights_that_sampled():
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3))
    batch = policy_batch(model, actor.config)
    batch.rollout_logprobs = batch.old_logprobs  # an engine that matches the trainer exactly
    metrics = actor.update(batch)
    assert metrics["training/rollout_probs_diff_max"] < 1e-6
    batch.rollout_weights = False  # after a step: the difference would be the policy's drift
    assert not any(k.startswith("training/rollout_probs_diff") for k in actor.update(batch))


def parallel_update(rank: int, world: int, tp: int, out: str) -> None:
    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-4, kl_coef=0.1, entropy_coef=0.01, grad_clip=0.0, max_tokens_per_micro_batch=120)
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
    grads = record_gradients(actor)
    for _ in range(3):
        actor.update(batch)
    params = {n.replace("._checkpoint_wrapped_module", ""): p.full_tensor().tolist()
              for n, p in model.named_parameters()}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"params": params, "grads": {n: g.tolist() for n, g in grads[0].items()}}, f)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_ranks_equal_one(tmp_path, tp):
    """dp_shard=2 (each rank half the groups) or tp=2: the same first-step gradient
    and the same weights after 3 steps as one process on the whole batch."""
    torch.manual_seed(0)
    model = build_model(tiny_args(), seed=5, init_std=None)
    cfg = ActorConfig(lr=1e-4, kl_coef=0.1, entropy_coef=0.01, grad_clip=0.0, max_tokens_per_micro_batch=120)
    batch = policy_batch(model, cfg)
    actor = Actor(model, cfg)
    grads = record_gradients(actor)
    for _ in range(3):
        actor.update(batch)
    out = tmp_path / "params.json"
    run_distributed(parallel_update, 2, tp, str(out))
    got = json.loads(out.read_text())
    theirs = ({n: torch.tensor(g) for n, g in got["grads"].items()},
              {n: torch.tensor(p) for n, p in got["params"].items()})
    assert_same_update(theirs, (grads[0], {n: p.detach() for n, p in model.named_parameters()}))


def test_optimizer_offload_gives_the_same_parameters(reference):
    """Offloading AdamW's state between steps changes where it lives, not the update."""
    grads, weights = updated(max_tokens_per_micro_batch=4096, offload_optimizer=True)
    assert_same(weights, reference[1], tol=0)


def test_offloaded_state_holds_no_device_storage_between_steps():
    model = build_model(tiny_args(), seed=5, init_std=None)
    actor = Actor(model, ActorConfig(lr=1e-3, offload_optimizer=True))
    actor.update(policy_batch(model, actor.config))
    moments = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(t.untyped_storage().size() == 0 for t in moments)
    actor.offload.load()
    assert all(t.untyped_storage().size() == t.numel() * t.element_size() for t in moments)
