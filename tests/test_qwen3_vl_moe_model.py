"""Qwen3-VL-MoE against transformers' Qwen3VLMoeForConditionalGeneration, on tiny random
checkpoints that transformers itself wrote (its experts in its own layout, (experts, out,
in)), on the same weights in the hub's layout ((experts, in, out)), and on what Rollplex
writes, which transformers loads.

As tests/test_qwen3_vl_model.py, whose inputs and helpers these are: weights that make
every layer matter, here with each expert drawn as a Linear of its fan-in, so that every
expert a token goes to moves its output.
"""

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from rollplex.models import build_model, from_pretrained, save_pretrained
from rollplex.models.inputs import Group, Prompt, Sample
from rollplex.models.moe import MoEArgs, Routing, SparseMoE, with_routing
from rollplex.models.packing import pack_groups, pack_sequences
from rollplex.models.protocol import CheckpointError, VisionLanguageModel, fsdp_entry_methods
from rollplex.models.qwen3_vl_moe import (FAMILY, PRESETS, Qwen3_VL_MoE, args_from_hf_config, count_params,
                                          hf_config_from_args, hf_key_to_params, linear_params, param_to_hf_key,
                                          tiny_args)
from rollplex.models.qwen_vl.layers import SwiGLU
from rollplex.models.registry import FAMILIES, NOT_SUPPORTED_YET, SIZES_NOT_SUPPORTED, family_of_config
from rollplex.ops.attention import VarlenAttention
from rollplex.tiny import TinySpec, make_tiny_checkpoint
from test_qwen3_vl_model import (IMG, VEND, VID, VSTART, assert_close, cached_pair, groups, hf_logits,
                                 image_and_video_prompt, image_tokens, pixels, randomize, video_tokens)

EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


# ----------------------------------------------------------------------------- checkpoints


def hf_config(tie: bool = False, layers: int = 2, top_k: int = 2, decoder_sparse_step: int = 1,
              mlp_only_layers: tuple[int, ...] = ()) -> Qwen3VLMoeConfig:
    """tiny_args's shape, as a transformers config (independent of hf_config_from_args): 8 experts of width 48."""
    return Qwen3VLMoeConfig(
        text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096,
                         num_experts=8, num_experts_per_tok=top_k, moe_intermediate_size=48,
                         decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
                         tie_word_embeddings=tie,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=36, deepstack_visual_indexes=[0, 1]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def draw_experts(model: torch.nn.Module, seed: int) -> None:
    """After `randomize` (which scales a 3-D tensor by all its trailing dims): each expert ~ N(0, 1/fan_in),
    its fan-in being the last dim of transformers' (experts, out, in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(EXPERTS):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def load(path) -> Qwen3_VL_MoE:
    return from_pretrained(path, dtype=torch.float32, attn_backend="torch")


def make_pair(tmp_path_factory, seed: int = 1, **kw):
    """A pair (test_qwen3_vl_model.cached_pair) of hf_config(**kw)'s shape, its weights drawn from `seed`."""
    def build():
        hf = Qwen3VLMoeForConditionalGeneration(hf_config(**kw))
        randomize(hf, seed)
        draw_experts(hf, seed)
        return hf

    return cached_pair(tmp_path_factory, ("qwen3_vl_moe", seed, *sorted(kw.items())), build, load)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


def vision_kw(p: Prompt) -> dict:
    return dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
                video_grid_thw=p.video_grid_thw)


def assert_same_logits(ours, hf, p: Prompt, tol: float = 1e-4) -> None:
    ids = p.input_ids[None]
    assert_close(ours.hf_forward(ids, **vision_kw(p)), hf_logits(hf, ids, **vision_kw(p)), tol=tol)


# ----------------------------------------------------------------------------- logits against transformers


def test_transformers_saves_its_own_layout_of_the_experts(pair):
    """What the layout tests rest on: transformers 5 writes its in-memory (experts, out, in), and
    names the expert count num_local_experts in config.json."""
    path, _, _ = pair
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 96, 64]
        assert f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape() == [8, 64, 48]
    assert '"num_local_experts": 8' in (path / "config.json").read_text()


def test_text_only(pair):
    _, hf, ours = pair
    assert_same_logits(ours, hf, Prompt(torch.tensor([1, 5, 7, 9, 11, 3, 2])))


def test_image_and_video_in_one_prompt(pair):
    _, hf, ours = pair
    assert_same_logits(ours, hf, image_and_video_prompt())


