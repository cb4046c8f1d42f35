"""Qwen3-VL against transformers' Qwen3VLForConditionalGeneration, on tiny random
checkpoints that transformers itself wrote.

Each reference model is built from a `Qwen3VLConfig`, given weights that make
every layer matter (normal(0, 1/sqrt(fan_in)) matrices, random biases and norm
scales), saved with `save_pretrained`, and loaded into Rollplex's `Qwen3_VL`.
Inputs are built by hand (token ids with pad runs, random pixel rows) so each
case controls grids exactly; a video is laid out as Qwen3-VL's processor writes
it: every frame group after its timestamp text, in a vision start / end of its own.
"""

import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from distributed import run_distributed
from rollplex.models import from_pretrained, save_pretrained
from rollplex.models.inputs import Group, Prompt, Sample, VisionEmbeds, VisionSlots
from rollplex.models.packing import pack_groups, pack_sequences
from rollplex.models.protocol import CheckpointError, VisionLanguageModel, fsdp_entry_methods
from rollplex.models.qwen3_vl import (PRESETS, Qwen3_VL, args_from_hf_config, count_params, hf_config_from_args,
                                      hf_key_to_params, linear_params, param_to_hf_key, tiny_args)
from rollplex.models.rope import MRotaryEmbedding, inv_frequencies, mrope_positions
from rollplex.ops.attention import VarlenAttention

IMG, VID, VSTART, VEND = 90, 91, 92, 93  # tiny_args's image pad, video pad, vision start and end
ROW = 3 * 2 * 16 * 16  # channels * temporal_patch * patch * patch
STAMP = [40, 41]  # "<t seconds>" as text tokens: the first one is replaced by 40 + the frame group's index


# ----------------------------------------------------------------------------- checkpoints


