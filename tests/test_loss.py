import math

import pytest
import torch

from rollplex.train.loss import (
    AGG_MODES,
    agg_loss,
    entropy_from_logits,
    group_advantages,
    kl_penalty,
    policy_loss,
)


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    # torch.testing.assert_close would import sympy on first use (~2 s).
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), (actual, expected)


# ---- group advantages -------------------------------------------------------


def test_group_advantages_two_interleaved_groups():
    # group 7: [1, 0, 1, 0] -> mean 0.5, unbiased std sqrt(1/3); group 3: [2, 4, 6] -> mean 4, std 2
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 1.0, 6.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 7])
    a = 0.5 / math.sqrt(1 / 3)
    expected = torch.tensor([a, -1.0, -a, 0.0, a, 1.0, -a])
    _close(group_advantages(rewards, groups), expected)


def test_group_advantages_dr_grpo_no_std():
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 1.0, 6.0, 0.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3, 7])
    expected = torch.tensor([0.5, -2.0, -0.5, 0.0, 0.5, 2.0, -0.5])
    _close(group_advantages(rewards, groups, norm_by_std=False), expected)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_zero_for_equal_rewards_and_singletons(norm_by_std):
    # 0.1 is not exact in binary: the group mean may differ from 0.1 by an ulp.
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    adv = group_advantages(rewards, groups, norm_by_std=norm_by_std)
    assert (adv[:4] == 0).all()
    assert adv[4] > 0 > adv[5]


# ---- policy loss: clipping ----------------------------------------------------


def _one_token(adv: float, ratio: float, **kw):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), m


# (A, ratio, loss, d loss / d logp, pg_clipfrac, pg_clipfrac_lower); bounds 0.8 / 1.28 / dual 3
CLIP_CASES = [
    (1.0, 1.27, -1.27, -1.27, 0, 0),  # A>0 just inside 1 + clip_high
    (1.0, 1.29, -1.28, 0.0, 1, 0),  # A>0 above: clipped, no gradient
    (1.0, 0.79, -0.79, -0.79, 0, 0),  # A>0 below 1 - clip_low: PPO does not clip this side
    (-1.0, 0.81, 0.81, 0.81, 0, 0),  # A<0 just inside 1 - clip_low
    (-1.0, 0.79, 0.80, 0.0, 1, 0),  # A<0 below: clipped, no gradient
    (-1.0, 1.29, 1.29, 1.29, 0, 0),  # A<0 above 1 + clip_high: unclipped
    (-1.0, 2.9, 2.9, 2.9, 0, 0),  # A<0 just under the dual-clip bound
    (-2.0, 5.0, 6.0, 0.0, 0, 1),  # dual clip: loss = -A * clip_c, no gradient
]


@pytest.mark.parametrize("adv,ratio,loss,grad,clipfrac,clipfrac_lower", CLIP_CASES)
def test_clip_higher_and_dual_clip(adv, ratio, loss, grad, clipfrac, clipfrac_lower):
    got_loss, got_grad, m = _one_token(adv, ratio)
    assert got_loss == pytest.approx(loss, abs=1e-5)
    assert got_grad == pytest.approx(grad, abs=1e-5)
    assert m.pg_clipfrac.item() == clipfrac
    assert m.pg_clipfrac_lower.item() == clipfrac_lower
    assert m.ppo_kl.item() == pytest.approx(-math.log(ratio), abs=1e-6)
    assert m.pg_loss.item() == pytest.approx(loss, abs=1e-5) and not m.pg_loss.requires_grad


def test_clip_c_must_exceed_one():
    with pytest.raises(ValueError, match="clip_c"):
        _one_token(-1.0, 1.0, clip_c=1.0)


# ---- aggregation ------------------------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0, float("nan")], [4.0, float("inf"), 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    "agg,kw,expected",
    [
        ("token-mean", {}, (1 + 2 + 3 + 4) / 4),
        ("token-mean", {"global_tokens": 10}, 10 / 10),
        ("seq-mean-token-mean", {}, (2 + 4) / 2),
        ("seq-mean-token-mean", {"global_seqs": 4}, (2 + 4) / 4),
        ("seq-mean-token-sum-norm", {"max_response_len": 5}, 10 / (2 * 5)),
        ("seq-mean-token-sum-norm", {"max_response_len": 5, "global_seqs": 4}, 10 / (4 * 5)),
    ],
)
def test_agg_modes_by_hand(agg, kw, expected):
    # padding holds NaN/inf on purpose: it must not reach the result
    assert agg_loss(VALUES, MASK, agg, **kw).item() == pytest.approx(expected)


def test_agg_errors():
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(VALUES, MASK, "seq-sum")
    with pytest.raises(ValueError, match="max_response_len"):
        agg_loss(VALUES, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="valid"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), agg="mean")


# ---- masking and micro-batch invariance ------------------------------------------------


