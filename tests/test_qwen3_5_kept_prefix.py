"""Kept-prefix passes on Qwen3.5's hybrid decoder: the prompt forward keeps the full-attention
layers' K/V and the Gated DeltaNet layers' final states (convolution tail, fp32 recurrent
state) per prompt; the suffix passes continue every response from them. Logprobs and every
parameter's gradient (through boundary() and one prompt backward after two suffix
micro-batches) equal the packed shared-prefix pass's, which tests/test_qwen3_5_model.py
checks against transformers."""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from rollplex.models import build_model
from rollplex.models.inputs import Group, Prompt, Sample
from rollplex.models.packing import pack_groups
from rollplex.models.qwen3_5 import FAMILY, Qwen3_5
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, response_logprobs
from rollplex.train.kept_prefix import KeptPrefix, SuffixUnit, prepare_prompts, prompt_forward, suffix_hidden
from rollplex.train.logprob_head import token_logprobs

IMG, VSTART, VEND = 90, 92, 93  # tiny_args's image pad, vision start and end


@pytest.fixture(scope="module")
def model() -> Qwen3_5:
    model = build_model(FAMILY.tiny_args(), seed=1, init_std=None, family=FAMILY)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # decays exp(g) near 1, so that the state a prompt leaves matters to its responses
        for layer in model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                a_log = layer.linear_attn.A_log
                a_log.copy_((torch.rand(a_log.shape, generator=g) * 0.29 + 0.01).log())
                layer.linear_attn.dt_bias.fill_(-2.0)
    return model


def text(n: int, seed: int) -> list[int]:
    """n ordinary text tokens (below the vision ids)."""
    return torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def groups(args) -> list[Group]:
    """An image prompt over two chunks of the gated delta rule, with responses of one token, fewer than
    the convolution's window, a few and more than a chunk; a text prompt shorter than the window."""
    v = args.vision
    grid = torch.tensor([[1, 6, 6]])
    row = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    pixels = torch.randn(36, row, generator=torch.Generator().manual_seed(40))
    image_ids = [VSTART] + [IMG] * (36 // v.spatial_merge_size ** 2) + [VEND]
    image_prompt = Prompt(torch.tensor([1] + text(30, 8) + image_ids + text(30, 9)), pixel_values=pixels,
                          image_grid_thw=grid)
    sample = lambda tokens: Sample(tokens, [0.0] * len(tokens), "stop")  # noqa: E731
    return [Group(image_prompt, [sample(text(5, 10)), sample([7]), sample(text(70, 11)), sample(text(2, 12))]),
            Group(Prompt(torch.tensor([4, 5])), [sample(text(4, 13)), sample([8, 9]), sample(text(3, 14))])]


def loss_weights(data: list[Group]) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, sum(len(r) for g in data for r in g.responses))  # stands in for advantages


def gradients(model: Qwen3_5) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def shared_prefix_pass(model: Qwen3_5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logprobs and every parameter's gradient of a GRPO-like loss (weighted logprobs plus entropy)
    over the packed shared-prefix pass."""
    data = groups(model.args)
    logprobs, entropy = response_logprobs(model, pack_groups(model.args, data, share_prefix=True), with_entropy=True)
    ((logprobs * loss_weights(data)).sum() + 0.1 * entropy.sum()).backward()
    return logprobs.detach(), gradients(model)


def kept_prefix_passes(model: Qwen3_5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same loss with the prompts computed first (graph kept) and the responses in two later
    suffix micro-batches, each prompt's group split over both (the second prompt's first)."""
    data = groups(model.args)
    *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in data]))
    kept = kept.boundary()
    lens = [len(r) for g in data for r in g.responses]
    weights = loss_weights(data).split(lens)
    micro_batches = [([SuffixUnit(1, Group(data[1].prompt, data[1].samples[:2])),
                       SuffixUnit(0, Group(data[0].prompt, data[0].samples[:2]))], [4, 5, 0, 1]),
                     ([SuffixUnit(0, Group(data[0].prompt, data[0].samples[2:])),
                       SuffixUnit(1, Group(data[1].prompt, data[1].samples[2:]))], [2, 3, 6])]
    logprobs: list[torch.Tensor] = [torch.empty(0)] * len(lens)
    for units, ids in micro_batches:
        targets = torch.tensor([t for u in units for r in u.group.responses for t in r])
        lp, entropy = token_logprobs(model, suffix_hidden(model, kept, units), targets, with_entropy=True)
        for i, piece in zip(ids, lp.split([lens[i] for i in ids])):
            logprobs[i] = piece.detach()
        ((lp * torch.cat([weights[i] for i in ids])).sum() + 0.1 * entropy.sum()).backward()
    kept.backward_into_prompt()
    return torch.cat(logprobs), gradients(model)


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, g in want.items():
        assert g.norm() > 0, name
        err = ((got[name] - g).norm() / g.norm()).item()
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