def hf_config(tie: bool = False, layers: int = 2, deepstack: tuple[int, ...] = (0, 1), depth: int = 3,
              side: int = 6) -> Qwen3VLConfig:
    """tiny_args's shape, as a transformers config (independent of hf_config_from_args)."""
    return Qwen3VLConfig(
        text_config=dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 3, 3],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=depth, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           num_position_embeddings=side * side, deepstack_visual_indexes=list(deepstack)),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
        tie_word_embeddings=tie)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights under which every layer moves the output: matrices ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2),
    norm scales ~ U(0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                value = torch.randn(p.shape, generator=g) * math.prod(p.shape[1:]) ** -0.5
            elif name.endswith("bias"):
                value = torch.randn(p.shape, generator=g) * 0.1
            else:
                value = torch.rand(p.shape, generator=g) + 0.5
            p.copy_(value)


def load(path) -> Qwen3_VL:
    """A transformers-written folder -> our model in float32, through the family-generic loader."""
    return from_pretrained(path, dtype=torch.float32, attn_backend="torch")


_PAIRS: dict[tuple, tuple] = {}


def cached_pair(tmp_path_factory, key: tuple, build: Callable[[], torch.nn.Module],
                load: Callable[[Path], torch.nn.Module]) -> tuple:
    """(folder, transformers model, our model `load`ed from the folder transformers wrote) of the transformers
    model `build()` makes, cached by `key` (its family's name first, then its seed and shape): every family's
    parity tests make their pairs so."""
    if key not in _PAIRS:
        hf = build().eval()
        path = tmp_path_factory.mktemp(key[0])
        hf.save_pretrained(path)
        _PAIRS[key] = path, hf, load(path)
    return _PAIRS[key]


def make_pair(tmp_path_factory, seed: int = 1, **kw):
    """A pair (`cached_pair`) of hf_config(**kw)'s shape, its weights drawn by `randomize` from `seed`."""
    def build():
        hf = Qwen3VLForConditionalGeneration(hf_config(**kw))
        randomize(hf, seed)
        return hf

    return cached_pair(tmp_path_factory, ("qwen3_vl", seed, *sorted(kw.items())), build, load)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


# ----------------------------------------------------------------------------- inputs


def pixels(t: int, h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows of an image (t = 1) or a video of t frame groups, and the grid."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t * h * w, ROW, generator=g), torch.tensor([[t, h, w]])


def image_tokens(grid: torch.Tensor) -> list[int]:
    return [VSTART] + [IMG] * (int(grid.prod()) // 4) + [VEND]


def video_tokens(grid: torch.Tensor) -> list[int]:
    """As Qwen3-VL's processor lays a video out: each frame group after its timestamp, in its own start/end,
    all inside the chat template's vision start/end."""
    t, h, w = grid[0].tolist()
    frames = []
    for j in range(t):
        frames += [STAMP[0] + j, STAMP[1], VSTART] + [VID] * (h * w // 4) + [VEND]
    return [VSTART] + frames + [VEND]


def mm_types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMG).long() + 2 * (ids == VID).long()


def hf_logits(hf, input_ids, attention_mask=None, **kw) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=input_ids, attention_mask=attention_mask, mm_token_type_ids=mm_types(input_ids),
                  **kw).logits


def assert_close(ours, ref, mask=None, tol=1e-4):
    if mask is not None:
        ours, ref = ours[mask.bool()], ref[mask.bool()]
    err = (ours - ref).abs().max().item()
    assert err <= tol, f"max abs logit difference {err}"


def image_and_video_prompt(seed: int = 30) -> Prompt:
    a, ga = pixels(1, 4, 6, seed)
    v, gv = pixels(3, 4, 4, seed + 1)
    ids = [1, 2] + image_tokens(ga) + [3] + video_tokens(gv) + [4, 5]
    return Prompt(torch.tensor(ids), pixel_values=a, image_grid_thw=ga, pixel_values_videos=v, video_grid_thw=gv)


# ----------------------------------------------------------------------------- logits against transformers


def test_text_only(pair):
    _, hf, ours = pair
    ids = torch.tensor([[1, 5, 7, 9, 11, 3, 2]])
    assert_close(ours.hf_forward(ids), hf_logits(hf, ids))


def test_one_image(pair):
    _, hf, ours = pair
    pv, grid = pixels(1, 10, 6, seed=0)  # 10 x 6 patches from a 6 x 6 position grid: up and down
    ids = torch.tensor([[1, 2] + image_tokens(grid) + [4, 5]])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_two_images_of_different_sizes(pair):
    _, hf, ours = pair
    a, ga = pixels(1, 2, 14, seed=1)  # 2 patch rows (one merged row): the position grid's first and last
    b, gb = pixels(1, 12, 8, seed=2)
    ids = torch.tensor([[1] + image_tokens(ga) + [7] + image_tokens(gb) + [8, 9]])
    pv, grid = torch.cat([a, b]), torch.cat([ga, gb])
    assert_close(ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid))


def test_video_of_three_frame_groups(pair):
    _, hf, ours = pair
    pv, grid = pixels(3, 4, 8, seed=3)
    ids = torch.tensor([[1, 2] + video_tokens(grid) + [4, 5]])
    assert_close(ours.hf_forward(ids, pixel_values_videos=pv, video_grid_thw=grid),
                 hf_logits(hf, ids, pixel_values_videos=pv, video_grid_thw=grid))


def test_image_and_video_in_one_prompt(pair):
    _, hf, ours = pair
    p = image_and_video_prompt()
    kw = dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
              video_grid_thw=p.video_grid_thw)
    ids = p.input_ids[None]
    assert_close(ours.hf_forward(ids, **kw), hf_logits(hf, ids, **kw))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_mixing_text_images_video(pair, side):
    """transformers computes its own positions here (get_rope_index with the attention mask)."""
    _, hf, ours = pair
    a, ga = pixels(1, 4, 6, seed=4)
    b, gb = pixels(1, 8, 4, seed=5)
    v, gv = pixels(2, 4, 4, seed=6)
    rows = [[1, 2, 3, 4], [5] + image_tokens(ga) + [6] + image_tokens(gb) + [7], [8] + video_tokens(gv) + [9, 10]]
    L = max(map(len, rows))
    pad = lambda r: ([0] * (L - len(r)) + r) if side == "left" else (r + [0] * (L - len(r)))  # noqa: E731
    ids = torch.tensor([pad(r) for r in rows])
    mask = torch.tensor([pad([1] * len(r)) for r in rows])
    kw = dict(pixel_values=torch.cat([a, b]), image_grid_thw=torch.cat([ga, gb]), pixel_values_videos=v,
              video_grid_thw=gv)
    assert_close(ours.hf_forward(ids, mask, **kw), hf_logits(hf, ids, mask, **kw), mask)


