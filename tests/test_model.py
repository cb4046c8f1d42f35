"""The model against transformers' Qwen2.5-VL on the same random tiny checkpoints.

Inputs are built by hand here (token ids with pad runs, random pixel rows) so
each case controls grids exactly; tests/test_checkpoint_tool.py runs the same
comparison on real processor output.
"""

import json

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from rollplex.models import build_model, from_pretrained, save_pretrained
from rollplex.models.loader import CheckpointError
from rollplex.models.inputs import Prompt
from rollplex.models.packing import pack_padded, pack_sequences
from rollplex.models.protocol import VisionLanguageModel
from rollplex.models.qwen2_5_vl import tiny_args
from rollplex.models.rope import mrope_positions

IMG, VID, VSTART, VEND = 90, 91, 92, 93  # tiny_args's image pad, video pad, vision start and end
ROW = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch


def make_pair(tmp_path_factory, **kw):
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(build_model(tiny_args(**kw), seed=1, init_std=None), path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


def image(t, h, w, seed):
    """(pixel rows, grid, pad-token block) of a random image (t=1) or video (t>1)."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[t, h, w]])
    return torch.randn(t * h * w, ROW, generator=g), grid, t * h * w // 4


def hf_logits(hf, input_ids, attention_mask=None, position_ids=None, **kw):
    mm = (input_ids == IMG).long() + 2 * (input_ids == VID).long()
    with torch.no_grad():
        return hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  mm_token_type_ids=mm, **kw).logits


def assert_close(ours, ref, mask=None):
    if mask is not None:
        ours, ref = ours[mask.bool()], ref[mask.bool()]
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4, f"max abs logit difference {err}"


def test_text_only(pair):
    _, hf, ours = pair
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 2]])
    assert_close(ours.hf_forward(ids), hf_logits(hf, ids))


def test_one_image(pair):
    _, hf, ours = pair
    pv, grid, n = image(1, 10, 6, seed=0)  # 5 x 3 merged tokens: windows of 2 do not divide it
    ids = torch.tensor([[1, 2, VSTART] + [IMG] * n + [VEND, 4, 5]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_several_images_of_different_sizes(pair):
    _, hf, ours = pair
    a, ga, na = image(1, 4, 4, seed=1)
    b, gb, nb = image(1, 12, 8, seed=2)
    c, gc, nc = image(1, 2, 14, seed=3)
    ids = torch.tensor([[1, VSTART] + [IMG] * na + [VEND, 7, VSTART] + [IMG] * nb + [VEND, VSTART] + [IMG] * nc
                        + [VEND, 8, 9]])
    pv, grid = torch.cat([a, b, c]), torch.cat([ga, gb, gc])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_video(pair):
    """Video temporal positions follow real time: t index * second_per_grid_t * tokens_per_second.

    transformers 5 continues the text after a video from the largest *spatial*
    position, while the reference Qwen2.5-VL code (and vLLM) continue from the
    largest position overall; Rollplex follows the reference. So the logits are
    compared with transformers given Rollplex's positions, and the positions are
    checked against the reference rule by hand.
    """
    path, hf, ours = pair
    pv, grid, n = image(3, 4, 8, seed=4)  # 3 frame groups of 2 x 4 merged tokens
    ids = torch.tensor([[1, 2, VSTART] + [VID] * n + [VEND, 4, 5]])
    seconds = torch.tensor([1.5])
    positions, delta = mrope_positions(ids[0], ours.args.rope_spec, video_grid_thw=grid, second_per_grid_ts=seconds)
    start = 3
    t_pos = torch.tensor([0, 3, 6]).repeat_interleave(8) + start  # 1.5 s * 2 tokens/s = 3 per frame group
    h_pos = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]).repeat(3) + start
    w_pos = torch.tensor([0, 1, 2, 3]).repeat(6) + start
    assert torch.equal(positions[:, start:start + n], torch.stack([t_pos, h_pos, w_pos]))
    after = 9 + 1  # largest position so far (t = 3 + 6) + 1
    assert positions[:, start + n].tolist() == [after] * 3
    assert delta == after + 3 - ids.shape[1]
    ours_logits = ours.hf_forward(ids, pixel_values_videos=pv, video_grid_thw=grid, second_per_grid_ts=seconds)
    ref = hf_logits(hf, ids, position_ids=positions[:, None, :], pixel_values_videos=pv, video_grid_thw=grid,
                    second_per_grid_ts=seconds)
    assert_close(ours_logits, ref)


def test_positions_equal_transformers_when_rules_agree(pair):
    """Where transformers 5 and the reference rule agree (images; videos whose time
    span is shorter than their side), position ids are identical. A whole number of
    seconds per frame group: transformers 5.17 truncates it to an int
    (fixed by huggingface/transformers#48669); fractional ones are checked in test_video."""
    _, hf, ours = pair
    pv, grid, n = image(1, 6, 10, seed=5)
    vv, vgrid, vn = image(2, 8, 8, seed=6)
    ids = torch.tensor([[3, VSTART] + [IMG] * n + [VEND, VSTART] + [VID] * vn + [VEND, 5, 6]])
    seconds = torch.tensor([1.0])
    mm = (ids == IMG).long() + 2 * (ids == VID).long()
    ref, ref_delta = hf.model.get_rope_index(ids, mm, grid, vgrid, seconds)
    got, delta = mrope_positions(ids[0], ours.args.rope_spec, grid, vgrid, seconds)
    assert torch.equal(got, ref[:, 0]) and delta == int(ref_delta)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_mixing_text_images_video(pair, side):
    _, hf, ours = pair
    a, ga, na = image(1, 4, 6, seed=7)
    b, gb, nb = image(1, 8, 4, seed=8)
    v, gv, nv = image(2, 4, 4, seed=9)
    rows = [
        [1, 2, 3, 4],
        [5, VSTART] + [IMG] * na + [VEND, 6, VSTART] + [IMG] * nb + [VEND, 7],
        [8, VSTART] + [VID] * nv + [VEND, 9, 10],
    ]
    L = max(map(len, rows))
    pad = lambda r: ([0] * (L - len(r)) + r) if side == "left" else (r + [0] * (L - len(r)))  # noqa: E731
    ids = torch.tensor([pad(r) for r in rows])
    mask = torch.tensor([pad([1] * len(r)) for r in rows])
    seconds = torch.tensor([0.5])
    kw = dict(pixel_values=torch.cat([a, b]), image_grid_thw=torch.cat([ga, gb]), pixel_values_videos=v,
              video_grid_thw=gv, second_per_grid_ts=seconds)
    # Rollplex positions for the video row (see test_video); transformers' own for the rest agree anyway.
    positions = torch.zeros(3, len(rows), L, dtype=torch.long)
    batch = pack_padded(ours.args, ids, mask, **kw)
    for i, (start, end) in enumerate(zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:])):
        positions[:, i][:, mask[i].bool()] = batch.position_ids[:, start:end]
    assert_close(ours.hf_forward(ids, mask, **kw), hf_logits(hf, ids, mask, positions, **kw), mask)
    no_video = {k: kw[k] for k in ("pixel_values", "image_grid_thw")}
    assert_close(ours.hf_forward(ids[:2], mask[:2], **no_video), hf_logits(hf, ids[:2], mask[:2], **no_video),
                 mask[:2])