def test_video_of_three_frame_groups(pair):
    _, hf, ours = pair
    pv, grid = pixels(3, 4, 8, seed=3)
    assert_same_logits(ours, hf, Prompt(torch.tensor([1, 2] + video_tokens(grid) + [4, 5]), pixel_values_videos=pv,
                                        video_grid_thw=grid))


def test_left_padded_batch_mixing_text_images_video(pair):
    """Pad tokens go through transformers' experts too; the real tokens' logits are unchanged by them."""
    _, hf, ours = pair
    a, ga = pixels(1, 4, 6, seed=4)
    v, gv = pixels(2, 4, 4, seed=6)
    rows = [[1, 2, 3, 4], [5] + image_tokens(ga) + [6, 7], [8] + video_tokens(gv) + [9, 10]]
    L = max(map(len, rows))
    ids = torch.tensor([[0] * (L - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    kw = dict(pixel_values=a, image_grid_thw=ga, pixel_values_videos=v, video_grid_thw=gv)
    assert_close(ours.hf_forward(ids, mask, **kw), hf_logits(hf, ids, mask, **kw), mask)


@pytest.mark.parametrize("kw", [
    {"top_k": 1},  # one expert a token, of weight 1
    {"top_k": 8},  # every expert
    {"layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": (3,)},  # sparse layer 1 only; 0, 2 and 3 dense
    {"tie": True},
], ids=["top-1", "top-8 of 8", "dense and sparse layers", "tied embeddings"])
def test_routing_and_layer_variants(tmp_path_factory, kw):
    _, hf, ours = make_pair(tmp_path_factory, **kw)
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in ours.language_model.layers]
    assert sparse == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.language_model.layers]
    if "decoder_sparse_step" in kw:
        assert sparse == [False, True, False, False] and isinstance(ours.language_model.layers[0].mlp, SwiGLU)
    if kw.get("tie"):
        assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight and ours.lm_head is None
    assert_same_logits(ours, hf, image_and_video_prompt(seed=7))


def test_grouped_gemm_backend_gives_the_loop_backend_logits(pair):
    """torch._grouped_mm (the CUDA default) on CPU, on the tiny model's widths (rows of 64 and 48 floats)."""
    path, hf, _ = pair
    ours = load(path)
    for layer in ours.language_model.layers:
        layer.mlp.experts.backend = "grouped"
    assert_same_logits(ours, hf, image_and_video_prompt(seed=8))


def test_grads_equal_transformers(tmp_path_factory):
    """A loss on response logprobs, backpropagated through the shared-prefix forward, gives every
    parameter transformers' gradient (summed over per-response full sequences): the routers', and
    each expert's (transposed: transformers keeps (experts, out, in)). Three layers, so that the
    last DeepStack level (after layer 1) reaches the responses."""
    path, hf, _ = make_pair(tmp_path_factory, layers=3)
    ours = load(path)
    data = [Group(image_and_video_prompt(seed=16), [Sample([5, 6, 7], [0.0] * 3, "stop"),
                                                     Sample([8, 9], [0.0] * 2, "stop")])]
    batch = pack_groups(ours.args, data, share_prefix=True)
    logprobs = ours.logits(ours.forward_packed(batch.packed)[batch.target_index]).log_softmax(-1)
    logprobs.gather(1, batch.target_ids[:, None]).sum().backward()
    hf.zero_grad(set_to_none=True)
    p = data[0].prompt
    for r in data[0].responses:
        ids = torch.cat([p.input_ids, torch.tensor(r)])[None]
        logits = hf(input_ids=ids, mm_token_type_ids=(ids == IMG).long() + 2 * (ids == VID).long(),
                    **vision_kw(p)).logits[0]
        n = len(p.input_ids)
        logits[n - 1:n - 1 + len(r)].log_softmax(-1).gather(1, torch.tensor(r)[:, None]).sum().backward()
    ref = dict(hf.named_parameters())
    mine = dict(ours.named_parameters())
    for key in dict.fromkeys(param_to_hf_key(name) for name in mine):
        got = torch.cat([mine[n].grad for n in hf_key_to_params(key)])
        want = ref[key].grad
        if key.endswith(EXPERTS):
            want = want.transpose(1, 2)
        assert want is not None and want.norm() > 0, key
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-4, f"{key}: relative gradient error {err:.2e}"
    hf.zero_grad(set_to_none=True)


def test_shared_prefix_forward_equals_per_response_sequences(pair):
    """Each prompt once with its responses after it (pack_groups) routes every token as the full
    sequences do: the response tokens' logits agree."""
    _, _, ours = pair
    data = groups(generated_pad=False)
    shared, full = (pack_groups(ours.args, data, share_prefix=share) for share in (True, False))
    with torch.no_grad():
        a = ours.logits(ours.forward_packed(shared.packed)[shared.target_index])
        b = ours.logits(ours.forward_packed(full.packed)[full.target_index])
    assert_close(a, b, tol=1e-5)


# ----------------------------------------------------------------------------- routes


def test_routes_are_recorded_and_replayed_through_the_backend(pair):
    """A Routing on the forward's attention backend reaches every sparse layer: it records each token's
    top-k per layer, and replaying them on the same weights gives the same logits."""
    _, _, ours = pair
    p = image_and_video_prompt(seed=9)
    batch = pack_sequences(ours.args, [p])

    def logits(routing: Routing) -> torch.Tensor:
        attn = with_routing(VarlenAttention(batch.cu_seqlens.tolist(), "cpu"), routing)
        vision = ours.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
        return ours.logits(ours(batch.input_ids, batch.position_ids, attn, vision))

    with torch.no_grad():
        recording = Routing()
        live = logits(recording)
        routes = recording.routes()
        assert routes.shape == (len(p.input_ids), 2, 2)
        assert torch.equal(live, ours.logits(ours.forward_packed(batch)))
        replay = Routing(replay=routes)
        assert torch.equal(logits(replay), live)
    assert replay.metrics()["agreed"].item() == replay.metrics()["replayed"].item() == 2 * len(p.input_ids)
    assert recording.aux_loss(8) > 0


# ----------------------------------------------------------------------------- checkpoints and layouts


def _rewrite_experts(src, dst, change) -> None:
    """Folder `src` copied to `dst` with every experts tensor replaced by change(tensor)."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({k: change(t).contiguous() if k.endswith(EXPERTS) else t for k, t in tensors.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())


def test_hub_layout_checkpoint_loads_the_same(pair, tmp_path):
    """The hub's layout, (experts, in, out): the same parameters, and transformers' own loader reads
    that layout to the same model (so it is the layout its converter expects from the hub)."""
    path, hf, ours = pair
    _rewrite_experts(path, tmp_path / "hub", lambda t: t.transpose(1, 2))
    hub = load(tmp_path / "hub")
    for (name, a), (_, b) in zip(ours.named_parameters(), hub.named_parameters()):
        assert torch.equal(a, b), name
    again = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "hub", dtype=torch.float32).eval()
    p = image_and_video_prompt(seed=10)
    assert_close(hf_logits(again, p.input_ids[None], **vision_kw(p)), hf_logits(hf, p.input_ids[None], **vision_kw(p)),
                 tol=0)


def test_round_trip_through_transformers(pair, tmp_path):
    """Our save writes config.json and the hub's layout of the experts: transformers loads it and gives
    its logits; we load it back unchanged."""
    _, hf, ours = pair
    save_pretrained(ours, tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.language_model.layers.1.mlp.experts.gate_up_proj").get_shape() == [8, 64, 96]
        assert f.get_slice("model.language_model.layers.1.mlp.experts.down_proj").get_shape() == [8, 48, 64]
    again = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    text = again.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (8, 2, 48)
    p = image_and_video_prompt(seed=11)
    assert_close(hf_logits(again, p.input_ids[None], **vision_kw(p)), hf_logits(hf, p.input_ids[None], **vision_kw(p)),
                 tol=0)
    back = load(tmp_path / "ours")
    assert back.args == ours.args
    for (name, a), (_, b) in zip(ours.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_experts_of_a_square_shape_are_taken_in_the_hub_layout():
    """hidden == 2 * inter (gate_up_proj) or hidden == inter (down_proj): the shape cannot tell the
    layouts apart, and the tensor is taken as it is (the hub's layout, the one saving writes). A shape
    of neither layout is an error naming both."""
    args = tiny_args()
    spec = FAMILY.stacked_tensor("language_model.layers.0.mlp.experts.gate_up_proj", args)
    assert spec.keys == ("model.language_model.layers.0.mlp.experts.gate_up_proj",)
    square = torch.randn(8, 64, 64)
    assert spec.load([square], (8, 64, 64)) is square
    theirs = torch.randn(8, 96, 64)
    assert torch.equal(spec.load([theirs], (8, 64, 96)), theirs.transpose(1, 2))
    assert spec.save(square)[0] is square
    with pytest.raises(CheckpointError, match=r"shape \(8, 64, 95\).*\(8, 64, 96\) \(the hub's layout\) or "
                                              r"\(8, 96, 64\) \(transformers 5's\)"):
        spec.load([torch.randn(8, 64, 95)], (8, 64, 96))
    assert FAMILY.stacked_tensor("language_model.layers.0.mlp.gate.weight", args) is None


def test_our_own_checkpoint_of_square_experts_loads_back(tmp_path):
    """Experts of width 32 at width 64 (TinySpec's default): ambiguous for transformers' loader, not for
    a checkpoint Rollplex wrote and reads."""
    args = tiny_args()
    args.text.moe = dataclasses.replace(args.text.moe, moe_intermediate_size=32)
    model = build_model(args, seed=0, init_std=None)
    save_pretrained(model, tmp_path)
    back = load(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_keys_map_both_ways(pair):
    """Every key transformers writes is a stacked experts tensor or names parameters of ours, and comes back."""
    path, _, ours = pair
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    names = [n for key in keys for n in hf_key_to_params(key)]
    assert sorted(names) == sorted(ours.state_dict())
    assert {param_to_hf_key(n) for n in names} == keys
    stacked = {n for n in names if FAMILY.stacked_tensor(n, ours.args) is not None}
    assert len(stacked) == 4 and all(n.endswith(EXPERTS) for n in stacked)


# ----------------------------------------------------------------------------- config


def test_config_round_trip_and_transformers_names():
    for args in (tiny_args(), tiny_args(tie=True, top_k=1), tiny_args(layers=4, decoder_sparse_step=2,
                                                                        mlp_only_layers=(3,)), *PRESETS.values()):
        assert args_from_hf_config(hf_config_from_args(args)) == args
    cfg = hf_config_from_args(tiny_args())
    assert cfg["architectures"] == ["Qwen3VLMoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_vl_moe"
    assert cfg["text_config"]["model_type"] == "qwen3_vl_moe_text"
    assert cfg["vision_config"]["model_type"] == "qwen3_vl_moe_vision"
    # transformers 5 saves the expert count as num_local_experts, and norm_topk_prob not at all.
    text = {k: v for k, v in cfg["text_config"].items() if k not in ("num_experts", "norm_topk_prob")}
    cfg["text_config"] = {**text, "num_local_experts": 6}
    assert args_from_hf_config(cfg).text.moe == MoEArgs(num_experts=6, num_experts_per_tok=2,
                                                        moe_intermediate_size=48)


def test_hub_config_reads_to_the_named_size():
    """The hub's config.json for Qwen3-VL-30B-A3B-Instruct as remembered (transformers 4.57's style: rope_scaling +
    rope_theta, num_experts, the vision config's model_type qwen3_vl_moe)."""
    hub = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": False,
        "text_config": {"model_type": "qwen3_vl_moe_text", "vocab_size": 151936, "hidden_size": 2048,
                        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                        "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 262144, "attention_bias": False, "rope_theta": 5000000,
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                         "rope_type": "default"},
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 768,
                        "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8,
                        "router_aux_loss_coef": 0.001, "bos_token_id": 151643, "eos_token_id": 151645},
        "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                          "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "out_hidden_size": 2048, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
    }
    assert args_from_hf_config(hub) == PRESETS["qwen3-vl-30b-a3b"]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="qwen3_vl"), "expected 'qwen3_vl_moe'"),
    (lambda c: c.pop("text_config"), "no text_config"),
    (lambda c: c["text_config"].update(norm_topk_prob=False), "always renormalises"),
    (lambda c: c["text_config"].update(num_experts_per_tok=9), "num_experts_per_tok 9 must be between 1 and "
                                                                "num_experts 8"),
    (lambda c: c["text_config"].update(decoder_sparse_step=0), "decoder_sparse_step 0"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[6, 3, 2]), "must sum to head_dim/2"),
])
def test_bad_config_is_a_clear_error(change, message):
    cfg = hf_config_from_args(tiny_args())
    change(cfg)
    with pytest.raises(CheckpointError, match=message) as e:
        args_from_hf_config(cfg)
    assert str(e.value).startswith("config.json")


