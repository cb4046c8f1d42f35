"""Qwen3.5-MoE against transformers' Qwen3_5MoeForConditionalGeneration, on tiny random
checkpoints that transformers itself wrote.

The reference models have tiny_args's shape (Qwen3.5's tiny decoder, both layer kinds,
with 8 experts of 16 and a shared expert of 24 in every layer), weights under which
every layer moves the output (the Qwen3.5 tests' `randomize` and `adapt_to_qwen3_5`,
then each expert's matrices drawn at their own fan-in, which `randomize`, reading
transformers' (experts, out, in) as one matrix, would shrink to nothing), saved with
`save_pretrained` (one key per expert and projection) and loaded through the
family-generic loader, which stacks them. Inputs and the other helpers are the Qwen3.5
and Qwen3-VL tests'.
"""

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from rollplex.data.processing import prepare_prompt
from rollplex.models import build_model, from_pretrained, save_pretrained
from rollplex.models.inputs import Prompt
from rollplex.models.moe import Routing, SparseMoE, with_routing
from rollplex.models.packing import pack_groups, pack_sequences
from rollplex.models.protocol import CheckpointError, VisionLanguageModel
from rollplex.models.qwen3_5.mixing import PackedHybridAttention
from rollplex.models.qwen3_5_moe import (FAMILY, PRESETS, Qwen3_5Moe, args_from_hf_config, count_params,
                                         hf_config_from_args, hf_key_to_params, linear_params, param_to_hf_key,
                                         stacked_tensor, tiny_args)
from rollplex.models.registry import FAMILIES, NOT_SUPPORTED_YET, family_of, family_of_config
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from test_qwen3_5_model import (FULL, LIN, PATTERN, adapt_to_qwen3_5, long_text, shared_prefix_groups,
                                shared_prefix_loss_and_grads, vision_kw)
from test_qwen3_vl_model import (IMG, VEND, VID, VSTART, assert_close, cached_pair, hf_logits, image_and_video_prompt,
                                 image_tokens, mm_types, pixels, randomize, video_tokens)

EXPERTS, EXPERT_WIDTH, SHARED_WIDTH = 8, 16, 24  # tiny_args's