def _batch(b: int = 6, t: int = 7, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t  # the first micro-batch is padded wider than the second (seed 2: 7 vs 5)
    mask = (torch.arange(t) < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 3
    # spread ratios over roughly [0.5, 4] so every clip branch is exercised
    logp = old + torch.empty(b, t).uniform_(-0.7, 1.4, generator=g)
    rollout = old + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, generator=g) * 2
    return logp, old, adv, mask, rollout


@pytest.mark.parametrize("agg", AGG_MODES)
def test_masked_tokens_change_nothing(agg):
    logp, old, adv, mask, rollout = _batch()
    kw = dict(agg=agg, max_response_len=7, rollout_logprobs=rollout, tis_cap=2.0)
    runs = []
    for fill in (0.0, float("nan")):
        lp = torch.where(mask.bool(), logp, fill).requires_grad_()
        loss, _ = policy_loss(lp, old, adv, mask, **kw)
        loss.backward()
        runs.append((loss.detach(), lp.grad))
    (loss_a, grad_a), (loss_b, grad_b) = runs
    _close(loss_a, loss_b)
    _close(grad_a, grad_b)
    assert (grad_b[mask == 0] == 0).all()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_split_gives_same_loss_and_gradient(agg):
    logp, old, adv, mask, rollout = _batch()
    kw = dict(agg=agg, max_response_len=7, tis_cap=2.0)

    whole = logp.clone().requires_grad_()
    loss_whole, m = policy_loss(whole, old, adv, mask, rollout_logprobs=rollout, **kw)
    loss_whole.backward()
    assert m.pg_clipfrac > 0 and m.pg_clipfrac_lower > 0  # every clip branch is in play

    global_n = dict(global_tokens=mask.sum(), global_seqs=mask.shape[0])
    parts = []  # (loss, grad) per micro-batch, each a fresh leaf
    for rows in (slice(0, 2), slice(2, 6)):
        cols = slice(0, int(mask[rows].sum(1).max()))  # each micro-batch padded to its own width
        lp = logp[rows, cols].clone().requires_grad_()
        args = (lp, old[rows, cols], adv[rows], mask[rows, cols])
        loss, _ = policy_loss(*args, rollout_logprobs=rollout[rows, cols], **kw, **global_n)
        loss.backward()
        grad = torch.zeros_like(logp)
        grad[rows, cols] = lp.grad
        parts.append((loss.detach(), grad))

    # Gradient accumulation on one rank: plain sum, no 1 / num_micro_batches.
    _close(sum(l for l, _ in parts), loss_whole.detach())
    _close(sum(g for _, g in parts), whole.grad)


# ---- truncated importance sampling ------------------------------------------------------


@pytest.mark.parametrize("tis_cap,factor", [(0.0, 1.0), (3.0, 2.0), (1.5, 1.5)])
def test_tis_factor_applied_and_capped(tis_cap, factor):
    # old/rollout = 2, ratio 1 and A = 1 -> untruncated loss -1, gradient -1
    logp = torch.zeros(1, 1, requires_grad=True)
    rollout = torch.full((1, 1), math.log(0.5), requires_grad=True)
    loss, _ = policy_loss(
        logp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), rollout_logprobs=rollout, tis_cap=tis_cap
    )
    loss.backward()
    assert loss.item() == pytest.approx(-factor)
    assert logp.grad.item() == pytest.approx(-factor)
    assert rollout.grad is None  # the weight is a constant


# ---- KL and entropy -------------------------------------------------------------------


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    ln2 = math.log(2)
    expected = {
        "k1": [ln2, -ln2],
        "k2": [0.5 * ln2**2, 0.5 * ln2**2],
        "k3": [0.5 + ln2 - 1, 2 - ln2 - 1],  # exp(ref - logp) - (ref - logp) - 1
    }
    for kind, values in expected.items():
        _close(kl_penalty(logp, ref, kind), torch.tensor([values]))


def test_k3_nonnegative_clamped_and_kind_checked():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(4, 50, generator=g) * 3, torch.randn(4, 50, generator=g) * 3
    k3 = kl_penalty(logp, ref)
    assert (k3 >= 0).all() and (k3 <= 10).all()
    assert kl_penalty(torch.tensor([[-50.0]]), torch.tensor([[0.0]])).item() == 10.0
    # the KL term is reduced with the same aggregation as the pg loss
    mask = torch.ones(4, 50)
    assert agg_loss(k3, mask, "token-mean").item() == pytest.approx(k3.mean().item())
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "low_var")


def test_entropy_from_logits():
    _close(entropy_from_logits(torch.zeros(2, 3, 4)), torch.full((2, 3), math.log(4)))
    # a peaked row would give log(0) in -sum p log p; here it is finite and ~0
    peaked = entropy_from_logits(torch.tensor([[1000.0, 0.0, 0.0]]))
    assert torch.isfinite(peaked).all() and peaked.item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(2))
    p = logits.softmax(-1)
    _close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