def test_tied_embeddings(tmp_path_factory):
    path, hf, ours = make_pair(tmp_path_factory, tie=True)
    assert hf.lm_head.weight is hf.model.language_model.embed_tokens.weight
    assert ours.lm_head is None and not any(k.startswith("lm_head") for k in ours.state_dict())
    p = image_and_video_prompt(seed=7)
    kw = dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
              video_grid_thw=p.video_grid_thw)
    assert_close(ours.hf_forward(p.input_ids[None], **kw), hf_logits(hf, p.input_ids[None], **kw))


@pytest.mark.parametrize("layers, deepstack", [
    (1, (0, 1, 2)),  # more DeepStack levels than decoder layers: the extra ones go unused
    (3, (0,)),
    (3, ()),  # no DeepStack mergers at all
    (4, (2, 0, 3)),  # indexes out of order: merger i serves block indexes[i], levels go in block order
])
def test_layer_and_deepstack_counts(tmp_path_factory, layers, deepstack):
    _, hf, ours = make_pair(tmp_path_factory, layers=layers, deepstack=deepstack, depth=4)
    assert len(ours.visual.deepstack_merger_list) == len(deepstack)
    p = image_and_video_prompt(seed=8)
    vision = ours.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
    if deepstack:
        assert vision.image_deepstack.shape == (len(deepstack), vision.image.shape[0], 64)
        assert vision.video_deepstack.shape == (len(deepstack), vision.video.shape[0], 64)
    else:
        assert vision.image_deepstack is None and vision.video_deepstack is None
    kw = dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
              video_grid_thw=p.video_grid_thw)
    assert_close(ours.hf_forward(p.input_ids[None], **kw), hf_logits(hf, p.input_ids[None], **kw))


def test_deepstack_matters(pair):
    """Dropping the DeepStack levels changes the logits at and after the vision tokens: the parity
    tests above would catch levels added at the wrong rows, layers or not at all."""
    _, _, ours = pair
    p = image_and_video_prompt(seed=9)
    batch = pack_sequences(ours.args, [p])
    with torch.no_grad():
        vision = ours.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
        full = ours.logits(ours.forward_packed(batch, vision))
        flat = ours.logits(ours.forward_packed(batch, VisionEmbeds(vision.image, vision.video)))
    first = int((p.input_ids == IMG).nonzero()[0])
    assert torch.equal(full[:first], flat[:first])
    assert (full[first:] - flat[first:]).abs().max() > 1e-2


# ----------------------------------------------------------------------------- positions