def hf_config(tie: bool = False, layer_types: tuple[str, ...] = PATTERN, top_k: int = 2) -> Qwen3_5MoeConfig:
    """tiny_args's shape, as a transformers config (independent of hf_config_from_args)."""
    return Qwen3_5MoeConfig(
        text_config=dict(vocab_size=100, hidden_size=64, num_hidden_layers=len(layer_types),
                         layer_types=list(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         linear_key_head_dim=16, linear_value_head_dim=24, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                         num_experts=EXPERTS, num_experts_per_tok=top_k, moe_intermediate_size=EXPERT_WIDTH,
                         shared_expert_intermediate_size=SHARED_WIDTH,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [2, 2, 2], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=36),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def draw_experts(model: torch.nn.Module, seed: int) -> None:
    """Each expert's matrices ~ N(0, 1/fan_in): transformers holds them (experts, out, in)."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def load(path, **kw) -> Qwen3_5Moe:
    return from_pretrained(path, dtype=torch.float32, attn_backend="torch", family=FAMILY, **kw)


def make_pair(tmp_path_factory, seed: int = 1, **kw):
    """A pair (test_qwen3_vl_model.cached_pair) of hf_config(**kw)'s shape, its weights drawn from `seed`."""
    def build():
        torch.manual_seed(seed)
        hf = Qwen3_5MoeForConditionalGeneration(hf_config(**kw))
        randomize(hf, seed)
        adapt_to_qwen3_5(hf, seed)
        draw_experts(hf, seed)
        return hf

    return cached_pair(tmp_path_factory, ("qwen3_5_moe", seed, *sorted(kw.items())), build, load)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


def saved_keys(path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


# ----------------------------------------------------------------------------- logits against transformers


# Qwen3.5's parity cases on this module's `pair` (pytest gives a test the fixture of the module it collects it in).
from test_qwen3_5_model import (test_image_and_video_with_long_text, test_one_image,  # noqa: E402, F401
                                test_text_longer_than_a_chunk, test_video_of_three_frame_groups)


def test_top_1_routing(tmp_path_factory):
    """One expert per token: its weight renormalises to 1, the router still picks."""
    _, hf, ours = make_pair(tmp_path_factory, top_k=1)
    assert all(layer.mlp.top_k == 1 for layer in ours.language_model.layers)
    p = image_and_video_prompt(seed=9)
    ids = torch.cat([p.input_ids, torch.tensor(long_text(70, seed=5))])[None]
    assert_close(ours.hf_forward(ids, **vision_kw(p)), hf_logits(hf, ids, **vision_kw(p)))


def test_tied_embeddings(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, tie=True)
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    assert ours.lm_head is None and not any(k.startswith("lm_head") for k in ours.state_dict())
    p = image_and_video_prompt(seed=7)
    assert_close(ours.hf_forward(p.input_ids[None], **vision_kw(p)), hf_logits(hf, p.input_ids[None], **vision_kw(p)))


def test_left_padded_batch(pair):
    _, hf, ours = pair
    a, ga = pixels(1, 4, 6, seed=4)
    rows = [long_text(80, seed=2), [5] + image_tokens(ga) + [6, 7], [8, 9, 10]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = dict(pixel_values=a, image_grid_thw=ga)
    assert_close(ours.hf_forward(ids, mask, **kw), hf_logits(hf, ids, mask, **kw), mask)


def test_the_experts_matter(pair):
    """The parity above is not carried by the shared expert alone: the router spreads the tokens over
    most experts in every layer, and zeroing one expert's down_proj, or a layer's shared expert,
    moves the logits."""
    _, _, ours = pair
    batch = pack_sequences(ours.args, [Prompt(torch.tensor(long_text(70, seed=4)))])
    routing = Routing()
    with torch.no_grad():
        reference = ours.logits(ours(batch.input_ids, batch.position_ids,
                                     with_routing(PackedHybridAttention([0, 70], "cpu", "torch"), routing)))
    for layer, routes in routing.layers.items():
        assert (routes.load > 0).sum() >= EXPERTS - 2, f"layer {layer} load {routes.load.tolist()}"
    ids = batch.input_ids[None]
    for layer in ours.language_model.layers:
        for weight in (layer.mlp.experts.down_proj, layer.mlp.shared_expert.down_proj.weight):
            kept = weight.detach().clone()
            with torch.no_grad():
                (weight[int(routing.layers[layer.mlp.layer].load.argmax())] if weight.ndim == 3 else weight).zero_()
            changed = (ours.hf_forward(ids)[0] - reference).abs().max()
            with torch.no_grad():
                weight.copy_(kept)
            assert changed > 1e-2, (layer.mlp.layer, tuple(weight.shape))


def test_every_layer_routes_by_the_forwards_routing(pair):
    """A Routing the backend carries reaches every layer's MoE block: it records each layer's
    top-k, replaying them gives the same logits, and replaying other routes changes them."""
    _, _, ours = pair
    batch = pack_sequences(ours.args, [Prompt(torch.tensor(long_text(40, seed=6)))])

    def logits(routing: Routing) -> torch.Tensor:
        with torch.no_grad():
            mixing = with_routing(PackedHybridAttention([0, 40], "cpu", "torch"), routing)
            return ours.logits(ours(batch.input_ids, batch.position_ids, mixing))

    recording = Routing()
    live = logits(recording)
    routes = recording.routes()
    assert routes.shape == (40, 3, 2)
    replay = Routing(replay=routes)
    assert torch.equal(logits(replay), live) and replay.metrics()["agreed"].item() == 3 * 40
    other = Routing(replay=(routes + 1) % EXPERTS)
    assert (logits(other) - live).abs().max() > 1e-2


# ----------------------------------------------------------------------------- shared prefix, gradients


def test_shared_prefix_logits_equal_transformers(pair):
    """GRPO groups sharing their prompt (each response's DeltaNet state from its prompt's) route
    every token as its full sequence does in transformers."""
    _, hf, ours = pair
    data = shared_prefix_groups()
    shared = pack_groups(ours.args, data, share_prefix=True)
    with torch.no_grad():
        got = ours.logits(ours.forward_packed(shared.packed)[shared.target_index])
    from_transformers = []
    for g in data:
        n = len(g.prompt.input_ids)
        for r in g.responses:
            ids = torch.cat([g.prompt.input_ids, torch.tensor(r)])[None]
            from_transformers.append(hf_logits(hf, ids, **vision_kw(g.prompt))[0, n - 1:n - 1 + len(r)])
    assert_close(got, torch.cat(from_transformers))


def test_shared_prefix_gradients_equal_transformers(pair):
    """The Qwen3.5 tests' GRPO-like loss through the shared-prefix pass: every parameter's gradient
    is transformers' over the full sequences, the router's, each expert's (transposed:
    transformers holds them (experts, out, in)) and the shared expert's included."""
    _, hf, ours = pair
    _, grads = shared_prefix_loss_and_grads(ours, share_prefix=True)
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
        for key in dict.fromkeys(param_to_hf_key(name) for name in grads):
            names = hf_key_to_params(key)
            got = torch.cat([grads[name] for name in names])
            if stacked_tensor(names[0], ours.args) is not None:  # experts: (experts, in, out) here
                got = got.transpose(1, 2)
            want = reference[key].grad
            assert want is not None and want.norm() > 0, key
            err = ((got - want).norm() / want.norm()).item()
            assert err <= 1e-4, f"{key}: relative gradient error {err:.2e}"
    finally:
        hf.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- checkpoints and config


def test_experts_are_stacked_from_one_key_per_expert(pair):
    """transformers writes gate_proj, up_proj (inter, hidden) and down_proj (hidden, inter) per
    expert; our gate_up_proj[e] is [gate | up] transposed, down_proj[e] down transposed."""
    path, _, ours = pair
    tensors = load_file(path / "model.safetensors")
    layer = ours.language_model.layers[1].mlp.experts
    stem = "model.language_model.layers.1.mlp.experts"
    assert f"{stem}.gate_up_proj" not in tensors and f"{stem}.7.up_proj.weight" in tensors
    for e in (0, 5):
        gate, up, down = (tensors[f"{stem}.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        assert gate.shape == up.shape == (EXPERT_WIDTH, 64) and down.shape == (64, EXPERT_WIDTH)
        assert torch.equal(layer.gate_up_proj[e], torch.cat([gate, up]).T)
        assert torch.equal(layer.down_proj[e], down.T)


def test_keys_map_both_ways(pair):
    """Every key transformers wrote is one of a stacked parameter's or maps one to one, and
    together they name every parameter once."""
    path, _, ours = pair
    keys = saved_keys(path)
    stacked = {name: spec for name in ours.state_dict() if (spec := stacked_tensor(name, ours.args)) is not None}
    assert len(stacked) == 2 * 3
    stacked_keys = [key for spec in stacked.values() for key in spec.keys]
    assert len(stacked_keys) == len(set(stacked_keys)) == 3 * EXPERTS * 3
    rest = keys - set(stacked_keys)
    names = [n for key in rest for n in hf_key_to_params(key)]
    assert sorted(names + list(stacked)) == sorted(ours.state_dict())
    assert {param_to_hf_key(n) for n in names} == rest
    for name in ("mlp.gate.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight"):
        assert hf_key_to_params(f"model.language_model.layers.0.{name}") == [f"language_model.layers.0.{name}"]


def test_round_trip_through_transformers(pair, tmp_path):
    """Our save: the keys transformers writes, which transformers loads to the logits of its own
    save, exactly (its loaded experts are laid out otherwise than the model it built: ~1e-6 from
    that one), and to ours; we load it back unchanged."""
    path, _, ours = pair
    save_pretrained(ours, tmp_path / "ours")
    assert saved_keys(tmp_path / "ours") == saved_keys(path)
    again, reference = (Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
                        for folder in (tmp_path / "ours", path))
    assert again.config.text_config.num_experts == EXPERTS
    p = image_and_video_prompt(seed=19)
    kw = vision_kw(p)
    logits = hf_logits(again, p.input_ids[None], **kw)
    assert_close(logits, hf_logits(reference, p.input_ids[None], **kw), tol=0)
    assert_close(ours.hf_forward(p.input_ids[None], **kw), logits)
    back = load(tmp_path / "ours")
    assert back.args == ours.args
    for (name, a), (_, b) in zip(ours.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_a_missing_or_misshapen_expert_is_a_clear_error(pair, tmp_path):
    path, _, _ = pair
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = load_file(path / "model.safetensors")
    key = "model.language_model.layers.2.mlp.experts.3.up_proj.weight"
    kept = tensors.pop(key)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing 1 tensor.*{key}"):
        load(tmp_path)
    tensors[key] = kept[:8]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape \(8, 64\), the model expects \(16, 64\)"):
        load(tmp_path)


def test_config_round_trip_and_what_transformers_builds_from_it():
    """hf_config_from_args gives back the same args, and transformers builds from it a model of
    exactly count_params's size: the tiny shapes and both named sizes (on the meta device)."""
    for args in (tiny_args(), tiny_args(tie=True, layer_types=(FULL, LIN), top_k=1), *PRESETS.values()):
        cfg = hf_config_from_args(args)
        assert "intermediate_size" not in cfg["text_config"]
        assert cfg["text_config"]["model_type"] == "qwen3_5_moe_text"
        assert args_from_hf_config(cfg) == args
        with torch.device("meta"):
            hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**cfg))
        assert sum(p.numel() for p in hf.parameters()) == count_params(args).total


def test_a_config_without_expert_fields_means_transformers_defaults():
    """transformers' Qwen3_5MoeTextConfig defaults are Qwen3.5-35B-A3B's; ours are the same. An
    intermediate_size, which no layer has, is ignored."""
    cfg = hf_config_from_args(PRESETS["qwen3.5-35b-a3b"])
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "hidden_size", "num_hidden_layers", "num_key_value_heads"):
        del cfg["text_config"][name]
    cfg["text_config"]["intermediate_size"] = 5120
    assert args_from_hf_config(cfg) == PRESETS["qwen3.5-35b-a3b"]
    assert args_from_hf_config(cfg).text.intermediate_size == 8 * 512 + 512  # what one token's MLP spans


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="qwen3_5"), "expected 'qwen3_5_moe'"),
    (lambda c: c["text_config"].update(num_experts_per_tok=9), "num_experts_per_tok 9 must be between 1 and"),
    (lambda c: c["text_config"].update(moe_intermediate_size=0), "moe_intermediate_size"),
    (lambda c: c["text_config"].update(linear_num_value_heads=3), "not a multiple of linear_num_key_heads"),
])
def test_bad_config_is_a_clear_error(change, message):
    cfg = hf_config_from_args(tiny_args())
    change(cfg)
    with pytest.raises(CheckpointError, match=message):
        args_from_hf_config(cfg)


