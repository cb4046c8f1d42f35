"""Training on multi-turn (agentic) samples: a response holds, between the tokens the policy
sampled, the observations its tools returned (some with an image or a video), as
rollplex.models.inputs.Observation describes them.

- Every training layout (pack_groups with and without a shared prompt, the kept prompt's suffix
  passes) gives each response token, in fp32, the logprob of a plain forward of the whole
  trajectory as one prompt (all its images, positions from mrope_positions over the whole
  sequence): the observations' positions (rope.response_positions) and vision features are right.
- The three layouts give the same update, and the vision tower trains through observation images.
- Observation tokens carry no loss, no KL, no entropy and no probability difference, and the
  normalisers count the sampled tokens only.
- Single-turn groups pack as they always did.
"""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.data.processing import prepare_prompt
from rollplex.data.processor import load_processor
from rollplex.models import build_model
from rollplex.models.inputs import Group, Observation, Prompt, Sample
from rollplex.models.loader import read_model_args
from rollplex.models.packing import concat_vision, pack_groups, pack_sequences, response_inputs
from rollplex.models.rope import generated_positions, mrope_positions
from rollplex.tiny import TinySpec, write_tiny_files
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, response_logprobs
from rollplex.train.kept_prefix import KeptPrefix, prepare_prompts, prompt_forward
from rollplex.train.logprob_head import token_logprobs
from rollplex.train.loss import agg_loss, kl_penalty, policy_loss

LAYOUTS = ("shared", "per-sample", "kept")
IM_START = 1  # the tiny tokenizer's <|im_start|>


@dataclass
class Tiny:
    """A tiny model of a family with the processor of its folder (the same token ids)."""

    model: torch.nn.Module
    processor: object

    def words(self, text: str) -> list[int]:
        """Sampled tokens: the tiny vocabulary's words, one token each."""
        return self.processor.tokenizer.convert_tokens_to_ids(text.split())

    @property
    def image_pad(self) -> int:
        return self.model.args.rope_spec.image_token_id


def tiny_of(family: str, folder: Path) -> Tiny:
    write_tiny_files(folder, TinySpec.of(family))
    return Tiny(build_model(read_model_args(folder), seed=5, init_std=None), load_processor(folder))


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"])
def tiny(request, tmp_path_factory) -> Tiny:
    return tiny_of(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory) -> Tiny:
    return tiny_of("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl"))


def image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(56, 56, 3) * 255).astype("uint8"))


def tool_turn(tiny: Tiny, content: list[dict], **media) -> Prompt:
    """A tool's answer as the chat template renders it, from its turn's <|im_start|> to the next
    assistant turn's header, with its images or videos (`media`: prepare_prompt's)."""
    rendered = prepare_prompt(tiny.processor, [{"role": "tool", "content": content}], **media)
    second_turn = (rendered.input_ids == IM_START).nonzero().flatten()[1]  # after the template's system turn
    return replace(rendered, input_ids=rendered.input_ids[second_turn:], text="")


def sample(tiny: Tiny, *pieces: list[int] | Prompt) -> Sample:
    """A response of `pieces` in order: lists of tokens the policy sampled, and observations (the
    rendered Prompts); its rollout logprobs hold the engine's 0.0 at the observations."""
    tokens, observations = [], []
    for piece in pieces:
        if isinstance(piece, Prompt):
            observations.append(Observation.of(piece, len(tokens), tiny.model.args.rope_spec))
            piece = piece.input_ids.tolist()
        tokens += piece
    return Sample(tokens, [0.0] * len(tokens), "stop", observations=observations)


