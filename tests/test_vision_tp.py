"""Tensor parallelism of the vision tower: the hub's fused qkv is split at load
and fused again at save, and tp=2 (gloo, 2 processes) gives tp=1's vision
features, logits and gradients."""

import torch
from safetensors.torch import load_file

from distributed import run_distributed
from rollplex.models import build_model, from_pretrained, save_pretrained
from rollplex.models.inputs import Prompt
from rollplex.models.packing import pack_sequences
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs
from rollplex.models.qwen2_5_vl.tp_plan import check_tp, vision_splits
from test_model import IMG, VEND, VID, VSTART, image, tiny_args

SEED = 7


def inputs():
    """(image/video pixels and grids, packed batch of an image and a video sequence)."""
    pv, grid, n = image(1, 8, 8, seed=20)  # 4 x 4 merged tokens: several attention windows
    vv, vgrid, vn = image(2, 4, 4, seed=21)
    seqs = [Prompt(torch.tensor([1, VSTART] + [IMG] * n + [VEND, 2, 3]), pixel_values=pv,
                           image_grid_thw=grid),
            Prompt(torch.tensor([4, VSTART] + [VID] * vn + [VEND, 5]), pixel_values_videos=vv,
                           video_grid_thw=vgrid, second_per_grid_ts=torch.tensor([1.0]))]
    return (pv, grid, vv, vgrid), pack_sequences(tiny_args(), seqs)


def passes(model) -> dict[str, torch.Tensor]:
    """Vision features and logits, then the gradient of every parameter under a fixed loss."""
    (pv, grid, vv, vgrid), batch = inputs()
    with torch.no_grad():
        vision = model.encode_vision(pv, grid, vv, vgrid)
    logits = model.logits(model.forward_packed(batch))
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(22))
    (logits * weights).sum().backward()
    grads = {f"grad/{n.replace('._checkpoint_wrapped_module', '')}":
             (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
             for n, p in model.named_parameters()}
    return {"image": vision.image, "video": vision.video, "logits": logits.detach(), **grads}


def tp_passes(rank: int, world: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from rollplex.dist import ParallelDims, build_mesh
    from rollplex.train.parallelize import parallelize

    torch.set_num_threads(1)
    model = build_model(tiny_args(), seed=SEED, init_std=None)
    mesh = build_mesh(ParallelDims.resolve(world, 1, world), "cpu")
    parallelize(model, mesh)
    tp = mesh.mesh_dim_names.index("tp")
    for block in model.visual.blocks:
        for linear in (block.attn.q, block.attn.k, block.attn.v):
            for p in (linear.weight, linear.bias):
                assert isinstance(p, DTensor) and p.placements[tp] == Shard(0), p.placements
                assert p.to_local().shape[0] == p.shape[0] // world
    result = passes(model)
    if rank == 0:
        torch.save(result, out)


def test_tp2_equals_tp1(tmp_path):
    expected = passes(build_model(tiny_args(), seed=SEED, init_std=None))
    out = tmp_path / "tp.pt"
    run_distributed(tp_passes, 2, str(out))
    got = torch.load(out)
    assert got.keys() == expected.keys()
    assert any(k.startswith("grad/visual.blocks.") and k.endswith("attn.q.weight") for k in got)
    for name in ("image", "video", "logits"):
        err = (got[name] - expected[name]).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs difference {err:.2e}"
    # Gradients reach ~80 under this loss, so fp32 rounding is compared relative to their size.
    for name, want in expected.items():
        if name.startswith("grad/"):
            err = ((got[name] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_vision_tower_stays_replicated_when_tp_does_not_divide_it():
    """The hub's 3B/7B vision MLP width (3420) does not divide by 8: the tower
    stays whole on every rank and the language model is still split."""
    def args(num_heads=2, intermediate_size=48):
        return ModelArgs(vision=VisionArgs(depth=1, hidden_size=12 * num_heads, num_heads=num_heads,
                                           intermediate_size=intermediate_size, out_hidden_size=64),
                         text=TextArgs(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3]))

    assert vision_splits(args(), 2)
    assert not vision_splits(args(num_heads=3), 2)
    assert not vision_splits(args(intermediate_size=49), 2)
    check_tp(args(intermediate_size=49), 2)  # the language model alone decides


def test_fused_qkv_splits_at_load_and_fuses_at_save(tmp_path):
    """A hub checkpoint (fused qkv) loads into q/k/v row blocks and saves back the same bytes."""
    save_pretrained(build_model(tiny_args(), seed=SEED, init_std=None), tmp_path / "hub")
    hub = load_file(tmp_path / "hub" / "model.safetensors")
    assert "visual.blocks.0.attn.qkv.weight" in hub and "visual.blocks.0.attn.q.weight" not in hub
    model = from_pretrained(tmp_path / "hub", dtype=torch.float32)
    attn, hidden = model.visual.blocks[0].attn, tiny_args().vision.hidden_size
    for i, linear in enumerate((attn.q, attn.k, attn.v)):
        rows = slice(i * hidden, (i + 1) * hidden)
        assert torch.equal(linear.weight, hub["visual.blocks.0.attn.qkv.weight"][rows])
        assert torch.equal(linear.bias, hub["visual.blocks.0.attn.qkv.bias"][rows])
    assert attn.q.weight.untyped_storage().data_ptr() != attn.k.weight.untyped_storage().data_ptr()
    save_pretrained(model, tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert again.keys() == hub.keys()
    for key, tensor in hub.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