def test_registered_by_model_type_and_args():
    args = tiny_args()
    assert family_of_config(hf_config_from_args(args)) is FAMILIES["qwen3_5_moe"] is FAMILY
    assert family_of(args) is FAMILY and family_of(FAMILIES["qwen3_5"].tiny_args()) is FAMILIES["qwen3_5"]
    assert "qwen3_5_moe" not in NOT_SUPPORTED_YET


# ----------------------------------------------------------------------------- shape, protocol, counts, TP


def test_protocol_and_counts():
    """Every parameter and every vision one counted; the FLOP weights are the layers' Linears but
    only k of each layer's experts."""
    args = tiny_args()
    model = Qwen3_5Moe(args)
    assert isinstance(model, VisionLanguageModel)
    assert all(isinstance(layer.mlp, SparseMoE) and layer.routed for layer in model.language_model.layers)
    assert model.kv_layers() == [2] and model.recurrent_state_shapes().layers == (0, 1)
    assert sum(p.numel() for p in model.parameters()) == count_params(args).total
    assert count_params(args).vision == sum(p.numel() for p in model.visual.parameters())
    linears = sum(m.weight.numel() for m in model.language_model.layers.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(layer.mlp.experts.gate_up_proj[0].numel() + layer.mlp.experts.down_proj[0].numel()
                  for layer in model.language_model.layers)
    assert linear_params(args).decoder == linears + 2 * experts  # top-2
    assert FAMILY.kv_layers(args) == [2]
    assert FAMILY.recurrent_state_bytes(args, 1) == FAMILIES["qwen3_5"].recurrent_state_bytes(args, 1) > 0


def test_named_sizes_are_near_their_names():
    """Totals within 5% of each name's billions, the FLOP weights (decoder and head) of its active
    ones within 20%."""
    for name, args in PRESETS.items():
        _, total, active = name.split("-")  # qwen3.5-35b-a3b
        assert math.isclose(count_params(args).total / 1e9, float(total.rstrip("b")), rel_tol=0.05), name
        head = args.text.vocab_size * args.text.hidden_size
        active_weights = (linear_params(args).decoder + head) / 1e9
        assert math.isclose(active_weights, float(active.strip("ab")), rel_tol=0.2), f"{name}: {active_weights:.2f}B"


def test_tensor_parallelism_is_refused():
    FAMILY.check_tp(tiny_args(), 1)
    with pytest.raises(ValueError, match="MoE families run at tensor parallel 1 for now: split the experts over "
                                         "ranks with parallel.ep"):
        FAMILY.check_tp(tiny_args(), 2)


# ----------------------------------------------------------------------------- the tiny folder


def test_tiny_folder_loads_in_transformers_with_equal_logits(tmp_path):
    """`--model.tiny.family qwen3_5_moe`'s folder: TinySpec's experts (widths multiples of 8), built and
    saved by Rollplex, loads in transformers with our logits on its own processor's output."""
    spec = TinySpec.of(FAMILY)
    folder = make_tiny_checkpoint(tmp_path, spec, seed=0)
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert (text["num_experts"], text["num_experts_per_tok"]) == (spec.num_experts, spec.num_experts_per_tok)
    assert text["moe_intermediate_size"] % 8 == 0 and text["shared_expert_intermediate_size"] % 8 == 0
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (70, 98, 3), dtype=np.uint8)
    prompt = prepare_prompt(FAMILY.load_processor(folder), "<image> what colour is the shape ?", images=[image])
    ours = load(folder)
    ids = prompt.input_ids[None]
    kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    hf = Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(input_ids=ids, mm_token_type_ids=(ids == ours.args.image_token_id).long(), **kw).logits
    assert reference.std() > 0.1
    assert_close(ours.hf_forward(ids, **kw), reference)


def test_build_model_draws_experts_and_keeps_norms_at_identity():
    model = build_model(tiny_args(), seed=0, family=FAMILY)
    layer = model.language_model.layers[0]
    assert abs(layer.mlp.experts.gate_up_proj.std().item() - 0.02) < 0.002
    assert torch.equal(layer.post_attention_layernorm.weight, torch.zeros(64))
