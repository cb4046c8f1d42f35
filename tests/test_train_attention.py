"""Training-pass attention of GRPO groups (prompt computed once, responses over
it) against a plain reference: every response as its own sequence
[prompt | response], attended with SDPA and K/V copied per query head."""

import pytest
import torch
import torch.nn.functional as F

from rollplex.ops import attention
from rollplex.ops.attention import GroupLayout, KeptPrefixAttention, SharedPrefixAttention

Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
# Two groups; equal-length responses share one kernel call, the odd ones get their own.
PROMPT_LENS = (7, 4)
RESPONSE_LENS = ((3, 5, 3, 1), (2, 2))


@pytest.fixture(params=["torch", "flash"])
def backend(request, monkeypatch):
    """'flash' builds flash-attn's layout (one varlen call over keys gathered per
    segment) and runs it through the torch varlen kernel, so its indexing is
    tested without a GPU."""
    if request.param == "flash":
        torch_varlen = attention.varlen_attention
        monkeypatch.setattr(attention, "varlen_attention",
                            lambda *args, backend, **kwargs: torch_varlen(*args, backend="torch", **kwargs))
    return request.param


def reference(q_prompt, k_prompt, v_prompt, q_resp, k_resp, v_resp):
    """Per-response full sequences: (prompt output, response output)."""
    def attend(q, k, v):
        rep = Q_HEADS // KV_HEADS
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True).transpose(0, 1)

    prompt_out = attend(q_prompt, k_prompt, v_prompt)
    p = q_prompt.shape[0]
    # Each response attends the prompt plus itself; keep only its own rows of the full sequence's output.
    resp_out = attend(torch.cat([q_prompt, q_resp]), torch.cat([k_prompt, k_resp]),
                      torch.cat([v_prompt, v_resp]))[p:]
    return prompt_out, resp_out


def random_group(prompt_len, response_lens, seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n, h: torch.randn(n, h, HEAD_DIM, generator=g, requires_grad=True)  # noqa: E731
    total = sum(response_lens)
    return ([rand(prompt_len, Q_HEADS), rand(prompt_len, KV_HEADS), rand(prompt_len, KV_HEADS)],
            [rand(total, Q_HEADS), rand(total, KV_HEADS), rand(total, KV_HEADS)])


def reference_outputs(groups):
    """Reference outputs in packed order: per group its prompt, then its responses."""
    out = []
    for (prompt, resp), lens in zip(groups, RESPONSE_LENS):
        per_response = [reference(*prompt, q, k, v) for q, k, v in zip(*(t.split(lens) for t in resp))]
        out += [per_response[0][0], *(r_out for _, r_out in per_response)]
    return torch.cat(out)


def gradients(out, groups, weights):
    """Gradients of a weighted sum of `out` to every group's q/k/v (zero where unused)."""
    (out * weights).sum().backward()
    leaves = [t for prompt, resp in groups for t in (*prompt, *resp)]
    grads = [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads


def test_shared_prefix_attention_equals_per_response_sdpa(backend):
    groups = [random_group(p, lens, seed) for seed, (p, lens) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS))]
    layouts, start = [], 0
    for p, lens in zip(PROMPT_LENS, RESPONSE_LENS):
        layouts.append(GroupLayout.packed(start, p, lens))
        start = layouts[-1].end
    packed = [torch.cat([t for prompt, resp in groups for t in (prompt[i], resp[i])]) for i in range(3)]
    out = SharedPrefixAttention(layouts, backend)(0, *packed)
    expected = reference_outputs(groups)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(out, expected, atol=1e-5)
    for got, want in zip(gradients(out, groups, weights), gradients(expected, groups, weights)):
        assert torch.allclose(got, want, atol=1e-5)  # q, prompt K/V (summed over responses), response K/V


def test_kept_prefix_attention_equals_per_response_sdpa(backend):
    """Responses only in the batch; the prompts' K/V were kept from an earlier pass
    (here in reverse order, so prompt rows and response rows do not line up)."""
    groups = [random_group(p, lens, seed) for seed, (p, lens) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS))]
    kept_k = torch.cat([prompt[1] for prompt, _ in reversed(groups)])
    kept_v = torch.cat([prompt[2] for prompt, _ in reversed(groups)])
    prompt_starts = [PROMPT_LENS[1], 0]
    suffix, start = [], 0
    for p0, p, lens in zip(prompt_starts, PROMPT_LENS, RESPONSE_LENS):
        suffix.append(GroupLayout(p0, p, start, lens))
        start = suffix[-1].end
    q, k, v = (torch.cat([resp[i] for _, resp in groups]) for i in range(3))
    out = KeptPrefixAttention([kept_k], [kept_v], suffix, backend)(0, q, k, v)
    response_rows = torch.cat([torch.arange(p + sum(lens)) >= p for p, lens in zip(PROMPT_LENS, RESPONSE_LENS)])
    expected = reference_outputs(groups)[response_rows]
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(out, expected, atol=1e-5)
    for got, want in zip(gradients(out, groups, weights), gradients(expected, groups, weights)):
        assert torch.allclose(got, want, atol=1e-5)  # prompt queries: zero (not in a suffix pass) on both sides
