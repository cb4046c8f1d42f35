"""GRPO-family losses on plain tensors: advantages, PPO clip, KL, entropy.

Shapes: a micro-batch is B padded responses of T tokens; ``mask`` (B, T) is 1/True
on response tokens and 0/False on padding. Prompt tokens are not in these tensors.

Normalisation contract (one rule for the pg loss, the KL term and the entropy bonus):

    Every loss returned here is ``sum of this call's contributions / G``, where G
    is a *global* normaliser counted over the whole optimizer batch, i.e. every
    micro-batch on every data-parallel rank:

      token-mean               G = global_tokens  (sum of mask over all of them)
      seq-mean-token-mean      G = global_seqs    (number of responses in all of them)
      seq-mean-token-sum-norm  G = global_seqs * max_response_len

    So the global batch loss is the plain SUM of the returned losses over
    micro-batches and ranks. The caller therefore
      * calls ``backward()`` on each micro-batch's loss as it is (gradient
        accumulation by summation, no division by the number of micro-batches);
      * undoes the data-parallel mean: FSDP2 (like DDP) averages gradients over the
        dp ranks, so multiply each loss by the dp world size before ``backward()``
        (the dp_shard degree, not tp: tp ranks see the same tokens), or call
        ``FSDPModule.set_gradient_divide_factor(1.0)`` once instead.
    Then the gradient equals that of one call on the whole global batch, whatever
    the micro-batch split and rank count. The defaults (normalisers counted from
    this call alone) are right only when one call sees the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")

# verl clamps log-ratios to this range before exp(): a ratio of e^20 is already
# meaningless, and e^89 overflows fp32 to inf, which reaches the gradient as NaN.
_LOG_RATIO_LIMIT = 20.0


def group_advantages(
    rewards: Tensor, group_index: Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Outcome advantages normalised within each prompt group.

    GRPO (DeepSeekMath, arXiv:2402.03300):  A_i = (r_i - mean_g) / (std_g + eps)
    Dr. GRPO (arXiv:2503.20783, ``norm_by_std=False``):  A_i = r_i - mean_g

    ``std_g`` is the unbiased (n - 1) standard deviation, as verl's GRPO uses
    ``torch.std``. Groups may be in any order and of any size; ``group_index``
    holds any integer ids. A group whose rewards are all equal, and a group of
    one, gets exactly zero advantage: it carries no learning signal (verl instead
    passes a singleton's raw reward through, which rewards an unbaselined sample).

    Args:
        rewards: (N,) scalar reward per response.
        group_index: (N,) long, the prompt group of each response.
    Returns:
        (N,) float32 advantages.
    """
    r = rewards.detach().float()
    # Compact arbitrary ids to 0..G-1 so the per-group buffers are dense.
    _, gid = torch.unique(group_index, return_inverse=True)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    count = torch.zeros(n_groups, device=r.device).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    # Equal rewards need an exact test: their float mean can be off by one ulp,
    # and that residue divided by eps would be a large spurious advantage.
    g_max = torch.full((n_groups,), -torch.inf, device=r.device).scatter_reduce(0, gid, r, "amax")
    g_min = torch.full((n_groups,), torch.inf, device=r.device).scatter_reduce(0, gid, r, "amin")
    no_signal = (g_max == g_min)[gid]  # also true for every singleton group
    if norm_by_std:
        sq = torch.zeros(n_groups, device=r.device).index_add_(0, gid, centred.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        centred = centred / (std[gid] + eps)
    return torch.where(no_signal, 0.0, centred)


def agg_loss(
    values: Tensor,
    mask: Tensor,
    agg: str,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
    max_response_len: int | None = None,
) -> Tensor:
    """Reduce per-token values (B, T) to this call's share of the batch loss.

    With l_it the value of token t of response i and m_it the mask:
      token-mean (DAPO token-level loss, arXiv:2503.14476):
          sum_it m_it l_it / global_tokens
      seq-mean-token-mean (GRPO, arXiv:2402.03300):
          sum_i (sum_t m_it l_it / sum_t m_it) / global_seqs
      seq-mean-token-sum-norm (Dr. GRPO, arXiv:2503.20783):
          sum_it m_it l_it / (global_seqs * max_response_len)

    See the module docstring for the global normalisers and how to scale for
    data parallelism. ``max_response_len`` must be the configured generation limit,
    not this micro-batch's padded T, or micro-batches would be weighted unequally.
    A response with no masked token contributes zero but still counts in
    ``global_seqs`` if the caller counted it (the default counts every row).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    if agg == "seq-mean-token-sum-norm" and max_response_len is None:
        raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs max_response_len")
    mask = mask.bool()
    # where, not multiply: padding may hold inf/NaN, and 0 * inf = NaN.
    tok = torch.where(mask, values, 0.0)
    n_seqs = global_seqs if global_seqs is not None else values.shape[0]
    if agg == "token-mean":
        n_tok = global_tokens if global_tokens is not None else mask.sum().clamp(min=1)
        return tok.sum() / n_tok
    if agg == "seq-mean-token-mean":
        return (tok.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    return tok.sum() / (n_seqs * max_response_len)


@dataclass
class PolicyLossMetrics:
    """Diagnostics of one policy_loss call, as detached 0-dim float32 tensors.

    Tensors, not floats, so a micro-batch loop does not sync the device each call;
    ``.item()`` them once per step. Definitions follow verl's compute_policy_loss.
    """

    pg_loss: Tensor
    """This call's loss contribution (sum over micro-batches and ranks = batch loss)."""
    pg_clipfrac: Tensor
    """Masked-token fraction where the clipped PPO term was chosen (strictly larger)."""
    pg_clipfrac_lower: Tensor
    """Masked-token fraction with A < 0 where the dual-clip bound -A * clip_c was chosen."""
    ppo_kl: Tensor
    """Masked mean of old_logprobs - logprobs over this call's tokens."""


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
    max_response_len: int | None = None,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float = 0.0,
) -> tuple[Tensor, PolicyLossMetrics]:
    """Clipped policy-gradient loss with clip-higher, dual-clip and optional TIS.

    With ratio = exp(logp - logp_old) and advantage A, per token:
      PPO clip with asymmetric bounds (PPO, arXiv:1707.06347; DAPO clip-higher,
      arXiv:2503.14476):
          l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
      dual-clip for A < 0 (Dual-clip PPO, arXiv:1912.09729), clip_c > 1:
          l = min(l, -A * clip_c)
      truncated importance sampling, when ``rollout_logprobs`` is given and
      tis_cap > 0 (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
      You Off-Policy RL Training", as in verl), corrects for the rollout engine's
      logprobs differing from the trainer's:
          l = l * min(exp(logp_old - logp_rollout), tis_cap)      (no gradient)
    then ``agg_loss`` reduces l over tokens (see the module normalisation contract).

    Args:
        logprobs: (B, T) current policy logprobs of the response tokens (grad).
        old_logprobs: (B, T) behaviour-policy logprobs (no grad).
        advantages: (B,) per response or (B, T) per token.
        mask: (B, T) 1 on response tokens.
    Returns:
        (loss, metrics): the scalar float32 loss to backward, and diagnostics.
    """
    if clip_c <= 1:
        raise ValueError(f"dual-clip bound clip_c must be > 1, got {clip_c}")
    mask = mask.bool()
    adv = advantages.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    # fp32: the clip decisions compare ratios near 1, where bf16 has ~3 digits.
    # Padding's log-ratio is set to 0 so its values can never leak in, even as NaN.
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.detach().float(), 0.0)
    log_ratio = log_ratio.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()

    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    # Without the dual clip a negative-advantage token with a huge ratio gives an
    # unbounded loss; the bound caps it (and zeroes its gradient).
    dual_bound = -adv * clip_c
    loss_tok = torch.where(adv < 0, torch.minimum(loss_ppo, dual_bound), loss_ppo)

    if rollout_logprobs is not None and tis_cap > 0:
        log_w = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), 0.0)
        loss_tok = loss_tok * log_w.exp().clamp(max=tis_cap).detach()

    loss = agg_loss(loss_tok, mask, agg, global_tokens, global_seqs, max_response_len)

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)
        metrics = PolicyLossMetrics(
            pg_loss=loss.detach(),
            pg_clipfrac=((loss_clipped > loss_unclipped) & mask).sum() / n_tok,
            pg_clipfrac_lower=((loss_ppo > dual_bound) & (adv < 0) & mask).sum() / n_tok,
            ppo_kl=torch.where(mask, -log_ratio, 0.0).sum() / n_tok,
        )
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens' logprobs.

    Schulman, "Approximating KL Divergence" (blog, 2020), with x = logp - logp_ref:
      k1 = x                      unbiased, high variance, can be negative
      k2 = x^2 / 2                biased, low variance
      k3 = exp(-x) + x - 1        unbiased, low variance, >= 0 (verl "low_var_kl")
    k3 clamps -x to [-20, 20] before exp and the result to [-10, 10], as verl does,
    so one drifted token cannot dominate the loss or overflow.

    Returns a (B, T) float32 tensor; reduce it with ``agg_loss``.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")
    x = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x.square()
    neg = (-x).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return (neg.exp() - neg - 1).clamp(-10.0, 10.0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in float32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v  (equal to -sum p log p, but with
    no log of a probability that underflows to 0). Logits must be finite; the
    actor passes them divided by the rollout's temperature (the sampling policy's).
    Returns logits.shape[:-1]; reduce it with ``agg_loss`` for the entropy bonus.
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