def test_positions_equal_transformers_get_rope_index(pair):
    """Each frame group of a video is a block of t = 1 of its own: transformers splits video_grid_thw
    per frame group; text after a block continues from its start + max(h, w) / merge."""
    _, hf, ours = pair
    _, ga = pixels(1, 6, 10, seed=0)
    _, gb = pixels(1, 2, 4, seed=0)
    _, gv = pixels(3, 8, 4, seed=0)
    _, gw = pixels(2, 4, 12, seed=0)
    ids = torch.tensor([3] + image_tokens(ga) + video_tokens(gv) + [5] + image_tokens(gb) + video_tokens(gw) + [6])
    grids, videos = torch.cat([ga, gb]), torch.cat([gv, gw])
    ref, ref_delta = hf.model.get_rope_index(ids[None], mm_token_type_ids=mm_types(ids[None]),
                                             image_grid_thw=grids, video_grid_thw=videos)
    got, delta = mrope_positions(ids, ours.args.rope_spec, grids, videos, second_per_grid_ts=torch.tensor([2., 3.]))
    assert torch.equal(got, ref[:, 0]) and delta == int(ref_delta)
    # By hand, the first frame group (4 x 2 merged tokens after its timestamp): t stays at its start.
    start = 1 + len(image_tokens(ga)) + 1 + 2 + 1  # past the image, the video's start, a timestamp, a start
    p = int(got[0, start - 1]) + 1
    assert got[:, start - 1].tolist() == [p - 1] * 3
    assert got[0, start:start + 8].tolist() == [p] * 8
    assert got[1, start:start + 8].tolist() == [p + r for r in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert got[2, start:start + 8].tolist() == [p + c for c in (0, 1) * 4]
    assert got[:, start + 8].tolist() == [p + 4] * 3  # the frame group's end: its start + max(4, 2)


def test_frame_group_count_mismatch_is_named(pair):
    _, _, ours = pair
    _, gv = pixels(3, 4, 4, seed=0)
    ids = torch.tensor([1] + video_tokens(pixels(2, 4, 4, seed=0)[1]) + [2])  # two frame groups' tokens
    with pytest.raises(ValueError, match="video grids hold 3 frame groups"):
        mrope_positions(ids, ours.args.rope_spec, video_grid_thw=gv)
    truncated = torch.tensor([1, VSTART] + [VID] * 3)
    with pytest.raises(ValueError, match="video frame group 0 has grid .* truncated through the video"):
        mrope_positions(truncated, ours.args.rope_spec, video_grid_thw=gv)


def test_interleaved_rotary_equals_transformers():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    cfg = hf_config().text_config
    ref = Qwen3VLTextRotaryEmbedding(cfg)
    ours = MRotaryEmbedding(24, 10000.0, [6, 3, 3], interleaved=True)
    positions = torch.randint(0, 500, (3, 1, 37))
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), positions)
    got_cos, got_sin = ours(positions[:, 0], torch.float32)
    assert torch.equal(got_cos, cos[0]) and torch.equal(got_sin, sin[0])
    # The hub's [24, 20, 20]: h and w take frequencies 1, 4, ... and 2, 5, ... below 60; t the rest.
    axes = MRotaryEmbedding(128, 5e6, [24, 20, 20], interleaved=True).frequency_axes(torch.device("cpu"))
    assert axes[:6].tolist() == [0, 1, 2, 0, 1, 2] and axes[60:].tolist() == [0, 0, 0, 0]
    assert [(axes == a).sum().item() for a in range(3)] == [24, 20, 20]


def test_text_table_is_plain_rope_whatever_the_layout():
    """For text all three axes are equal, so interleaving does not change the decode table."""
    interleaved = MRotaryEmbedding(24, 10000.0, [6, 3, 3], interleaved=True)
    chunked = MRotaryEmbedding(24, 10000.0, [6, 3, 3])
    table = interleaved.text_table(50, torch.device("cpu"), torch.float32)
    assert torch.equal(table, chunked.text_table(50, torch.device("cpu"), torch.float32))
    angles = torch.arange(50).float()[:, None] * inv_frequencies(24, 10000.0)
    angles = torch.cat([angles, angles], dim=-1)
    assert torch.equal(table, torch.cat([angles.cos(), angles.sin()], dim=-1))


# ----------------------------------------------------------------------------- packed and shared-prefix passes