def test_prompt_keeps_kv_of_attention_layers_and_states_of_deltanet_layers(model):
    data = groups(model.args)
    with torch.no_grad():
        *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in data]))
    shapes = model.recurrent_state_shapes()
    prompt_tokens = sum(len(g.prompt.input_ids) for g in data)
    assert list(kept.keys) == list(kept.values) == model.kv_layers() == [2]
    assert all(k.shape[0] == prompt_tokens for k in kept.keys.values())
    assert list(kept.conv_states) == list(kept.recurrent_states) == list(shapes.layers) == [0, 1]
    for layer in shapes.layers:
        assert kept.conv_states[layer].shape == (len(data), *shapes.conv)
        assert kept.recurrent_states[layer].shape == (len(data), *shapes.recurrent)
        assert kept.recurrent_states[layer].dtype == torch.float32
    kept_tensors = [*kept.keys.values(), *kept.values.values(), *kept.conv_states.values(),
                    *kept.recurrent_states.values(), kept.last_hidden]
    assert kept.nbytes == sum(t.numel() * t.element_size() for t in kept_tensors)


def test_suffix_passes_equal_the_shared_prefix_pass(model):
    lp_shared, grads_shared = shared_prefix_pass(model)
    lp_kept, grads_kept = kept_prefix_passes(model)
    assert (lp_kept - lp_shared).abs().max() <= 1e-5
    assert_same_gradients(grads_kept, grads_shared)


def test_checkpointed_prompt_forward_keeps_the_forward_states(model):
    """Under activation checkpointing the prompt's backward runs each layer again: the capture keeps the
    forward's states and K/V, and the gradients are those of the shared-prefix pass."""
    _, grads_shared = shared_prefix_pass(model)
    layers = model.language_model.layers
    plain = list(layers)
    for i, layer in enumerate(plain):
        layers[i] = checkpoint_wrapper(layer)
    try:
        *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in groups(model.args)]))
        forward_tensors = kept.tensors()
        sum(t.float().square().sum() for t in forward_tensors).backward()  # recomputes every layer
        assert all(now is then for now, then in zip(kept.tensors(), forward_tensors, strict=True))
        model.zero_grad(set_to_none=True)
        _, grads_kept = kept_prefix_passes(model)
    finally:
        for i, layer in enumerate(plain):
            layers[i] = layer
    assert_same_gradients({name.replace("._checkpoint_wrapped_module", ""): g for name, g in grads_kept.items()},
                          grads_shared)


def actor_step(model: Qwen3_5, kept: KeptPrefix | None) -> tuple[list[torch.Tensor], dict[str, float], dict]:
    """The actor's logprob pass and policy update (micro-batches of a few responses) with or without
    kept prompts: its logprobs, metrics and every parameter's gradient. At lr 0 the update leaves the
    weights as they are, and the optimizer keeps the gradients (its zero_grad does nothing here)."""
    data = groups(model.args)
    actor = Actor(model, ActorConfig(lr=0.0, grad_clip=0.0, max_tokens_per_micro_batch=145))
    actor.optimizer.zero_grad = lambda set_to_none=True: None
    assert len(actor.micro_batches(data)) == 3  # the first group split over two
    logprobs = actor.logprobs(model, data, kept=kept)
    advantages = torch.linspace(-1.0, 1.0, len(logprobs)).tolist()
    old = [lp - 0.01 for lp in logprobs]
    metrics = actor.update(PolicyBatch(data, advantages, old, kept=None if kept is None else kept.boundary()))
    return logprobs, metrics, gradients(model)


def test_actor_logprobs_and_update_with_kept_prompts_equal_those_without(model):
    plain_logprobs, plain_metrics, plain_grads = actor_step(model, None)
    *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in groups(model.args)]))
    kept_logprobs, kept_metrics, kept_grads = actor_step(model, kept)
    for got, want in zip(kept_logprobs, plain_logprobs, strict=True):
        assert (got - want).abs().max() <= 1e-5
    pg_loss = plain_metrics["actor/pg_loss"]
    assert abs(kept_metrics["actor/pg_loss"] - pg_loss) <= 1e-5 * abs(pg_loss)
    assert_same_gradients(kept_grads, plain_grads)


def test_prompt_forward_slices_read_nothing_back(model):
    """The overlap schedule issues a prompt forward in slices between decode steps, which must never
    make the host wait (tests/test_prefix_sync.py): the DeltaNet layers' ops read the prompts'
    boundaries from the PackedSequences prepare_prompts built, never from the device."""
    from test_prefix_sync import HostSyncGuard

    chunk = prepare_prompts(model, [g.prompt for g in groups(model.args)])
    with torch.no_grad(), HostSyncGuard() as guard:
        *_, kept = prompt_forward(model, chunk)
    assert guard.calls == [] and set(kept.recurrent_states) == {0, 1}