def trajectories(tiny: Tiny, sampled_pad: bool = False) -> list[Group]:
    """An image prompt's group (an image and a video observation in one response, a text one in
    another, a single-turn response, one that ends in an observation) and a text prompt's, whose
    only images are an observation's. `sampled_pad`: one response samples an image pad id, text
    to the model (a whole-trajectory forward would read it as an image)."""
    w = tiny.words
    question = prepare_prompt(tiny.processor, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what colour is it ?"}]}], images=[image(0)])
    seen = tool_turn(tiny, [{"type": "image"}, {"type": "text", "text": "red"}], images=[image(1)])
    moving = tool_turn(tiny, [{"type": "video"}, {"type": "text", "text": "left"}],
                       videos=[(np.random.RandomState(2).rand(4, 56, 56, 3) * 255).astype("uint8")])
    said = tool_turn(tiny, [{"type": "text", "text": "no answer"}])
    other = tool_turn(tiny, [{"type": "image"}], images=[image(3)])
    direction = prepare_prompt(tiny.processor, "which direction does the dot move ?")
    last = w("left") + ([tiny.image_pad] if sampled_pad else [])
    return [Group(question, [sample(tiny, w("look"), seen, w("red blue"), moving, w("the answer is"), last),
                             sample(tiny, w("look"), said, w("yes no red")),
                             sample(tiny, w("red green blue")),
                             sample(tiny, w("look look"), other)]),
            Group(direction, [sample(tiny, w("look"), other, w("left")), sample(tiny, w("up down"))])]


def whole_trajectory_logprobs(model, group: Group, s: Sample) -> torch.Tensor:
    """The response's token logprobs by a plain forward of prompt + response as ONE prompt, every
    image and video in order, positions from mrope_positions over the whole sequence."""
    sources = [group.prompt, *(o.prompt for o in s.observations)]
    seconds = [p.second_per_grid_ts for p in sources if p.second_per_grid_ts is not None]
    whole = Prompt(torch.cat([group.prompt.input_ids, torch.tensor(s.token_ids)]), **concat_vision(sources),
                   second_per_grid_ts=torch.cat(seconds) if seconds else None)
    n_prompt = len(group.prompt.input_ids)
    with torch.no_grad():
        hidden = model.forward_packed(pack_sequences(model.args, [whole]))
        return token_logprobs(model, hidden[n_prompt - 1:-1], torch.tensor(s.token_ids))[0]


def kept_prompts(model, groups: list[Group]) -> KeptPrefix:
    """The groups' prompts through a kept-prefix forward (its graph kept, under the caller's grad mode)."""
    *_, kept = prompt_forward(model, prepare_prompts(model, [g.prompt for g in groups]))
    return kept


def layout_logprobs(model, groups: list[Group], layout: str) -> list[torch.Tensor]:
    """The actor's logprob pass in `layout` (LAYOUTS)."""
    actor = Actor(model, ActorConfig(share_prefix=layout != "per-sample"))
    with torch.no_grad():
        kept = kept_prompts(model, groups) if layout == "kept" else None
    return actor.logprobs(model, groups, kept=kept)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_whole_trajectorys_logprobs(tiny, layout):
    groups = trajectories(tiny)
    got = layout_logprobs(tiny.model, groups, layout)
    want = [whole_trajectory_logprobs(tiny.model, g, s) for g in groups for s in g.samples]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a - b).abs().max() <= 1e-5, f"response {i}: {(a - b).abs().max():.2e}"