def test_packed_forward_equals_hf_forward(pair):
    """The training forward (packed, no padding) gives each sequence's logits."""
    _, _, ours = pair
    a, ga = pixels(1, 6, 6, seed=12)
    v, gv = pixels(2, 4, 4, seed=13)
    seqs = [Prompt(torch.tensor([1] + image_tokens(ga) + [2, 3]), pixel_values=a, image_grid_thw=ga),
            Prompt(torch.tensor([4, 5, 6])),
            Prompt(torch.tensor([7] + video_tokens(gv) + [8]), pixel_values_videos=v, video_grid_thw=gv),
            image_and_video_prompt(seed=14)]
    with torch.no_grad():
        packed = ours.logits(ours.forward_packed(pack_sequences(ours.args, seqs)))
    offset = 0
    for s in seqs:
        single = ours.hf_forward(s.input_ids[None], pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                                 pixel_values_videos=s.pixel_values_videos, video_grid_thw=s.video_grid_thw)[0]
        assert (packed[offset:offset + len(s.input_ids)] - single).abs().max() <= 1e-5
        offset += len(s.input_ids)


def groups(generated_pad: bool = True) -> list[Group]:
    """Two GRPO groups: an image + video prompt with three responses (one holding a generated image pad
    id, embedded as text, unless not `generated_pad`), a text prompt with two."""
    sample = lambda tokens: Sample(tokens, [0.0] * len(tokens), "stop")  # noqa: E731
    second = [8, IMG, 9, 10] if generated_pad else [8, 30, 9, 10]
    return [Group(image_and_video_prompt(seed=15), [sample([5, 6, 7]), sample(second), sample([11])]),
            Group(Prompt(torch.tensor([1, 2, 3])), [sample([12, 13]), sample([14])])]


def test_shared_prefix_forward_equals_transformers(pair):
    """pack_groups(share_prefix=True): each prompt once, its responses after it; every response
    token's logits equal transformers' on the full sequence prompt + response."""
    _, hf, ours = pair
    data = groups(generated_pad=False)
    batch = pack_groups(ours.args, data, share_prefix=True)
    with torch.no_grad():
        got = ours.logits(ours.forward_packed(batch.packed)[batch.target_index])
    want = []
    for g in data:
        p = g.prompt
        for r in g.responses:
            ids = torch.cat([p.input_ids, torch.tensor(r)])[None]
            logits = hf_logits(hf, ids, pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw,
                               pixel_values_videos=p.pixel_values_videos, video_grid_thw=p.video_grid_thw)[0]
            n = len(p.input_ids)
            want.append(logits[n - 1:n - 1 + len(r)])
    assert_close(got, torch.cat(want))


def test_generated_pad_id_is_text(pair):
    """A response holding the image pad id: shared-prefix and per-response full sequences agree
    (both embed it as text and add no DeepStack level there), which transformers cannot express."""
    _, _, ours = pair
    data = groups()
    shared, full = (pack_groups(ours.args, data, share_prefix=share) for share in (True, False))
    with torch.no_grad():
        a = ours.logits(ours.forward_packed(shared.packed)[shared.target_index])
        b = ours.logits(ours.forward_packed(full.packed)[full.target_index])
    assert_close(a, b, tol=1e-5)
    slots = VisionSlots.find(ours.args, shared.packed.input_ids, shared.packed.prompt_mask)
    assert len(slots.image) == int((data[0].prompt.input_ids == IMG).sum())


def test_grads_equal_transformers_and_reach_deepstack(tmp_path_factory):
    """A loss on response logprobs, backpropagated through the shared-prefix forward, gives every
    parameter transformers' gradient (summed over per-response full sequences), and reaches the
    DeepStack mergers and every vision block."""
    path, hf, _ = make_pair(tmp_path_factory, seed=2, layers=3, deepstack=(0, 2), depth=4)
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
        logits = hf(input_ids=ids, mm_token_type_ids=mm_types(ids), pixel_values=p.pixel_values,
                    image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
                    video_grid_thw=p.video_grid_thw).logits[0]
        n = len(p.input_ids)
        logits[n - 1:n - 1 + len(r)].log_softmax(-1).gather(1, torch.tensor(r)[:, None]).sum().backward()
    ref = dict(hf.named_parameters())
    ours_params = dict(ours.named_parameters())
    for key in dict.fromkeys(param_to_hf_key(name) for name in ours_params):
        got = torch.cat([ours_params[n].grad for n in hf_key_to_params(key)])
        want = ref[key].grad
        assert want is not None and want.norm() > 0, key
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-4, f"{key}: relative gradient error {err:.2e}"
    for name in ("visual.deepstack_merger_list.0.linear_fc1.weight", "visual.deepstack_merger_list.1.norm.weight",
                 *(f"visual.blocks.{i}.attn.q.weight" for i in range(4)), "visual.pos_embed.weight",
                 "visual.patch_embed.proj.bias"):
        assert ours_params[name].grad.abs().max() > 0, name
    hf.zero_grad(set_to_none=True)


