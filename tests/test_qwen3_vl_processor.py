"""The Qwen3-VL processor (rollplex.models.qwen3_vl.processor) against transformers', offline and without
torchvision.

What is compared with what:
- images: prepare_prompt against transformers' Qwen3VLProcessor called on the same images (ids, pixels,
  grids); its image path is the PIL image processor, which runs without torchvision.
- videos: transformers' Qwen3VLVideoProcessor needs torchvision only to convert, resize, rescale and
  normalise, so its processor is called with those steps off (`do_resize=False`, ...) on every native frame,
  resized by PIL to the size `frame_size` gives and normalised by the PIL image processor (our pixel
  pipeline, the same for images and videos). Everything else is transformers': frame sampling
  (`sample_frames`, from the native rate in the metadata), patch order (`patchify`), timestamps
  (`_calculate_timestamps`), the text written for every frame group (`replace_video_token`) and tokenizing.
  `frame_size` itself is compared with transformers' `get_num_of_video_patches` (its smart_resize and
  per-frame cap), and sampling with `sample_frames` over many clips.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.data.processing import PlaceholderMismatch, prepare_prompt
from rollplex.data.processor import load_processor, torch_free
from rollplex.models.protocol import CheckpointError
from rollplex.models.qwen3_vl.processor import (TorchFreeQwen3VLProcessor, TorchFreeQwen3VLVideoProcessor,
                                                tiny_processor_files)
from rollplex.tiny import TinySpec, write_tokenizer_and_processor

transformers = pytest.importorskip("transformers")
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # noqa: E402
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # noqa: E402
from transformers.video_utils import VideoMetadata  # noqa: E402

# One vision token per merged 32 x 32 patch (patch 16, merge 2).
TOKEN_PIXELS = 32 * 32
# A tiny Qwen3-VL (patch 16), with words for the timestamps' text.
SPEC = TinySpec.of("qwen3_vl", extra_words=("seconds", "<", ">"))
PROMPT = "<video> which direction ?"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3-VL folder's tokenizer, template and processor files (`tiny_processor_files`), and a
    config.json naming the family."""
    folder = tmp_path_factory.mktemp("tiny_qwen3_vl")
    write_tokenizer_and_processor(folder, SPEC)
    assert json.loads((folder / "video_preprocessor_config.json").read_text()) == json.loads(
        json.dumps(tiny_processor_files(SPEC)["video_preprocessor_config.json"]))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    return folder


@pytest.fixture(scope="module")
def ours(qwen3_dir):
    return load_processor(qwen3_dir)


class _Unchecked(Qwen3VLProcessor):
    """transformers' own processor around transformers' own video processor, which ProcessorMixin's class check
    refuses without torchvision."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return type(argument)


@pytest.fixture(scope="module")
def theirs(qwen3_dir, ours):
    return _Unchecked(image_processor=AutoImageProcessor.from_pretrained(qwen3_dir, backend="pil"),
                      tokenizer=ours.tokenizer, video_processor=Qwen3VLVideoProcessor.from_pretrained(qwen3_dir),
                      chat_template=ours.chat_template)


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _frames(n: int, h: int = 112, w: int = 168) -> list[np.ndarray]:
    return [_image(h, w, seed=10 + i) for i in range(n)]


def _their_video_call(ours, theirs, text: str, frames: list[np.ndarray], native_fps: float, fps: float):
    """transformers' processor on every native frame, resized and normalised our way (see the module docstring)."""
    indices = theirs.video_processor.sample_frames(VideoMetadata(total_num_frames=len(frames), fps=native_fps),
                                                   fps=fps)
    h, w = frames[0].shape[:2]
    new_h, new_w = ours.video_processor.frame_size(len(indices), h, w)
    ip = theirs.image_processor
    normed = []
    for frame in frames:
        x = ip.process_image(Image.fromarray(frame).resize((new_w, new_h), resample=ip.resample), do_convert_rgb=True)
        normed.append(np.asarray(ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std),
                                 dtype=np.float32))
    return theirs(text=[text], videos=[np.stack(normed)],
                  video_metadata=[VideoMetadata(total_num_frames=len(frames), fps=native_fps)], fps=fps,
                  do_resize=False, do_convert_rgb=False, do_rescale=False, do_normalize=False, return_metadata=True,
                  return_tensors="pt")


