"""Qwen3.5 against transformers' Qwen3_5ForConditionalGeneration, on tiny random
checkpoints that transformers itself wrote.

Each reference model is built from a `Qwen3_5Config` of tiny_args's shape (both
layer kinds, DeltaNet key heads fewer than value heads, a quarter of each head
rotating), given weights under which every layer moves the output (as the
Qwen3-VL parity tests do, plus slow DeltaNet decays so that the recurrent state
carries across chunks), saved with `save_pretrained` and loaded through the
family-generic loader. Inputs are built by hand with the Qwen3-VL tests' helpers:
Qwen3.5 lays out images and videos as Qwen3-VL does.
"""

import math
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from rollplex.models import from_pretrained
from rollplex.models.inputs import Group, Prompt, Sample
from rollplex.models.packing import pack_groups, pack_sequences
from rollplex.models.protocol import CheckpointError, VisionLanguageModel
from rollplex.models.qwen3_5 import (FAMILY, FULL_ATTENTION, LINEAR_ATTENTION, PRESETS, Qwen3_5, args_from_hf_config,
                                     count_params, hf_config_from_args, hf_key_to_params, linear_params,
                                     param_to_hf_key, tiny_args)
from rollplex.models.qwen3_5.mixing import SharedPrefixHybridAttention
from rollplex.models.registry import FAMILIES, family_of_config
from rollplex.ops.attention import GroupLayout
from rollplex.train.actor import response_logprobs
from test_qwen3_vl_model import (assert_close, cached_pair, hf_logits, image_and_video_prompt, image_tokens, mm_types,
                                 pixels, randomize, video_tokens)

IMG, VID, VSTART, VEND = 90, 91, 92, 93  # tiny_args's image pad, video pad, vision start and end
LIN, FULL = LINEAR_ATTENTION, FULL_ATTENTION
PATTERN = (LIN, LIN, FULL)