def test_layer_by_layer_and_decode_paths(pair):
    """layer_by_layer with the prompt's vision and slots is the forward; without them, or in
    forward_generated, nothing is added (decode of generated text)."""
    _, _, ours = pair
    p = image_and_video_prompt(seed=17)
    batch = pack_sequences(ours.args, [p])
    attn = VarlenAttention(batch.cu_seqlens.tolist(), "cpu")
    with torch.no_grad():
        vision = ours.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
        slots = VisionSlots.find(ours.args, batch.input_ids)
        h = ours.embed_prompts(batch.input_ids, vision, slots)
        *layers, last = list(ours.layer_by_layer(h, batch.position_ids, attn, vision, slots))
        assert len(layers) == ours.args.text.num_hidden_layers
        assert torch.equal(last, ours(batch.input_ids, batch.position_ids, attn, vision))
        *_, plain = ours.layer_by_layer(h, batch.position_ids, attn)
        assert not torch.allclose(plain, last)
        text = torch.tensor([4, 8, 15, 16, 23])
        attn = VarlenAttention.from_lengths([5], "cpu")
        positions = torch.arange(5).expand(3, -1)
        assert torch.equal(ours.forward_generated(text, positions, attn), ours(text, positions, attn))
        table = ours.text_rotary_table(5, ours.device, ours.dtype)
        cos, sin = table.chunk(2, dim=-1)
        assert torch.allclose(ours.forward_generated(text, (cos, sin), attn),
                              ours.forward_generated(text, positions, attn), atol=1e-6)


def test_deepstack_rows_that_do_not_match_are_an_error(pair):
    _, _, ours = pair
    p = image_and_video_prompt(seed=18)
    with torch.no_grad():
        vision = ours.encode_vision(p.pixel_values, p.image_grid_thw)
    short = VisionSlots(VisionSlots.find(ours.args, p.input_ids).image[:-1], torch.zeros(0, dtype=torch.long))
    h = torch.zeros(len(p.input_ids), 64)
    with pytest.raises(ValueError, match="image DeepStack levels of shape"):
        ours.layer_by_layer(h, torch.zeros(3, len(p.input_ids), dtype=torch.long), None, vision, short)


# ----------------------------------------------------------------------------- checkpoints and config


