"""Qwen3.5's tensor-parallel plan (rollplex.models.qwen3_5.tp_plan): tp=2 (gloo, 2
processes) gives the unsplit model's logits and every parameter's gradient on a packed
batch, holds each rank's DeltaNet heads (and counts its split as count_params says),
saves the checkpoint the unsplit model saves; check_tp refuses what does not divide.
Also the family's side of it: build_model draws A_log and dt_bias as transformers
does, and LoRA adapters on the split DeltaNet projections export as one adapter of
transformers' fused in_proj_qkv, which peft loads."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_distributed
from rollplex.models import build_model, save_pretrained
from rollplex.models.inputs import Prompt
from rollplex.models.packing import pack_sequences
from rollplex.models.qwen3_5 import FAMILY, FULL_ATTENTION, LINEAR_ATTENTION, count_params, tiny_args
from rollplex.models.qwen3_5.args import recurrent_state_bytes

SEED = 5
# In float32, rounding alone moves some gradients by ~7e-6 relative, near the 1e-5 asked of them; in float64
# (the gated delta rule still runs in float32) by ~2e-7.
DTYPE = torch.float64
LIN, FULL = LINEAR_ATTENTION, FULL_ATTENTION


def model_args():
    """Both layer kinds, a DeltaNet first and last; 2 key heads, 4 value heads, 4 attention heads, 2 KV heads."""
    return tiny_args(layer_types=(LIN, FULL, LIN))


def packed_batch(args):
    """An image prompt with a response, and a text sequence longer than one chunk of the gated delta rule."""
    v = args.vision
    g = torch.Generator().manual_seed(11)
    pixels = torch.randn(16, v.in_channels * v.temporal_patch_size * v.patch_size**2, generator=g)
    image = [args.vision_start_token_id, *[args.image_token_id] * (16 // v.spatial_merge_size**2),
             args.vision_end_token_id]
    prompts = [Prompt(torch.tensor([1, 5, *image, 7]), pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]])),
               Prompt(torch.randint(1, 90, (70,), generator=g))]
    return pack_sequences(args, prompts, [[4, 8, 3], [9]])


def passes(model) -> dict[str, torch.Tensor]:
    """Logits of the packed batch, then every parameter's gradient (whole) under a fixed loss."""
    logits = model.logits(model.forward_packed(packed_batch(model.args)))
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(12))).sum().backward()
    grads = {f"grad/{n}": (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in model.named_parameters()}
    # clone(): a row-parallel output can be an AsyncCollectiveTensor, which torch.save does not take.
    return {"logits": logits.detach().clone(), **grads}


def split_elements(module: torch.nn.Module) -> int:
    """Elements of `module`'s parameters that tensor parallelism shards."""
    from torch.distributed.tensor import DTensor, Shard

    return sum(p.numel() for p in module.parameters()
               if isinstance(p, DTensor) and any(isinstance(q, Shard) for q in p.placements))


def check_split(model, world: int) -> None:
    """Each rank holds its key heads with their value heads; the counts and state sizes say so."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    args = model.args
    deltanet = model.language_model.layers[0].linear_attn
    for name in ("in_proj_q.weight", "in_proj_k.weight", "in_proj_v.weight", "in_proj_z.weight", "in_proj_a.weight",
                 "conv1d_q", "conv1d_k", "conv1d_v", "A_log", "dt_bias"):
        p = deltanet.get_parameter(name)
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.to_local().shape[0] == p.shape[0] // world, name
    assert deltanet.out_proj.weight.placements == (Shard(1),)
    assert deltanet.norm.weight.placements == (Replicate(),)
    # Key heads 2 and value heads 4 over 2 ranks: one key head, its two value heads.
    t = args.text
    conv, recurrent = model.recurrent_state_shapes().conv, model.recurrent_state_shapes().recurrent
    assert conv == (t.linear_conv_dim // world, t.linear_conv_kernel_dim - 1)
    assert recurrent == (t.linear_num_value_heads // world, t.linear_key_head_dim, t.linear_value_head_dim)
    per_layer = conv[0] * conv[1] * 4 + recurrent[0] * recurrent[1] * recurrent[2] * 4
    assert recurrent_state_bytes(args, world, dtype_bytes=4) == t.layer_types.count(LIN) * per_layer
    assert model.kv_heads_per_rank() == t.num_key_value_heads // world
    counts = count_params(args)
    root = [model.language_model.embed_tokens, model.lm_head]
    assert counts.root_tp_split == sum(split_elements(m) for m in root)
    assert counts.tp_split == split_elements(model.language_model.layers) + counts.root_tp_split
    largest = max((split_elements(layer), sum(p.numel() for p in layer.parameters()) - split_elements(layer))
                  for layer in model.language_model.layers)
    assert (counts.layer_tp_split, counts.layer_replicated) == largest


def tp_worker(rank: int, world: int, out: str, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model = build_model(model_args(), DTYPE, seed=SEED, init_std=None, family=FAMILY)
    FAMILY.apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    check_split(model, world)
    save_pretrained(model, folder, family=FAMILY)  # collective: every rank gathers, rank 0 writes
    result = passes(model)
    if rank == 0:
        torch.save(result, out)


def test_tp2_gives_the_unsplit_logits_gradients_and_checkpoint(tmp_path):
    model = build_model(model_args(), DTYPE, seed=SEED, init_std=None, family=FAMILY)
    save_pretrained(model, tmp_path / "whole", family=FAMILY)
    expected = passes(model)
    run_distributed(tp_worker, 2, str(tmp_path / "tp.pt"), str(tmp_path / "split"))
    got = torch.load(tmp_path / "tp.pt")
    assert got.keys() == expected.keys()
    err = (got["logits"] - expected["logits"]).abs().max().item()
    assert err <= 1e-6, f"logits: max abs difference {err:.2e}"
    for name, want in expected.items():
        if name.startswith("grad/"):
            err = ((got[name] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    whole, split = (load_file(tmp_path / folder / "model.safetensors") for folder in ("whole", "split"))
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in whole


@pytest.mark.parametrize("field, value", [("linear_num_key_heads", 1), ("linear_num_value_heads", 3),
                                          ("num_attention_heads", 3), ("num_key_value_heads", 1),
                                          ("intermediate_size", 95), ("vocab_size", 101)])
def test_check_tp_refuses_a_size_that_does_not_divide(field, value):
    args = model_args()
    FAMILY.check_tp(args, 2)
    bad = dataclasses.replace(args, text=dataclasses.replace(args.text, **{field: value}))
    with pytest.raises(ValueError, match=f"tensor parallel size 2 does not divide the model's {field} \\({value}\\)"):
        FAMILY.check_tp(bad, 2)


# ----------------------------------------------------------------------------- initialisation


def test_build_model_draws_decays_as_transformers():
    """transformers' _init_weights: dt_bias 1, A_log = log U(0.01, 16) per value head (so heads decay at
    rates apart: a weight's draw, A_log near 0, would decay every head alike). init_std=None, the parity
    tests' init, draws both as a weight and a bias."""
    deltanets = [layer.linear_attn for layer in build_model(model_args(), seed=0, family=FAMILY).language_model.layers
                 if layer.kind == LIN]
    rates = torch.cat([d.A_log.detach().exp() for d in deltanets])
    assert all(torch.equal(d.dt_bias, torch.ones_like(d.dt_bias)) for d in deltanets)
    assert rates.min() >= 0.01 and rates.max() <= 16 and len(rates.unique()) == len(rates)
    draws = FAMILY.init_draw("model.language_model.layers.0.linear_attn.A_log", (20000,),
                             torch.Generator().manual_seed(0)).exp()
    assert draws.min() >= 0.01 and draws.max() <= 16
    assert abs(draws.mean().item() - (0.01 + 16) / 2) < 0.15 and abs(draws.median().item() - 8.0) < 0.3
    parity = build_model(model_args(), seed=0, init_std=None, family=FAMILY).language_model.layers[0].linear_attn
    assert 0 < parity.dt_bias.abs().max() < 0.1 and 0.2 < parity.A_log.std() < 5


# ----------------------------------------------------------------------------- LoRA on the split projections


def test_deltanet_adapters_export_as_transformers_fused_in_proj_qkv(tmp_path):
    """Adapters on in_proj_q/k/v, _z, _b, _a and out_proj: q, k and v's become one adapter of
    transformers' in_proj_qkv (rank 3r), named as its module is, and peft's model gives our logits."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen3_5ForConditionalGeneration

    from rollplex.config import LoRAConfig
    from rollplex.models import from_pretrained
    from rollplex.tiny import TinySpec, make_tiny_checkpoint
    from rollplex.train.lora import apply_lora, freeze_base
    from rollplex.train.lora_export import export_peft_adapter
    from test_lora_export import randomize_adapters

    source = make_tiny_checkpoint(tmp_path / "tiny", TinySpec.of(FAMILY), seed=0)
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=[
        "in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"])
    ours = from_pretrained(source, dtype=torch.float32, attn_backend="torch", family=FAMILY)
    apply_lora(ours, lora, seed=0)
    freeze_base(ours, torch.float32)
    randomize_adapters(ours)
    out = export_peft_adapter(ours, tmp_path / "adapter", lora, str(source))

    config = json.loads((out / "adapter_config.json").read_text())
    fused = "model.language_model.layers.0.linear_attn.in_proj_qkv"
    assert fused in config["target_modules"] and config["rank_pattern"] == {fused: 12}
    a = ours.args
    vision_ids = {a.image_token_id, a.video_token_id, a.vision_start_token_id, a.vision_end_token_id}
    ids = torch.tensor([[i for i in range(1, 20) if i not in vision_ids][:8]])
    base = Qwen3_5ForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
    hf = peft.PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
    mine = ours.eval().hf_forward(ids)
    assert (mine - theirs).abs().max().item() <= 1e-5
    plain = from_pretrained(source, dtype=torch.float32, attn_backend="torch", family=FAMILY)
    assert (mine - plain.hf_forward(ids)).abs().max() > 1e-3  # the adapters move the logits