def test_registered_by_model_type():
    assert family_of_config(hf_config_from_args(tiny_args())) is FAMILIES["qwen3_vl_moe"] is FAMILY
    assert "qwen3_vl_moe" not in NOT_SUPPORTED_YET and not set(PRESETS) & set(SIZES_NOT_SUPPORTED)


def test_tiny_checkpoint_loads_in_transformers_and_here(tmp_path):
    """rollplex.tiny's folder of the family (its tiny spec: experts of 48 at width 64): transformers reads it to
    the logits Rollplex gives."""
    spec = TinySpec.of("qwen3_vl_moe", num_experts=4, num_experts_per_tok=2)
    make_tiny_checkpoint(tmp_path, spec, seed=1)
    ours = load(tmp_path)
    assert ours.args.text.moe.moe_intermediate_size == 48 and ours.args.text.moe.num_experts == 4
    hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([[12, 15, 17, 19, 21, 13, 22]])  # words of the tiny vocabulary, past its special tokens
    assert_close(ours.hf_forward(ids), hf_logits(hf, ids))


# ----------------------------------------------------------------------------- shape, protocol, counts, tp


def test_the_model_has_every_call_the_engine_makes():
    model = Qwen3_VL_MoE(tiny_args())
    assert isinstance(model, VisionLanguageModel)
    assert fsdp_entry_methods(Qwen3_VL_MoE) == ["embed_prompts", "encode_prepared", "forward_generated", "logits"]
    assert model.kv_heads_per_rank() == 2 and model.kv_layers() == [0, 1]