def hf_config(tie: bool = False, layer_types: tuple[str, ...] = PATTERN) -> Qwen3_5Config:
    """tiny_args's shape, as a transformers config (independent of hf_config_from_args)."""
    return Qwen3_5Config(
        text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=len(layer_types),
                         layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [2, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=36),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def adapt_to_qwen3_5(model: torch.nn.Module, seed: int) -> None:
    """After `randomize`: the decoder's zero-centred norms scale by 1 + w, so their w is moved to
    U(-0.5, 0.5) (the scales randomize means, not twice them); DeltaNet decays exp(g) near 1
    (A = exp(A_log) in [0.01, 0.3], softplus(a + dt_bias) small), so that the state a chunk leaves
    matters to the next one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            zero_centred = name.startswith("model.language_model.") and name.endswith("norm.weight") \
                and ".linear_attn." not in name
            if zero_centred:
                p.sub_(1.0)
            elif name.endswith("A_log"):
                p.copy_((torch.rand(p.shape, generator=g) * 0.29 + 0.01).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 2.0)


def load(path, **kw) -> Qwen3_5:
    return from_pretrained(path, dtype=torch.float32, attn_backend="torch", family=FAMILY, **kw)


def make_pair(tmp_path_factory, seed: int = 1, **kw):
    """A pair (test_qwen3_vl_model.cached_pair) of hf_config(**kw)'s shape, its weights drawn from `seed`."""
    def build():
        torch.manual_seed(seed)
        hf = Qwen3_5ForConditionalGeneration(hf_config(**kw))
        randomize(hf, seed)
        adapt_to_qwen3_5(hf, seed)
        return hf

    return cached_pair(tmp_path_factory, ("qwen3_5", seed, *sorted(kw.items())), build, load)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


def long_text(n: int, seed: int) -> list[int]:
    """n ordinary text tokens (below the vision and special ids)."""
    return torch.randint(1, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def vision_kw(p: Prompt) -> dict:
    return dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
                video_grid_thw=p.video_grid_thw)


# ----------------------------------------------------------------------------- logits against transformers


def test_text_longer_than_a_chunk(pair):
    """150 tokens: three chunks of the gated delta rule, the state carried from one to the next."""
    _, hf, ours = pair
    ids = torch.tensor([long_text(150, seed=0)])
    assert_close(ours.hf_forward(ids), hf_logits(hf, ids))


def test_one_image(pair):
    _, hf, ours = pair
    pv, grid = pixels(1, 10, 6, seed=0)
    ids = torch.tensor([[1, 2] + image_tokens(grid) + [4, 5]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_video_of_three_frame_groups(pair):
    _, hf, ours = pair
    pv, grid = pixels(3, 4, 8, seed=3)
    ids = torch.tensor([[1, 2] + video_tokens(grid) + [4, 5]])
    assert_close(ours.hf_forward(ids, pixel_values_videos=pv, video_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values_videos=pv, video_grid_thw=grid))


def test_image_and_video_with_long_text(pair):
    _, hf, ours = pair
    p = image_and_video_prompt(seed=30)
    ids = torch.cat([p.input_ids, torch.tensor(long_text(70, seed=1))])[None]
    assert_close(ours.hf_forward(ids, **vision_kw(p)), hf_logits(hf, ids, **vision_kw(p)))


def test_left_padded_batch(pair):
    """transformers zeroes the pad rows before each DeltaNet layer and masks them in attention;
    each row here is its own packed sequence."""
    _, hf, ours = pair
    a, ga = pixels(1, 4, 6, seed=4)
    rows = [long_text(80, seed=2), [5] + image_tokens(ga) + [6, 7], [8, 9, 10]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = dict(pixel_values=a, image_grid_thw=ga)
    assert_close(ours.hf_forward(ids, mask, **kw), hf_logits(hf, ids, mask, **kw), mask)


def test_tied_embeddings(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, tie=True)
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    assert ours.lm_head is None and not any(k.startswith("lm_head") for k in ours.state_dict())
    p = image_and_video_prompt(seed=7)
    assert_close(ours.hf_forward(p.input_ids[None], **vision_kw(p)), hf_logits(hf, p.input_ids[None], **vision_kw(p)))


@pytest.mark.parametrize("layer_types", [(FULL, LIN, LIN, FULL, LIN), (LIN,), (FULL,)])
def test_other_layer_patterns(tmp_path_factory, layer_types):
    """use_cache=False: transformers' cache of a model without attention layers cannot count its
    tokens (DynamicCache.get_seq_length raises)."""
    _, hf, ours = make_pair(tmp_path_factory, layer_types=layer_types)
    assert [layer.kind for layer in ours.language_model.layers] == list(layer_types)
    p = image_and_video_prompt(seed=8)
    ids = torch.cat([p.input_ids, torch.tensor(long_text(40, seed=3))])[None]
    assert_close(ours.hf_forward(ids, **vision_kw(p)), hf_logits(hf, ids, use_cache=False, **vision_kw(p)))


def test_every_layer_matters(pair):
    """Zeroing a layer's mixer output projection changes the logits: the parity above is not
    carried by the MLPs and the embedding alone."""
    _, _, ours = pair
    ids = torch.tensor([long_text(70, seed=4)])
    reference = ours.hf_forward(ids)
    for layer in ours.language_model.layers:
        out = layer.linear_attn.out_proj if layer.kind == LIN else layer.self_attn.o_proj
        kept = out.weight.detach().clone()
        with torch.no_grad():
            out.weight.zero_()
        changed = (ours.hf_forward(ids) - reference).abs().max()
        with torch.no_grad():
            out.weight.copy_(kept)
        assert changed > 1e-2, layer.kind


# ----------------------------------------------------------------------------- packed sequences


def test_packed_sequences_equal_each_alone(pair):
    """No state crosses a sequence boundary: the convolution and recurrence of each packed
    sequence start from zero, whatever sequence precedes it (one shorter than the convolution
    kernel, one of several chunks, images and video)."""
    _, _, ours = pair
    a, ga = pixels(1, 6, 6, seed=12)
    seqs = [Prompt(torch.tensor(long_text(100, seed=5))),
            Prompt(torch.tensor([4, 5])),
            Prompt(torch.tensor([1] + image_tokens(ga) + long_text(66, seed=6)), pixel_values=a, image_grid_thw=ga),
            image_and_video_prompt(seed=14)]
    with torch.no_grad():
        packed = ours.logits(ours.forward_packed(pack_sequences(ours.args, seqs)))
    offset = 0
    for s in seqs:
        with torch.no_grad():
            alone = ours.logits(ours.forward_packed(pack_sequences(ours.args, [s])))
        # Batched chunks round differently from a sequence's own (~1e-5); a leaked state moves logits by ~1.
        assert (packed[offset:offset + len(s.input_ids)] - alone).abs().max() <= 1e-4
        offset += len(s.input_ids)


def test_gradients_reach_every_parameter(pair):
    _, _, ours = pair
    p = image_and_video_prompt(seed=15)
    batch = pack_sequences(ours.args, [p, Prompt(torch.tensor(long_text(70, seed=7)))])
    ours.logits(ours.forward_packed(batch)).logsumexp(-1).sum().backward()
    try:
        for name, param in ours.named_parameters():
            assert param.grad is not None and param.grad.abs().max() > 0, name
    finally:
        ours.zero_grad(set_to_none=True)


def shared_prefix_groups() -> list[Group]:
    """Two GRPO groups: an image prompt over two chunks of the gated delta rule with responses of
    one token, a few and more than a chunk; a text prompt shorter than the convolution's window
    (its responses' windows reach back through the prompt into the zero state)."""
    a, ga = pixels(1, 6, 6, seed=40)
    image_prompt = Prompt(torch.tensor([1] + long_text(30, seed=8) + image_tokens(ga) + long_text(60, seed=9)),
                          pixel_values=a, image_grid_thw=ga)
    sample = lambda tokens: Sample(tokens, [0.0] * len(tokens), "stop")  # noqa: E731
    return [Group(image_prompt, [sample(long_text(5, seed=10)), sample([7]), sample(long_text(70, seed=11)),
                                 sample(long_text(3, seed=12))]),
            Group(Prompt(torch.tensor([4, 5])), [sample(long_text(4, seed=13)), sample([8, 9])])]


def test_shared_prefix_logits_equal_full_sequences_and_transformers(pair):
    """pack_groups(share_prefix=True): each prompt once, each response's DeltaNet state starting
    from its prompt's final state. Every response token's logits equal those of the full sequence
    prompt + response, packed alone and in transformers (a response from a zero state is off by ~1)."""
    _, hf, ours = pair
    data = shared_prefix_groups()
    assert len(data[0].prompt.input_ids) > 64
    shared, full = (pack_groups(ours.args, data, share_prefix=share) for share in (True, False))
    with torch.no_grad():
        got = ours.logits(ours.forward_packed(shared.packed)[shared.target_index])
        want = ours.logits(ours.forward_packed(full.packed)[full.target_index])
    assert_close(got, want)
    from_transformers = []
    for g in data:
        n = len(g.prompt.input_ids)
        for r in g.responses:
            ids = torch.cat([g.prompt.input_ids, torch.tensor(r)])[None]
            from_transformers.append(hf_logits(hf, ids, **vision_kw(g.prompt))[0, n - 1:n - 1 + len(r)])
    assert_close(got, torch.cat(from_transformers))


def shared_prefix_loss_and_grads(model: Qwen3_5, share_prefix: bool) -> tuple[torch.Tensor, dict]:
    """A GRPO-like loss (weighted response logprobs plus entropy) and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    batch = pack_groups(model.args, shared_prefix_groups(), share_prefix=share_prefix)
    logprobs, entropy = response_logprobs(model, batch, with_entropy=True)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel())  # stands in for advantages
    ((logprobs * weights).sum() + 0.1 * entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logprobs.detach(), grads


def test_shared_prefix_gradients_equal_per_response_full_sequences(pair):
    """Each response's gradient reaches its prompt (and the vision tower) through the DeltaNet
    states and the prompt's K/V: every parameter's gradient is that of the per-response full
    sequences, in which the prompt is computed once per response."""
    _, _, ours = pair
    lp_shared, grads_shared = shared_prefix_loss_and_grads(ours, share_prefix=True)
    lp_full, grads_full = shared_prefix_loss_and_grads(ours, share_prefix=False)
    assert (lp_shared - lp_full).abs().max() <= 1e-5
    for name, want in grads_full.items():
        assert want.norm() > 0, name
        err = ((grads_shared[name] - want).norm() / want.norm()).item()
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


def test_shared_prefix_gradients_equal_transformers(pair):
    """The same loss backpropagated through transformers, one full sequence per response: every
    parameter's gradient, the DeltaNet's and the vision tower's included."""
    _, hf, ours = pair
    _, grads_shared = shared_prefix_loss_and_grads(ours, share_prefix=True)
    hf.zero_grad(set_to_none=True)
    data = shared_prefix_groups()
    weights = torch.linspace(-1.0, 1.0, sum(len(r) for g in data for r in g.responses))
    offset = 0
    for g in data:
        n = len(g.prompt.input_ids)
        for r in g.responses:
            ids = torch.cat([g.prompt.input_ids, torch.tensor(r)])[None]
            logits = hf(input_ids=ids, mm_token_type_ids=mm_types(ids), **vision_kw(g.prompt)).logits[0]
            logprobs = logits[n - 1:n - 1 + len(r)].log_softmax(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
            token_logprobs = logprobs.gather(1, torch.tensor(r)[:, None])[:, 0]
            ((token_logprobs * weights[offset:offset + len(r)]).sum() + 0.1 * entropy.sum()).backward()
            offset += len(r)
    reference = dict(hf.named_parameters())
    try:
        for key in dict.fromkeys(param_to_hf_key(name) for name in grads_shared):
            got = torch.cat([grads_shared[name] for name in hf_key_to_params(key)])
            want = reference[key].grad
            assert want is not None and want.norm() > 0, key
            err = ((got - want).norm() / want.norm()).item()
            assert err <= 1e-4, f"{key}: relative gradient error {err:.2e}"
    finally:
        hf.zero_grad(set_to_none=True)


def test_shared_prefix_needs_groups_laid_out_packed(pair):
    _, _, ours = pair
    with pytest.raises(ValueError, match="not laid out packed"):
        SharedPrefixHybridAttention([GroupLayout(0, 3, 5, (2,))], "cpu")


# ----------------------------------------------------------------------------- checkpoints and config


def test_mtp_weights_are_ignored_and_said_once(pair, tmp_path):
    """The hub's checkpoints hold an `mtp.*` head: loaded past, with one warning naming it."""
    path, hf, ours = pair
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.zeros(64),
                    "mtp.layers.0.self_attn.q_proj.weight": torch.randn(384, 64)})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load(tmp_path)
    mtp = [str(w.message) for w in caught if "mtp." in str(w.message)]
    assert len(mtp) == 1 and "3 tensor(s) under mtp.*" in mtp[0] and "multi-token-prediction" in mtp[0]
    for (name, a), (_, b) in zip(ours.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name


def test_keys_map_both_ways(pair):
    path, _, ours = pair
    keys = set(load_file(path / "model.safetensors"))
    names = [n for key in keys for n in hf_key_to_params(key)]
    assert sorted(names) == sorted(ours.state_dict())
    assert {param_to_hf_key(n) for n in names} == keys
    # The fused q | k | v projection and convolution are three parameters each (split by heads under TP).
    assert hf_key_to_params("model.language_model.layers.0.linear_attn.conv1d.weight") == [
        f"language_model.layers.0.linear_attn.conv1d_{part}" for part in "qkv"]


def test_config_round_trip_and_what_transformers_builds_from_it():
    """hf_config_from_args gives back the same args, and transformers builds from it a model of
    exactly count_params's size: for the tiny shapes and every named size (on the meta device)."""
    for args in (tiny_args(), tiny_args(tie=True, layer_types=(FULL, LIN)), *PRESETS.values()):
        cfg = hf_config_from_args(args)
        assert args_from_hf_config(cfg) == args
        with torch.device("meta"):
            hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
        assert sum(p.numel() for p in hf.parameters()) == count_params(args).total


def test_layer_types_default_to_one_full_attention_in_four():
    cfg = hf_config_from_args(tiny_args())
    del cfg["text_config"]["layer_types"]
    cfg["text_config"]["num_hidden_layers"] = 8
    assert args_from_hf_config(cfg).text.layer_types == [LIN, LIN, LIN, FULL] * 2


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="qwen3_vl"), "expected 'qwen3_5'"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[4, 2, 2]), "half the rotary width"),
    (lambda c: c["text_config"].update(layer_types=[LIN, "sliding_attention", FULL]), "sliding_attention"),
    (lambda c: c["text_config"].update(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
])
def test_bad_config_is_a_clear_error(change, message):
    cfg = hf_config_from_args(tiny_args())
    change(cfg)
    with pytest.raises(CheckpointError, match=message):
        args_from_hf_config(cfg)


def test_registered_by_model_type():
    """A config.json of model_type qwen3_5 picks the family; its MoE variants' (qwen3_5_moe) their own."""
    assert family_of_config(hf_config_from_args(tiny_args())) is FAMILIES["qwen3_5"] is FAMILY
    assert family_of_config({"model_type": "qwen3_5_moe"}) is FAMILIES["qwen3_5_moe"] is not FAMILY


# ----------------------------------------------------------------------------- shape, protocol, counts


def test_protocol_counts_and_tp_sizes():
    args = tiny_args()
    model = Qwen3_5(args)
    assert isinstance(model, VisionLanguageModel)
    assert model.kv_heads_per_rank() == 2
    assert model.text_rotary_table(5, model.device, model.dtype).shape == (5, 2 * 12)  # a quarter of head_dim 48
    assert sum(p.numel() for p in model.parameters()) == count_params(args).total
    assert count_params(args).vision == sum(p.numel() for p in model.visual.parameters())
    layer_weights = sum(m.weight.numel() for m in model.language_model.layers.modules()
                        if isinstance(m, torch.nn.Linear))
    assert linear_params(args).decoder == layer_weights
    FAMILY.check_tp(args, 2)
    with pytest.raises(ValueError, match="does not divide"):
        FAMILY.check_tp(args, 3)


def test_named_sizes_are_near_their_names():
    """Totals within 15% of each name's billions (the names round; the tower and embeddings count)."""
    for name, args in PRESETS.items():
        billions = float(name.split("-")[-1].rstrip("b"))
        total = count_params(args).total / 1e9
        assert math.isclose(total, billions, rel_tol=0.15), f"{name}: {total:.2f}B"