def test_round_trip_through_transformers(pair, tmp_path):
    """Our model saved through hf_config_from_args / param_to_hf_key: transformers loads it and gives
    its logits; we load it back unchanged."""
    _, hf, ours = pair
    save_pretrained(ours, tmp_path / "ours")
    again = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert again.config.text_config.head_dim == 24 and again.config.vision_config.deepstack_visual_indexes == [0, 1]
    p = image_and_video_prompt(seed=19)
    kw = dict(pixel_values=p.pixel_values, image_grid_thw=p.image_grid_thw, pixel_values_videos=p.pixel_values_videos,
              video_grid_thw=p.video_grid_thw)
    assert_close(hf_logits(again, p.input_ids[None], **kw), hf_logits(hf, p.input_ids[None], **kw), tol=0)
    back = load(tmp_path / "ours")
    assert back.args == ours.args
    for (name, a), (_, b) in zip(ours.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_keys_map_both_ways(pair):
    """Every key transformers 5 writes names parameters of ours and comes back from them; the older
    `visual.*` / `model.*` style maps to the same parameters."""
    path, _, ours = pair
    with safe_open(path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    names = [n for key in keys for n in hf_key_to_params(key)]
    assert sorted(names) == sorted(ours.state_dict())
    assert {param_to_hf_key(n) for n in names} == keys
    assert hf_key_to_params("model.visual.blocks.2.attn.qkv.bias") == [
        "visual.blocks.2.attn.q.bias", "visual.blocks.2.attn.k.bias", "visual.blocks.2.attn.v.bias"]
    assert hf_key_to_params("visual.deepstack_merger_list.1.norm.weight") == [
        "visual.deepstack_merger_list.1.norm.weight"]
    assert hf_key_to_params("model.layers.0.self_attn.q_norm.weight") == [
        "language_model.layers.0.self_attn.q_norm.weight"]


def test_config_round_trip_and_hub_style():
    for args in (tiny_args(), tiny_args(tie=True, deepstack=()), *PRESETS.values()):
        assert args_from_hf_config(hf_config_from_args(args)) == args
    # The hub's config.json for Qwen3-VL-8B-Instruct as transformers 4.57 wrote it (rope_scaling + rope_theta).
    hub = {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 151655,
        "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "tie_word_embeddings": False,
        "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 4096,
                        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 262144, "attention_bias": False, "rope_theta": 5000000,
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                         "rope_type": "default"},
                        "bos_token_id": 151643, "eos_token_id": 151645},
        "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                          "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "out_hidden_size": 4096, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
    }
    assert args_from_hf_config(hub) == PRESETS["qwen3-vl-8b"]


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(model_type="qwen2_5_vl"), "expected 'qwen3_vl'"),
    (lambda c: c.pop("vision_config"), "no vision_config"),
    (lambda c: c["vision_config"].update(num_position_embeddings=40), "not a square grid"),
    (lambda c: c["vision_config"].update(deepstack_visual_indexes=[1, 3]), "must be distinct vision blocks"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[6, 3, 2]), "must sum to head_dim/2"),
    (lambda c: c["vision_config"].update(hidden_act="quick_gelu"), "vision hidden_act 'quick_gelu'"),
])
def test_bad_config_is_a_clear_error(change, message):
    cfg = hf_config_from_args(tiny_args())
    change(cfg)
    with pytest.raises(CheckpointError, match=message) as e:
        Qwen3_VL(args_from_hf_config(cfg))
    assert str(e.value).startswith("config.json")


def test_bf16_keeps_rotary_and_position_grid_weights_in_fp32(pair):
    _, _, ours = pair
    model = Qwen3_VL(ours.args)
    model.load_state_dict(ours.state_dict())
    model = model.to(torch.bfloat16).eval()
    pv, grid = pixels(1, 4, 8, seed=20)
    inputs = model.prepare_vision(pv, grid)
    assert inputs.image[1].grid_weight.dtype == torch.float32 and inputs.image[1].cos.dtype == torch.float32
    ids = torch.tensor([[1] + image_tokens(grid) + [2]])
    logits = model.hf_forward(ids, pixel_values=pv, image_grid_thw=grid)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ours.hf_forward(ids, pixel_values=pv, image_grid_thw=grid)).abs().max() < 0.1


# ----------------------------------------------------------------------------- shape, protocol, counts


def test_the_model_has_every_call_the_engine_makes():
    model = Qwen3_VL(tiny_args())
    assert isinstance(model, VisionLanguageModel)
    assert fsdp_entry_methods(Qwen3_VL) == ["embed_prompts", "encode_prepared", "forward_generated", "logits"]
    assert list(model.decoder_stages()) == ["embedding", "decoder layer 0", "decoder layer 1", "final norm"]
    table = model.text_rotary_table(5, model.device, model.dtype)
    assert table.shape == (5, 2 * 24) and table.dtype == model.dtype
    assert model.kv_heads_per_rank() == 2


def _numel(model, prefix: str = "", contains: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(prefix) and (not contains or any(c in n for c in contains)))