def test_load_processor_picks_the_family(ours, qwen3_dir):
    assert isinstance(ours, TorchFreeQwen3VLProcessor) and isinstance(ours, Qwen3VLProcessor)
    assert type(ours.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert ours.image_processor.patch_size == ours.video_processor.patch_size == 16
    assert list(ours.image_processor.image_mean) == ours.video_processor.image_mean == [0.5, 0.5, 0.5]
    vp = ours.video_processor
    assert (vp.fps, vp.min_frames, vp.max_frames, vp.max_frame_pixels) == (2.0, 4, 768, None)
    # The tiny folder's video budget is per frame, spelled as Qwen3-VL spells it.
    assert vp.cap_pixels_per_frame and vp.max_video_tokens == SPEC.video_max_pixels // TOKEN_PIXELS


def test_image_matches_transformers(ours, theirs):
    images = [_image(60, 70, 1), _image(120, 90, 2)]
    r = prepare_prompt(ours, "<image> left or <image> right ?", images=images)
    ref = theirs(text=[r.text], images=[Image.fromarray(x) for x in images], return_tensors="pt")
    assert torch.equal(ref["input_ids"][0], r.input_ids)
    assert torch.equal(ref["pixel_values"], r.pixel_values)
    assert torch.equal(ref["image_grid_thw"], r.image_grid_thw)
    assert r.pixel_values.shape[1] == 3 * 2 * 16 * 16


@pytest.mark.parametrize("count, native_fps, fps", [(10, 10.0, 2.0), (9, 4.0, 2.0), (7, 2.0, 2.0), (30, 30.0, 4.0)])
def test_video_matches_transformers(ours, theirs, count, native_fps, fps):
    frames = _frames(count)
    r = prepare_prompt(ours, PROMPT, videos=[frames], native_fps=native_fps, video_fps=fps)
    ref = _their_video_call(ours, theirs, r.text, frames, native_fps, fps)
    assert torch.equal(ref["input_ids"][0], r.input_ids)
    assert torch.equal(ref["video_grid_thw"], r.video_grid_thw)
    assert torch.allclose(ref["pixel_values_videos"], r.pixel_values_videos, atol=1e-6)
    assert r.second_per_grid_ts is None  # Qwen3-VL's positions do not read it: its timestamps are text
    assert ours.tokenizer.unk_token_id not in r.input_ids.tolist()


def test_each_frame_group_has_its_timestamp_and_vision_block(ours):
    frames = _frames(10)
    r = prepare_prompt(ours, PROMPT, videos=[frames], native_fps=10.0, video_fps=2.0)
    # 10 frames at 10 fps at 2 fps: 2 frames, raised to min_frames 4: frames 0, 3, 6, 9 -> groups (0, 3), (6, 9).
    times = ours._calculate_timestamps([0, 3, 6, 9], 10.0, 2)
    assert times == [0.15, 0.75]
    t, h, w = r.video_grid_thw[0].tolist()
    pads = "<|video_pad|>" * (h * w // 4)
    groups = "".join(f"<{time:.1f} seconds><|vision_start|>{pads}<|vision_end|>" for time in times)
    # transformers 5 replaces the template's <|video_pad|> alone: its <|vision_start|> / <|vision_end|> stay.
    expanded = r.text.replace("<|vision_start|><|video_pad|><|vision_end|>",
                              f"<|vision_start|>{groups}<|vision_end|>")
    assert t == 2 and "<0.1 seconds>" in groups and "<0.8 seconds>" in groups
    assert ours.tokenizer(expanded, add_special_tokens=False)["input_ids"] == r.input_ids.tolist()


@pytest.mark.parametrize("total, native_fps, fps, max_frames", [
    (10, 10.0, 2.0, 768), (3, 10.0, 2.0, 768), (100, 30.0, 2.0, 768), (100, 30.0, 2.0, 5), (61, 24.0, 1.0, 768),
    (7, 2.0, 2.0, 768), (240, 30.0, 8.0, 16), (5, 1.0, 4.0, 768),
])
def test_sampling_matches_transformers(total, native_fps, fps, max_frames):
    ours_vp = TorchFreeQwen3VLVideoProcessor(max_frames=max_frames)
    frames, metadata = ours_vp.sample([_image(8, 8, i) for i in range(total)], fps, native_fps, "video 0")
    expected = Qwen3VLVideoProcessor(max_frames=max_frames).sample_frames(
        VideoMetadata(total_num_frames=total, fps=native_fps), fps=fps)
    assert metadata.frames_indices.tolist() == expected.tolist()
    assert len(frames) == len(expected) and (metadata.total_num_frames, metadata.fps) == (total, native_fps)


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("num_frames", [2, 4, 8, 16])
@pytest.mark.parametrize("height, width", [(56, 84), (300, 400), (20, 500), (1080, 1920)])
def test_frame_size_matches_transformers(cap, num_frames, height, width):
    numbers = dict(size={"shortest_edge": 16 * TOKEN_PIXELS, "longest_edge": 256 * TOKEN_PIXELS},
                   cap_pixels_per_frame=cap, max_video_tokens=24)
    h, w = TorchFreeQwen3VLVideoProcessor(**numbers).frame_size(num_frames, height, width)
    assert h % 32 == 0 and w % 32 == 0
    theirs = Qwen3VLVideoProcessor(**numbers)
    assert num_frames // 2 * (h // 16) * (w // 16) == theirs.get_num_of_video_patches(num_frames, height, width)


def test_size_is_a_budget_for_the_whole_clip():
    vp = TorchFreeQwen3VLVideoProcessor(size={"shortest_edge": 4 * TOKEN_PIXELS, "longest_edge": 96 * TOKEN_PIXELS})
    short, long = vp.frame_size(2, 300, 400), vp.frame_size(16, 300, 400)
    assert 2 * short[0] * short[1] <= 96 * TOKEN_PIXELS and 16 * long[0] * long[1] <= 96 * TOKEN_PIXELS
    assert long[0] * long[1] < short[0] * short[1]  # more frames, smaller frames


def test_image_budget(qwen3_dir, ours):
    assert ours.image_processor.size["longest_edge"] == SPEC.max_pixels
    for max_pixels in (4 * TOKEN_PIXELS, 40 * TOKEN_PIXELS):
        processor = load_processor(qwen3_dir, max_pixels=max_pixels)
        r = prepare_prompt(processor, "<image> what ?", images=[_image(300, 400)])
        assert int(r.image_grid_thw.prod()) * 16 * 16 <= max_pixels
    with pytest.raises(ValueError, match="image min_pixels"):
        load_processor(qwen3_dir, min_pixels=100 * TOKEN_PIXELS)


@pytest.mark.parametrize("video_max_pixels", [1 * TOKEN_PIXELS, 2 * TOKEN_PIXELS, 6 * TOKEN_PIXELS])
def test_video_max_pixels_caps_each_frame(qwen3_dir, video_max_pixels):
    processor = load_processor(qwen3_dir, video_max_pixels=video_max_pixels)
    # (A frame far wider than high keeps one merged patch of height, whatever the budget, as an image does.)
    for frames in (_frames(4), _frames(9, 300, 400), _frames(2, 24, 40)):  # the last enlarged to the clip's floor
        r = prepare_prompt(processor, PROMPT, videos=[frames])
        _, h, w = r.video_grid_thw[0].tolist()
        assert h * w * 16 * 16 <= video_max_pixels


def test_video_max_frames_caps_the_frames(qwen3_dir, ours):
    frames = _frames(20, 56, 84)
    capped = prepare_prompt(load_processor(qwen3_dir, video_max_frames=4), PROMPT, videos=[frames],
                            native_fps=10.0, video_fps=10.0)
    # Frames 0, 6, 13, 19: evenly over the whole clip, in two temporal patches.
    kept = prepare_prompt(ours, PROMPT, videos=[[frames[i] for i in (0, 6, 13, 19)]], native_fps=10.0,
                          video_fps=10.0)
    assert capped.video_grid_thw[0, 0] == 2
    assert torch.equal(capped.pixel_values_videos, kept.pixel_values_videos)
    assert ours.video_processor.max_frames == 768


def test_processor_call_equals_prepare_prompt(ours):
    frames = _frames(6)
    r = prepare_prompt(ours, PROMPT, videos=[frames], native_fps=4.0, video_fps=2.0)
    out = ours(text=[r.text], videos=[[Image.fromarray(f) for f in frames]], video_metadata=[{"fps": 4.0}],
               fps=2.0, return_tensors="pt")
    assert torch.equal(out["input_ids"][0], r.input_ids)
    assert torch.equal(out["pixel_values_videos"], r.pixel_values_videos)


def test_a_transformers_processor_is_made_torch_free(ours, theirs):
    vp = torch_free(theirs.video_processor)
    assert isinstance(vp, TorchFreeQwen3VLVideoProcessor) and torch_free(vp) is vp
    assert vp.size == ours.video_processor.size and vp.max_video_tokens == ours.video_processor.max_video_tokens
    # transformers' own processor serves prepare_prompt as ours does.
    frames = _frames(5)
    a = prepare_prompt(theirs, PROMPT, videos=[frames], native_fps=5.0)
    b = prepare_prompt(ours, PROMPT, videos=[frames], native_fps=5.0)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.pixel_values_videos, b.pixel_values_videos)
    unknown = types.new_class("SomeVideoProcessor")
    unknown.__module__ = "transformers.models.some.video_processing_some"
    with pytest.raises(TypeError, match="SomeVideoProcessor"):
        torch_free(unknown())


def test_bad_inputs_are_clear_errors(ours, qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match="video 0: a Qwen3-VL video needs at least 2 frames"):
        prepare_prompt(ours, PROMPT, videos=[_frames(1)])
    with pytest.raises(ValueError, match="same size"):
        prepare_prompt(ours, PROMPT, videos=[[_image(56, 56), _image(84, 56)]])
    with pytest.raises(PlaceholderMismatch, match="1 video placeholder.*2 video"):
        prepare_prompt(ours, PROMPT, videos=[_frames(4), _frames(4)])
    other = tmp_path / "other"
    other.mkdir()
    for f in ("tokenizer.json", "preprocessor_config.json"):
        (other / f).write_text((qwen3_dir / f).read_text())
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama'.*qwen2_5_vl"):
        load_processor(other)