def update_with_gradients(actor: Actor, batch: PolicyBatch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """The metrics and every parameter's gradient of one policy update. The actor's lr must be 0: the
    update then leaves the weights as they are, and the optimizer keeps the gradients (its zero_grad
    does nothing here)."""
    assert actor.config.lr == 0.0
    actor.optimizer.zero_grad = lambda set_to_none=True: None
    metrics = actor.update(batch)
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    actor.model.zero_grad(set_to_none=True)
    return metrics, grads


def layout_update(model, groups: list[Group], layout: str, **config) -> tuple[dict[str, float], dict]:
    """`update_with_gradients` in `layout`, in one micro-batch (an MoE model's load-balancing loss is
    per forward: layouts that split the batch alike train alike)."""
    actor = Actor(model, ActorConfig(lr=0.0, grad_clip=0.0, share_prefix=layout != "per-sample", **config))
    old = layout_logprobs(model, groups, layout)
    kept = kept_prompts(model, groups).boundary() if layout == "kept" else None
    advantages = torch.linspace(-1.0, 1.0, len(old)).tolist()
    return update_with_gradients(actor, PolicyBatch(groups, advantages, [lp - 0.01 for lp in old], kept=kept))


def test_every_layout_trains_the_same(tiny):
    """With a pad id the policy sampled (text to every layout), an MoE model's load-balancing loss
    weighted up (each layout counts the sampled tokens in it), and the vision tower training through
    the observations' images."""
    groups = trajectories(tiny, sampled_pad=True)
    runs = {layout: layout_update(tiny.model, groups, layout, entropy_coef=0.01, moe_aux_loss_coef=0.5)
            for layout in LAYOUTS}
    want_metrics, want = runs["shared"]
    pg_loss = want_metrics["actor/pg_loss"]
    for layout in ("per-sample", "kept"):
        metrics, grads = runs[layout]
        assert abs(metrics["actor/pg_loss"] - pg_loss) <= 1e-5 * abs(pg_loss)
        assert grads.keys() == want.keys()
        for name, g in want.items():
            err = ((grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
            assert err <= 1e-5, f"{layout}, {name}: relative gradient error {err:.2e}"
    # The text prompt's group alone: its only images are an observation's, which the tower sees in the
    # suffix pass's own forward.
    _, grads = layout_update(tiny.model, trajectories(tiny)[1:], "kept")
    assert grads["visual.patch_embed.proj.weight"].norm() > 0


def test_text_responses_read_the_same_beside_observation_images(tiny):
    """A suffix pass with an observation's images runs the model's full forward, one without runs the
    decode forward: the text responses' logprobs are the same in both."""
    groups = trajectories(tiny)
    text_only = [Group(g.prompt, [s for s in g.samples if not s.observations]) for g in groups]
    actor = Actor(tiny.model, ActorConfig())
    with torch.no_grad():
        kept = kept_prompts(tiny.model, groups)
    beside_images = actor.logprobs(tiny.model, groups, kept=kept)
    alone = actor.logprobs(tiny.model, text_only, kept=kept)
    samples = [s for g in groups for s in g.samples]
    want = [lp for s, lp in zip(samples, beside_images) if not s.observations]
    for got, w in zip(alone, want, strict=True):
        assert (got - w).abs().max() <= 1e-6


def at_observations(logprobs: list[torch.Tensor], groups: list[Group], value: float) -> list[torch.Tensor]:
    """`logprobs` with every observation token's set to `value`."""
    samples = [s for g in groups for s in g.samples]
    return [torch.where(s.sampled_mask(), lp, value) for s, lp in zip(samples, logprobs, strict=True)]


def sampled_only(values: torch.Tensor, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values of the batch (flat, response after response) as (responses, longest) rows of
    the sampled tokens only, zero-padded, and the mask of those rows."""
    samples = [s for g in groups for s in g.samples]
    rows = [v[s.sampled_mask()] for s, v in zip(samples, values.split([len(s.token_ids) for s in samples]))]
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.bool) for r in rows], batch_first=True)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_observation_tokens_carry_no_loss(qwen2_5, agg):
    """The update's losses equal those of the sampled tokens alone, normalised by their count; the old,
    reference and rollout logprobs at observation tokens change nothing (the rollout's are the engine's
    0.0 placeholders, which the probability difference does not read)."""
    model, groups = qwen2_5.model, trajectories(qwen2_5)
    config = ActorConfig(lr=0.0, grad_clip=0.0, kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0, loss_agg_mode=agg,
                         max_tokens_per_micro_batch=160, max_response_len=64)
    with torch.no_grad():
        logprobs, entropy = response_logprobs(model, pack_groups(model.args, groups, share_prefix=True),
                                              with_entropy=True)
    per_response = list(logprobs.split([len(r) for g in groups for r in g.responses]))
    advantages = torch.linspace(-1.0, 1.0, len(per_response)).tolist()
    old = [lp - 0.15 * (torch.arange(len(lp)) % 3) for lp in per_response]  # ratios up to 1.35: some clip
    ref = [lp + 0.1 for lp in per_response]

    def update(observed: float | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """The update with the old, reference and rollout logprobs set to `observed` at observation tokens
        (None: the rollout's 0.0 there, the trainer's logprobs elsewhere)."""
        rollout = at_observations(per_response, groups, 0.0 if observed is None else observed)
        old_, ref_ = (xs if observed is None else at_observations(xs, groups, observed) for xs in (old, ref))
        return update_with_gradients(Actor(model, config), PolicyBatch(groups, advantages, old_, ref_, rollout))

    metrics, grads = update(None)
    for observed in (-30.0, 3.0):
        other_metrics, other_grads = update(observed)
        assert other_metrics == metrics
        for name, g in grads.items():
            assert torch.equal(other_grads[name], g), name
    assert metrics["training/rollout_probs_diff_max"] <= 1e-6  # the observations' 0.0 are not compared
    assert metrics["training/nonfinite_logprobs"] == 0

    # The same losses over the sampled tokens alone, with their count as the token normaliser.
    lp, mask = sampled_only(logprobs, groups)
    norms = dict(global_tokens=int(mask.sum()), global_seqs=len(per_response), max_response_len=64)
    pad = lambda xs: sampled_only(torch.cat(xs), groups)[0]  # noqa: E731
    pg_loss, _ = policy_loss(lp, pad(old), torch.tensor(advantages), mask, agg=agg, **norms,
                             rollout_logprobs=lp, tis_cap=2.0)
    kl = agg_loss(kl_penalty(lp, pad(ref)), mask, agg, **norms)
    ent = agg_loss(sampled_only(entropy, groups)[0], mask, agg, **norms)
    for name, want in (("actor/pg_loss", pg_loss), ("actor/kl_loss", kl), ("actor/entropy", ent)):
        assert abs(metrics[name] - want.item()) <= 1e-6 * max(1.0, abs(want.item())), name


def test_single_turn_groups_pack_as_before(qwen2_5):
    """A group without observations: ids, positions (the prompt's, then text positions after its rope
    delta), prompt mask, vision tensors and targets as pack_groups laid them out before multi-turn
    samples."""
    args, w = qwen2_5.model.args, qwen2_5.words
    for prompt in (trajectories(qwen2_5)[0].prompt, prepare_prompt(qwen2_5.processor, "which way ?")):
        responses = [w("red green blue"), w("left"), w("up down") + [qwen2_5.image_pad]]
        group = Group(prompt, [Sample(r, [0.0] * len(r), "stop") for r in responses])
        n = len(prompt.input_ids)
        positions, delta = mrope_positions(prompt.input_ids, args.rope_spec, prompt.image_grid_thw,
                                           prompt.video_grid_thw, prompt.second_per_grid_ts)
        after_prompt = [generated_positions(n, n + len(r), delta) for r in responses]

        shared = pack_groups(args, [group], share_prefix=True)
        assert shared.packed.input_ids.tolist() == prompt.input_ids.tolist() + sum(responses, [])
        assert torch.equal(shared.packed.position_ids, torch.cat([positions, *after_prompt], dim=1))
        assert shared.packed.prompt_mask.tolist() == [True] * n + [False] * len(sum(responses, []))
        ends = np.cumsum([n] + [len(r) for r in responses])
        assert shared.target_index.tolist() == [i for start, r in zip(ends, responses)
                                                for i in [n - 1, *range(start, start + len(r) - 1)]]

        plain = pack_groups(args, [group], share_prefix=False)
        assert plain.packed.input_ids.tolist() == sum((prompt.input_ids.tolist() + r for r in responses), [])
        assert torch.equal(plain.packed.position_ids, torch.cat([t for p in after_prompt for t in (positions, p)], 1))
        assert plain.packed.prompt_mask.tolist() == sum(([True] * n + [False] * len(r) for r in responses), [])
        for batch, copies in ((shared, 1), (plain, len(responses))):
            assert batch.target_ids.tolist() == sum(responses, []) and batch.response_lens == list(map(len, responses))
            for name, tensor in concat_vision([prompt] * copies).items():
                assert (tensor is None and getattr(batch.packed, name) is None) or \
                    torch.equal(getattr(batch.packed, name), tensor), name


def test_observations_are_context_and_bring_their_images(qwen2_5):
    """prompt_mask is True at the prompt's and the observations' tokens, False at every sampled one (a
    sampled pad id too); each response's observation images follow its group's prompt's."""
    groups = trajectories(qwen2_5, sampled_pad=True)
    batch = pack_groups(qwen2_5.model.args, groups, share_prefix=True).packed
    want_mask, want_sources = [], []
    for g in groups:
        want_mask += [True] * len(g.prompt.input_ids)
        want_sources.append(g.prompt)
        for s in g.samples:
            want_mask += (~s.sampled_mask()).tolist()
            want_sources += [o.prompt for o in s.observations]
    assert batch.prompt_mask.tolist() == want_mask
    for name, tensor in concat_vision(want_sources).items():
        assert torch.equal(getattr(batch, name), tensor), name


def test_a_misplaced_observation_is_an_error(qwen2_5):
    s = trajectories(qwen2_5)[0].samples[1]
    shifted = [replace(o, start=o.start + 1) for o in s.observations]
    with pytest.raises(ValueError, match="observation 0's tokens differ"):
        response_inputs(s.token_ids, shifted, 10, 0)
    with pytest.raises(ValueError, match="not inside the 3-token response"):
        response_inputs(s.token_ids[:3], s.observations, 10, 0)
