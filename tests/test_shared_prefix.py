"""Prompt computed once per GRPO group: logprobs and every parameter's gradient
equal the plain per-sample full-sequence forward."""

import pytest
import torch

from rollplex.models import build_model
from rollplex.models.inputs import Group, Prompt, Sample
from rollplex.models.packing import pack_groups
from rollplex.train.actor import response_logprobs
from test_model import IMG, VEND, VID, VSTART, image, tiny_args


def group(prompt: Prompt, responses: list[list[int]]) -> Group:
    """A group of made-up responses (the passes read only their tokens)."""
    return Group(prompt, [Sample(r, [0.0] * len(r), "stop") for r in responses])


def groups() -> list[Group]:
    a, ga, na = image(1, 4, 6, seed=30)
    v, gv, nv = image(4, 4, 4, seed=31)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(1, 89, (n,), generator=g).tolist()  # noqa: E731
    return [
        group(Prompt(torch.tensor([1, VSTART] + [IMG] * na + [VEND, 5, 6]), pixel_values=a, image_grid_thw=ga),
              [rand(3), rand(5), rand(1)]),
        group(Prompt(torch.tensor([2, 3, VSTART] + [VID] * nv + [VEND, 7]), pixel_values_videos=v,
                     video_grid_thw=gv, second_per_grid_ts=torch.tensor([1.5])),
              [rand(4), rand(2)]),
        # a response that samples a vision pad id is plain text, not an image slot
        group(Prompt(torch.tensor([4, 8, 9])), [rand(2) + [IMG], rand(6), rand(3), rand(2)]),
    ]


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_args(), seed=5, init_std=None)


def loss_and_grads(model, share_prefix: bool):
    model.zero_grad()
    batch = pack_groups(model.args, groups(), share_prefix=share_prefix)
    logprobs, entropy = response_logprobs(model, batch, with_entropy=True)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel())  # stands in for advantages
    loss = (logprobs * weights).sum() + 0.1 * entropy.sum()
    loss.backward()
    return logprobs.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prefix_equals_per_sample_forward(model):
    lp_plain, loss_plain, grads_plain = loss_and_grads(model, share_prefix=False)
    lp_shared, loss_shared, grads_shared = loss_and_grads(model, share_prefix=True)
    assert torch.allclose(lp_shared, lp_plain, atol=1e-5)
    assert abs(loss_shared - loss_plain) <= 1e-5 * abs(loss_plain)
    for name, g in grads_plain.items():
        err = (grads_shared[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
    assert grads_plain["visual.patch_embed.proj.weight"].norm() > 0  # gradients reach the vision tower


def test_shared_prefix_computes_the_prompt_once(model):
    shared = pack_groups(model.args, groups(), share_prefix=True)
    plain = pack_groups(model.args, groups(), share_prefix=False)
    prompt_tokens = sum(len(g.prompt.input_ids) for g in groups())
    response_tokens = sum(len(r) for g in groups() for r in g.responses)
    assert shared.packed.input_ids.numel() == prompt_tokens + response_tokens
    assert plain.packed.input_ids.numel() > shared.packed.input_ids.numel()
    assert shared.packed.pixel_values.shape[0] * 3 == plain.packed.pixel_values.shape[0]  # 3 samples, 1 image


def kept_loss_and_grads(model):
    """The same loss with the prompts computed first (graph kept) and the
    responses in a later suffix-only pass, split over two micro-batches."""
    from rollplex.train.logprob_head import token_logprobs
    from rollplex.train.kept_prefix import SuffixUnit, prepare_prompts, prompt_forward, suffix_hidden

    model.zero_grad()
    gs = groups()
    *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in gs]))  # its last yield: the KeptPrefix
    kept = kept.boundary()
    weights = torch.linspace(-1.0, 1.0, sum(len(r) for g in gs for r in g.responses))
    micro_batches = [[SuffixUnit(0, gs[0]), SuffixUnit(2, Group(gs[2].prompt, gs[2].samples[:2]))],
                     [SuffixUnit(1, gs[1]), SuffixUnit(2, Group(gs[2].prompt, gs[2].samples[2:]))]]
    response_ids = [[0, 1, 2, 5, 6], [3, 4, 7, 8]]  # each micro-batch's responses, in the groups' order
    lens = [len(r) for g in gs for r in g.responses]
    per_response_weights = weights.split(lens)
    lps, loss = [None] * len(lens), 0.0
    for units, ids in zip(micro_batches, response_ids):
        targets = torch.tensor([t for u in units for r in u.group.responses for t in r])
        lp, entropy = token_logprobs(model, suffix_hidden(model, kept, units), targets, with_entropy=True)
        for i, piece in zip(ids, lp.split([lens[i] for i in ids])):
            lps[i] = piece
        mb_loss = (lp * torch.cat([per_response_weights[i] for i in ids])).sum() + 0.1 * entropy.sum()
        mb_loss.backward()
        loss += mb_loss.detach()
    kept.backward_into_prompt()
    return torch.cat(lps).detach(), loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_kept_prompt_then_suffix_passes_equal_the_shared_forward(model):
    lp_shared, loss_shared, grads_shared = loss_and_grads(model, share_prefix=True)
    lp_kept, loss_kept, grads_kept = kept_loss_and_grads(model)
    assert torch.allclose(lp_kept, lp_shared, atol=1e-6)
    assert abs(loss_kept - loss_shared) <= 1e-5 * abs(loss_shared)
    for name, g in grads_shared.items():
        err = (grads_kept[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