@pytest.mark.parametrize("kw", [{}, {"tie": True}, {"deepstack": ()}, {"layers": 3, "deepstack": (0, 1, 2)}])
def test_count_params_matches_the_module_tree(kw):
    args = tiny_args(**kw)
    model = Qwen3_VL(args)
    counts = count_params(args)
    total = _numel(model)
    assert counts.total == total
    assert counts.vision == _numel(model, "visual.")
    assert counts.root == total - _numel(model, "visual.blocks.") - _numel(model, "language_model.layers.")
    split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    root_split = 0 if args.tie_word_embeddings else _numel(model, "language_model.embed_tokens") + _numel(model,
                                                                                                          "lm_head")
    assert counts.root_tp_split == root_split
    assert counts.tp_split == _numel(model, "language_model.layers.", split) + root_split
    assert counts.layer_tp_split == _numel(model, "language_model.layers.0.", split)
    assert counts.layer_replicated == _numel(model, "language_model.layers.0.") - counts.layer_tp_split
    linear = linear_params(args)
    layer_weights = sum(m.weight.numel() for m in model.language_model.layers.modules()
                        if isinstance(m, torch.nn.Linear))
    assert linear.decoder == layer_weights
    v = model.visual
    per_merged_token = sum(m.weight.numel() for merger in (v.merger, *v.deepstack_merger_list)
                           for m in (merger.linear_fc1, merger.linear_fc2))
    per_patch = v.patch_embed.proj.weight.numel() + sum(m.weight.numel() for m in v.blocks.modules()
                                                        if isinstance(m, torch.nn.Linear))
    assert linear.vision == per_patch + per_merged_token // args.vision.spatial_merge_size**2


# ----------------------------------------------------------------------------- tensor parallelism


def tp_passes(model: Qwen3_VL) -> dict[str, torch.Tensor]:
    """Vision features and DeepStack levels, logits of a shared-prefix batch, then every gradient."""
    p = image_and_video_prompt(seed=21)
    with torch.no_grad():
        vision = model.encode_vision(p.pixel_values, p.image_grid_thw, p.pixel_values_videos, p.video_grid_thw)
    batch = pack_groups(model.args, groups(), share_prefix=True)
    logits = model.logits(model.forward_packed(batch.packed))
    (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(22))).sum().backward()
    grads = {f"grad/{n}": (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).detach()
             for n, q in model.named_parameters()}
    # clone(): a row-parallel output can be an AsyncCollectiveTensor, which torch.save does not take.
    return {"image": vision.image.clone(), "video": vision.video.clone(), "image_deepstack": vision.image_deepstack,
            "video_deepstack": vision.video_deepstack, "logits": logits.detach(), **grads}


def tp_worker(rank: int, world: int, path: str, out: str) -> None:
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from rollplex.models.qwen3_vl import apply_tp

    torch.set_num_threads(1)
    model = load(Path(path))
    apply_tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    for linear in (model.visual.blocks[0].attn.q, model.visual.deepstack_merger_list[1].linear_fc1,
                   model.language_model.layers[0].self_attn.k_proj):
        assert isinstance(linear.weight, DTensor) and linear.weight.to_local().shape[0] == linear.weight.shape[0] // 2
    # Whole on every rank, but its gradient sums every rank's heads (see tp_plan).
    q_norm = model.language_model.layers[0].self_attn.q_norm.weight
    assert isinstance(q_norm, DTensor) and q_norm.placements == (Replicate(),)
    assert model.kv_heads_per_rank() == 1
    result = tp_passes(model)
    if rank == 0:
        torch.save(result, out)


def test_tp2_equals_tp1(pair, tmp_path):
    path, _, ours = pair
    expected = tp_passes(load(path))
    run_distributed(tp_worker, 2, str(path), str(tmp_path / "tp.pt"))
    got = torch.load(tmp_path / "tp.pt")
    assert got.keys() == expected.keys()
    for name in ("image", "video", "image_deepstack", "video_deepstack", "logits"):
        err = (got[name] - expected[name]).abs().max().item()
        assert err <= 1e-5, f"{name}: max abs difference {err:.2e}"
    for name, want in expected.items():
        if name.startswith("grad/"):
            err = ((got[name] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: relative error {err:.2e}"