def test_tied_embeddings(tmp_path_factory):
    path, hf, ours = make_pair(tmp_path_factory, tie=True)
    assert ours.lm_head is None
    assert "lm_head.weight" not in json.dumps(sorted(ours.state_dict()))
    pv, grid, n = image(1, 4, 4, seed=10)
    ids = torch.tensor([[1, VSTART] + [IMG] * n + [VEND, 2]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_window_size_not_dividing_the_grid(tmp_path_factory):
    _, hf, ours = make_pair(tmp_path_factory, window_size=84)  # windows of 3 x 3 merged tokens
    pv, grid, n = image(1, 14, 10, seed=11)  # 7 x 5 merged tokens
    ids = torch.tensor([[1, VSTART] + [IMG] * n + [VEND, 2]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_packed_forward_equals_hf_forward(pair):
    """The training forward (packed, no padding) gives each sequence's logits."""
    _, _, ours = pair
    a, ga, na = image(1, 6, 6, seed=12)
    v, gv, nv = image(2, 4, 4, seed=13)
    seqs = [
        Prompt(torch.tensor([1, VSTART] + [IMG] * na + [VEND, 2, 3]), pixel_values=a, image_grid_thw=ga),
        Prompt(torch.tensor([4, 5, 6])),
        Prompt(torch.tensor([7, VSTART] + [VID] * nv + [VEND, 8]), pixel_values_videos=v,
                       video_grid_thw=gv, second_per_grid_ts=torch.tensor([1.0])),
    ]
    with torch.no_grad():
        packed = ours.logits(ours.forward_packed(pack_sequences(ours.args, seqs)))
    offset = 0
    for s in seqs:
        single = ours.hf_forward(s.input_ids[None], pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                                 pixel_values_videos=s.pixel_values_videos, video_grid_thw=s.video_grid_thw,
                                 second_per_grid_ts=s.second_per_grid_ts)[0]
        assert (packed[offset:offset + len(s.input_ids)] - single).abs().max() <= 1e-5
        offset += len(s.input_ids)


def test_transformers_saves_rollplex_loads(pair, tmp_path):
    """transformers 5 writes nested configs and `model.language_model.*` keys; sharded too."""
    _, hf, _ = pair
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert "text_config" in json.loads((tmp_path / "config.json").read_text())
    ours = from_pretrained(tmp_path, dtype=torch.float32)
    pv, grid, n = image(1, 4, 8, seed=14)
    ids = torch.tensor([[1, VSTART] + [IMG] * n + [VEND, 2]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_sharded_save_round_trip(pair, tmp_path):
    _, _, ours = pair
    save_pretrained(ours, tmp_path, max_shard_bytes=50_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    again = from_pretrained(tmp_path, dtype=torch.float32)
    for (name, p), (_, q) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name


def test_bf16_load_keeps_rotary_in_fp32(pair):
    path, _, ours = pair
    model = from_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 2]])
    logits = model.hf_forward(ids)
    assert logits.dtype == torch.bfloat16
    assert model.language_model.rotary.inv_freq(torch.device("cpu")).dtype == torch.float32
    assert (logits.float() - ours.hf_forward(ids)).abs().max() < 0.05


# ----------------------------------------------------------------------------- bad input


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = pair
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(tmp_path)


def test_image_token_count_mismatch(pair):
    _, _, ours = pair
    pv, grid, n = image(1, 4, 4, seed=15)
    truncated = torch.tensor([[1, VSTART] + [IMG] * (n - 1)])
    with pytest.raises(ValueError, match="truncated through the image"):
        ours.hf_forward(truncated, pixel_values=pv, image_grid_thw=grid)


def test_pixels_that_do_not_match_the_grid(pair):
    _, _, ours = pair
    pv, grid, n = image(1, 4, 4, seed=16)
    with pytest.raises(ValueError, match="does not match its grids"):
        ours.encode_vision(pv[:-1], grid)


def test_the_model_has_every_call_the_engine_makes():
    """rollplex.models.protocol names what the engine may call on a model: a family's model has each of them."""
    model = build_model(tiny_args(), seed=0)
    assert isinstance(model, VisionLanguageModel)
    assert list(model.decoder_stages()) == ["embedding", "decoder layer 0", "decoder layer 1", "final norm"]
    table = model.text_rotary_table(5, model.device, model.dtype)
    assert table.shape == (5, 2 * model.args.text.head_dim) and table.dtype == model.dtype
