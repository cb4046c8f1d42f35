"""Pixel and frame budgets (data.min_pixels, max_pixels, video_max_pixels, video_max_frames):
set on the processors by load_processor, they bound every prompt's vision tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollplex.config import ConfigError, DataConfig
from rollplex.data.media import sampling_rate
from rollplex.data.processing import prepare_prompt
from rollplex.data.processor import load_processor
from rollplex.rl.setup import load_run_processor

# One vision token per merged 28 x 28 patch (patch 14, merge 2).
TOKEN_PIXELS = 28 * 28
# The tiny folder's preprocessor_config.json, as a Qwen2.5-VL folder spells it: min_pixels / max_pixels and size.
FOLDER_MIN, FOLDER_MAX = 3136, 12544


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _frames(n: int, h: int = 112, w: int = 168) -> np.ndarray:
    return np.stack([_image(h, w, seed=10 + i) for i in range(n)])


def _image_tokens(processor, image: np.ndarray) -> int:
    prompt = prepare_prompt(processor, "<image> what colour ?", images=[image])
    pads = int((prompt.input_ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert pads == int(prompt.image_grid_thw.prod()) // 4  # the tokens the model reads are the grid's
    return pads


def test_the_folder_values_are_the_default(tiny_dir, processor):
    assert processor.image_processor.size["shortest_edge"] == FOLDER_MIN
    assert processor.image_processor.size["longest_edge"] == FOLDER_MAX
    assert processor.video_processor.size == {"shortest_edge": FOLDER_MIN, "longest_edge": FOLDER_MAX}
    assert processor.video_processor.max_frames is None  # the folder sets no cap
    # data.* at 0 means the same: the run loads the folder's processor unchanged.
    run_processor = load_run_processor(tiny_dir, DataConfig())
    assert run_processor.image_processor.size == processor.image_processor.size


@pytest.mark.parametrize(
    "min_pixels, max_pixels, tokens",
    [
        (None, None, 12),  # the folder's 12544 pixels: 300x400 -> 84x112 -> 3x4 tokens
        (None, 4 * TOKEN_PIXELS, 2),  # capped: 28x56
        (None, 64 * TOKEN_PIXELS, 54),  # a larger cap than the folder's gives more tokens: 168x252
        (400 * TOKEN_PIXELS, 1000 * TOKEN_PIXELS, 432),  # a floor above the image's size enlarges it: 504x672
    ],
)
def test_image_budget_sets_the_vision_tokens(tiny_dir, min_pixels, max_pixels, tokens):
    processor = load_processor(tiny_dir, min_pixels=min_pixels, max_pixels=max_pixels)
    assert _image_tokens(processor, _image(300, 400)) == tokens
    assert tokens <= (max_pixels or FOLDER_MAX) / TOKEN_PIXELS


def test_min_pixels_enlarges_a_small_image(tiny_dir, processor):
    assert _image_tokens(processor, _image(20, 20)) == 4  # the folder's floor: 56x56
    assert _image_tokens(load_processor(tiny_dir, min_pixels=9 * TOKEN_PIXELS), _image(20, 20)) == 9


def test_transformers_processor_call_keeps_the_budget(tiny_dir):
    # The budget lives in the image processor, so transformers' own processor call sees it too.
    processor = load_processor(tiny_dir, max_pixels=64 * TOKEN_PIXELS)
    ours = prepare_prompt(processor, "<image> what colour ?", images=[_image(300, 400)])
    theirs = processor(text=[ours.text], images=[_image(300, 400)], return_tensors="pt")
    assert torch.equal(theirs["image_grid_thw"], ours.image_grid_thw)
    assert torch.equal(theirs["input_ids"][0], ours.input_ids)


def test_video_max_pixels_caps_each_frame_and_leaves_images(tiny_dir, processor):
    capping = load_processor(tiny_dir, video_max_pixels=4 * TOKEN_PIXELS)
    capped = prepare_prompt(capping, "<image><video> which way ?", images=[_image(300, 400)], videos=[_frames(4)])
    full = prepare_prompt(processor, "<image><video> which way ?", images=[_image(300, 400)],
                          videos=[_frames(4)])
    assert full.video_grid_thw.tolist() == [[2, 6, 8]]  # 112x168 fits the folder's 12544 pixels
    assert capped.video_grid_thw.tolist() == [[2, 2, 4]]  # 28x56 a frame
    assert torch.equal(capped.image_grid_thw, full.image_grid_thw)


def test_a_cap_below_the_folder_floor_lowers_the_floor(tiny_dir):
    processor = load_processor(tiny_dir, max_pixels=2 * TOKEN_PIXELS, video_max_pixels=2 * TOKEN_PIXELS)
    assert processor.image_processor.size["shortest_edge"] == 2 * TOKEN_PIXELS
    assert processor.video_processor.size == {"shortest_edge": 2 * TOKEN_PIXELS, "longest_edge": 2 * TOKEN_PIXELS}
    with pytest.raises(ValueError, match="image min_pixels 78400 is above max_pixels 12544"):
        load_processor(tiny_dir, min_pixels=100 * TOKEN_PIXELS)  # a floor the user set does not give way


def test_video_max_frames_keeps_frames_evenly_over_the_clip(tiny_dir):
    frames = _frames(10)
    processor = load_processor(tiny_dir, video_max_frames=4)
    capped = prepare_prompt(processor, "<video> which way ?", videos=[frames], video_fps=10.0, native_fps=10.0)
    # 4 frames of the 10, 2.5 frames apart: a 4 fps clip, two temporal patches of 0.5 s.
    kept = prepare_prompt(processor, "<video> which way ?", videos=[frames[[0, 2, 5, 7]]], video_fps=4.0)
    assert capped.video_grid_thw.tolist() == [[2, 6, 8]]
    assert capped.second_per_grid_ts.tolist() == [0.5]
    assert torch.equal(capped.pixel_values_videos, kept.pixel_values_videos)
    assert torch.equal(capped.input_ids, kept.input_ids)
    # Under the cap, video_fps alone decides.
    uncapped = prepare_prompt(processor, "<video> which way ?", videos=[frames], video_fps=2.0, native_fps=10.0)
    assert uncapped.video_grid_thw.tolist() == [[1, 6, 8]] and uncapped.second_per_grid_ts.tolist() == [1.0]


def test_sampling_rate():
    assert sampling_rate(10, native_fps=10, video_fps=2) == 2.0
    assert sampling_rate(10, native_fps=1, video_fps=2) == 1.0  # never above the video's own rate
    assert sampling_rate(10, native_fps=10, video_fps=10, max_frames=4) == 4.0
    assert sampling_rate(10, native_fps=10, video_fps=2, max_frames=4) == 2.0  # 2 frames: under the cap
    assert sampling_rate(100, native_fps=30, video_fps=30, max_frames=1) == 0.3  # one frame for the whole clip


def test_run_processor_takes_the_data_section(tiny_dir):
    d = DataConfig(min_pixels=2 * TOKEN_PIXELS, max_pixels=64 * TOKEN_PIXELS, video_max_pixels=8 * TOKEN_PIXELS,
                   video_max_frames=6)
    processor = load_run_processor(tiny_dir, d)
    assert processor.image_processor.size["shortest_edge"] == 2 * TOKEN_PIXELS
    assert processor.image_processor.size["longest_edge"] == 64 * TOKEN_PIXELS
    assert processor.video_processor.size == {"shortest_edge": FOLDER_MIN, "longest_edge": 8 * TOKEN_PIXELS}
    assert processor.video_processor.max_frames == 6


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_pixels": -1}, "data.max_pixels must be >= 0"),
        ({"video_max_frames": -2}, "data.video_max_frames must be >= 0"),
        ({"min_pixels": 5000, "max_pixels": 4000}, "data.min_pixels must be <= data.max_pixels 4000"),
    ],
)
def test_config_checks_the_budgets(fields, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**fields)


def test_help_lists_the_budgets(capsys, monkeypatch):
    from rollplex.config import load_config

    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        load_config(["--help"])
    out = capsys.readouterr().out
    for option in ("--data.min_pixels", "--data.max_pixels", "--data.video_max_pixels", "--data.video_max_frames"):
        assert option in out, option
    # And the command line sets them.
    assert load_config(["--data.max_pixels", "50176", "--data.video_max_frames", "8"]).data.max_pixels == 50176


def test_a_transformers_video_processor_keeps_its_frame_cap_when_made_torch_free(processor):
    """A processor loaded elsewhere (AutoProcessor, with torchvision) is redone the torchvision-free way with its
    own numbers, its frame cap among them."""
    from types import SimpleNamespace

    from rollplex.data.processor import torch_free

    vp = processor.video_processor
    theirs = SimpleNamespace(patch_size=vp.patch_size, temporal_patch_size=vp.temporal_patch_size,
                             merge_size=vp.merge_size, size=dict(vp.size), image_mean=vp.image_mean,
                             image_std=vp.image_std, rescale_factor=vp.rescale_factor, max_frames=6)
    assert torch_free(theirs).max_frames == 6 and torch_free(theirs).size == vp.size