def _numel(model, prefix: str = "", contains: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(prefix) and (not contains or any(c in n for c in contains)))


@pytest.mark.parametrize("kw", [{}, {"tie": True, "top_k": 1}, {"layers": 4, "decoder_sparse_step": 2,
                                                                 "mlp_only_layers": (3,)}])
def test_count_params_matches_the_module_tree(kw):
    """Every expert counted; q/k/v/o and a dense layer's SwiGLU split by tp, the router and experts not;
    the layer figures are the largest layer's."""
    args = tiny_args(**kw)
    model = Qwen3_VL_MoE(args)
    counts = count_params(args)
    assert counts.total == _numel(model)
    assert counts.vision == _numel(model, "visual.")
    assert counts.root == counts.total - _numel(model, "visual.blocks.") - _numel(model, "language_model.layers.")
    split = tuple(f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"))
    root_split = 0 if args.tie_word_embeddings else _numel(model, "language_model.embed_tokens") + _numel(model,
                                                                                                          "lm_head")
    assert counts.tp_split == _numel(model, "language_model.layers.", split) + root_split
    largest = max(range(len(model.language_model.layers)), key=lambda i: _numel(model, f"language_model.layers.{i}."))
    assert counts.layer_tp_split == _numel(model, f"language_model.layers.{largest}.", split)
    assert counts.layer_replicated == _numel(model, f"language_model.layers.{largest}.") - counts.layer_tp_split


@pytest.mark.parametrize("kw", [{}, {"top_k": 1}, {"layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": (3,)}])
def test_linear_params_are_the_matmuls_a_token_runs(kw):
    """FLOPs per text token follow the router and the top-k experts, not all of them: torch's
    FlopCounterMode over a decoder forward counts 2 x linear_params.decoder per token exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(tiny_args(**kw), seed=0, init_std=None)
    ids = torch.tensor([1, 5, 7, 9, 11])
    attn = VarlenAttention.from_lengths([5], "cpu")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.forward_generated(ids, torch.arange(5).expand(3, -1), attn)
    counts = counter.get_flop_counts()["Global"]
    matmuls = sum(n for op, n in counts.items() if str(op) in ("aten.mm", "aten.addmm"))
    assert matmuls == 2 * linear_params(model.args).decoder * len(ids)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_named_sizes_count_what_a_meta_build_holds(name):
    args = PRESETS[name]
    with torch.device("meta"):
        model = Qwen3_VL_MoE(args)
    assert count_params(args).total == sum(p.numel() for p in model.parameters())
    billions = float(name.split("-")[2].rstrip("b"))
    assert abs(count_params(args).total / 1e9 - billions) / billions < 0.05


def test_tensor_parallel_is_refused_past_one():
    args = tiny_args()
    FAMILY.check_tp(args, 1)
    with pytest.raises(ValueError, match="MoE families run at tensor parallel 1 for now: split the experts over "
                                         "ranks with parallel.ep"):
        FAMILY.check_tp(args, 2)

    class OneRank:
        def size(self) -> int:
            return 1

    model = Qwen3_VL_MoE(args)
    assert FAMILY.apply_tp(model, OneRank()) is model
    assert FAMILY.repeated_blocks(model) == [model.visual.blocks, model.language_model.layers]
