"""prepare_prompt: images / videos / text -> tensors, as Qwen2.5-VL's processor makes them."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.data.media import MediaLoadError, list_frame_files, sample_frame_indices
from rollplex.data.processing import PlaceholderMismatch, prepare_prompt, text_to_messages
from rollplex.models.inputs import Prompt

transformers = pytest.importorskip("transformers")

PROMPT = "<image>What colour is the dot?"


def _rand_image(seed: int, h: int = 60, w: int = 70) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _frames(n: int, h: int = 56, w: int = 84) -> list[np.ndarray]:
    return [_rand_image(100 + i, h, w) for i in range(n)]


def _same(a: Prompt, b: Prompt) -> bool:
    fields = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
              "second_per_grid_ts")  # fmt: skip
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return a.text == b.text


def _pad_count(processor, r: Prompt, token: str) -> int:
    return int((r.input_ids == processor.tokenizer.convert_tokens_to_ids(token)).sum())


def test_image_input_types_identical(processor, tmp_path):
    arr = _rand_image(0)
    path = tmp_path / "img.png"
    Image.fromarray(arr).save(path)
    inputs = [
        Image.fromarray(arr),
        arr,
        str(path),
        path,
        _png_bytes(arr),
        {"bytes": _png_bytes(arr), "path": "img.png"},
        arr.astype(np.float32) / 255.0,
        torch.from_numpy(arr).permute(2, 0, 1).contiguous(),  # CHW tensor
    ]
    results = [prepare_prompt(processor, PROMPT, images=[x]) for x in inputs]
    for r in results[1:]:
        assert _same(results[0], r)
    r = results[0]
    assert r.input_ids.dtype == torch.long and r.input_ids.ndim == 1
    assert r.pixel_values_videos is None and r.video_grid_thw is None and r.second_per_grid_ts is None


def test_matches_transformers_processor_call(processor):
    """Same input_ids and pixels as Qwen2_5_VLProcessor.__call__ (which expands pads itself)."""
    images = [_rand_image(1, 60, 70), _rand_image(2, 120, 90)]
    r = prepare_prompt(processor, "<image>left or <image>right?", images=images)
    ref = processor(text=[r.text], images=[Image.fromarray(x) for x in images], return_tensors="pt")
    assert torch.equal(ref["input_ids"][0], r.input_ids)
    assert torch.equal(ref["pixel_values"], r.pixel_values)
    assert torch.equal(ref["image_grid_thw"], r.image_grid_thw)
    # Transparency goes on white exactly as transformers' convert_to_rgb does it.
    rgba = np.concatenate([_rand_image(3), np.random.default_rng(4).integers(0, 256, (60, 70, 1), np.uint8)], -1)
    r = prepare_prompt(processor, PROMPT, images=[rgba])
    ref = processor(text=[r.text], images=[Image.fromarray(rgba, "RGBA")], return_tensors="pt")
    assert torch.equal(ref["pixel_values"], r.pixel_values)


def test_corrupt_image_raises_naming_it(processor, tmp_path):
    good = _png_bytes(_rand_image(0))
    bad_file = tmp_path / "broken_cat.png"
    bad_file.write_bytes(good[: len(good) // 2])  # truncated PNG
    with pytest.raises(ValueError, match="broken_cat.png") as e:
        prepare_prompt(processor, PROMPT, images=[str(bad_file)])
    assert isinstance(e.value, MediaLoadError)
    with pytest.raises(ValueError, match="image 1"):
        prepare_prompt(processor, "<image><image>?", images=[good, b"not an image at all"])
    with pytest.raises(ValueError, match="no_such.png"):
        prepare_prompt(processor, PROMPT, images=[tmp_path / "no_such.png"])


def test_placeholder_mismatch_raises(processor):
    img = _rand_image(0)
    # A dataset tells the user which column to fix from `kind`.
    for prompt, media, error in [(PROMPT, dict(images=[img, img]), "1 image placeholder.*2 image"),
                                 ("<image><image>?", dict(images=[img]), "2 image placeholder.*1 image"),
                                 (PROMPT, {}, "image"),  # no images at all
                                 ("<video>?", dict(videos=[]), "video"),
                                 ("what?", dict(videos=[_frames(2)]), "0 video placeholder")]:
        with pytest.raises(PlaceholderMismatch, match=error) as e:
            prepare_prompt(processor, prompt, **media)
        assert e.value.kind == ("video" if "video" in error else "image")


def test_text_to_messages():
    msgs = text_to_messages("<image>a <video>b<image>")
    assert msgs == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "a "},
                {"type": "video"},
                {"type": "text", "text": "b"},
                {"type": "image"},
            ],
        }
    ]
    assert text_to_messages("hi", system_prompt="be brief")[0] == {"role": "system", "content": "be brief"}


def test_messages_with_embedded_media_equal_string_prompt(processor):
    img, frames = _rand_image(3), _frames(4)
    a = prepare_prompt(processor, "<image><video>which direction?", images=[img], videos=[frames])
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": img},
                {"type": "video", "video": frames},
                {"type": "text", "text": "which direction?"},
            ],
        }
    ]
    assert _same(a, prepare_prompt(processor, msgs))
    # Placeholders inside a string content (EasyR1 datasets) work too.
    string_msgs = [{"role": "user", "content": "<image><video>which direction?"}]
    assert _same(a, prepare_prompt(processor, string_msgs, images=[img], videos=[frames]))
    no_gen = prepare_prompt(processor, msgs, add_generation_prompt=False)
    assert not no_gen.text.endswith("<|im_start|>assistant\n") and len(no_gen.input_ids) < len(a.input_ids)


def test_pad_counts_equal_grid_over_merge(processor):
    images = [_rand_image(5, 56, 56), _rand_image(6, 100, 150)]
    videos = [_frames(4), _frames(3, 84, 56)]
    r = prepare_prompt(processor, "<image><video><image><video>?", images=images, videos=videos)
    merge2 = processor.image_processor.merge_size ** 2
    assert _pad_count(processor, r, "<|image_pad|>") == int(r.image_grid_thw.prod(-1).sum()) // merge2
    assert _pad_count(processor, r, "<|video_pad|>") == int(r.video_grid_thw.prod(-1).sum()) // merge2
    assert r.pixel_values.shape[0] == int(r.image_grid_thw.prod(-1).sum())
    assert r.pixel_values_videos.shape == (int(r.video_grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert r.image_grid_thw.tolist()[0] == [1, 4, 4]
    assert r.video_grid_thw.tolist() == [[2, 4, 6], [2, 6, 4]]
    # Pads are expanded in place, in order: first image block, then first video block...
    ids = r.input_ids.tolist()
    img_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    first_run = ids[ids.index(img_id):]
    assert first_run[: 4] == [img_id] * 4 and first_run[4] != img_id


def test_video_frame_list_equals_folder(processor, tmp_path):
    frames = _frames(10)
    folder = tmp_path / "frames"
    folder.mkdir()
    # Unpadded numbers: frame_10 must come after frame_9 (numeric sort).
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"frame_{i + 1}.png")
    (folder / "notes.txt").write_text("not a frame")
    assert [p.name for p in list_frame_files(folder)][-2:] == ["frame_9.png", "frame_10.png"]
    prompt = "<video>which direction does the dot move?"
    from_list = prepare_prompt(processor, prompt, videos=[frames])
    from_pil = prepare_prompt(processor, prompt, videos=[[Image.fromarray(f) for f in frames]])
    from_folder = prepare_prompt(processor, prompt, videos=[str(folder)])
    from_array = prepare_prompt(processor, prompt, videos=[np.stack(frames)])
    from_dict = prepare_prompt(processor, prompt, videos=[{"frames": folder, "fps": 2.0}])
    for other in (from_pil, from_folder, from_array, from_dict):
        assert _same(from_list, other)
    assert from_list.video_grid_thw.tolist() == [[5, 4, 6]]


def test_fps_sampling_picks_right_frames(processor):
    assert sample_frame_indices(8, native_fps=4, video_fps=2) == [0, 2, 4, 6]
    assert sample_frame_indices(9, native_fps=4, video_fps=2) == [0, 2, 4, 6, 8]
    assert sample_frame_indices(60, native_fps=30, video_fps=2) == [0, 15, 30, 45]
    assert sample_frame_indices(10, native_fps=3, video_fps=2) == [0, 1, 3, 4, 6, 7, 9]
    assert sample_frame_indices(5, native_fps=2, video_fps=2) == [0, 1, 2, 3, 4]
    assert sample_frame_indices(5, native_fps=1, video_fps=2) == [0, 1, 2, 3, 4]  # never upsample

    frames = _frames(8)
    sampled = prepare_prompt(processor, "<video>?", videos=[frames], native_fps=4.0, video_fps=2.0)
    picked = prepare_prompt(processor, "<video>?", videos=[[frames[i] for i in (0, 2, 4, 6)]], video_fps=2.0)
    assert _same(sampled, picked)
    via_dict = prepare_prompt(processor, "<video>?", videos=[{"frames": frames, "fps": 4.0}], video_fps=2.0)
    assert _same(sampled, via_dict)


def test_second_per_grid_ts(processor):
    frames = _frames(4)
    r = prepare_prompt(processor, "<video><video>?", videos=[frames, frames], video_fps=2.0)
    assert r.second_per_grid_ts.dtype == torch.float32
    assert r.second_per_grid_ts.tolist() == [1.0, 1.0]  # temporal_patch_size 2 / 2 fps
    r = prepare_prompt(processor, "<video>?", videos=[frames], video_fps=1.0)
    assert r.second_per_grid_ts.tolist() == [2.0]
    r = prepare_prompt(processor, "<video>?", videos=[frames], video_fps=4.0, native_fps=8.0)
    assert r.second_per_grid_ts.tolist() == [0.5]
    # Frames at 1 fps cannot be sampled at 2 fps: all kept, 2 frames per temporal patch = 2 s.
    r = prepare_prompt(processor, "<video>?", videos=[frames], video_fps=2.0, native_fps=1.0)
    assert r.second_per_grid_ts.tolist() == [2.0] and r.video_grid_thw[0, 0] == 2


def test_odd_frame_count_repeats_last_frame(processor):
    frames = _frames(3)
    odd = prepare_prompt(processor, "<video>?", videos=[frames])
    padded = prepare_prompt(processor, "<video>?", videos=[frames + [frames[-1]]])
    assert _same(odd, padded)
    assert odd.video_grid_thw.tolist() == [[2, 4, 6]]


def test_video_of_repeated_image_equals_image(processor):
    """A Qwen2-VL image is exactly a video of temporal_patch_size identical frames."""
    img = _rand_image(7, 70, 98)
    as_image = prepare_prompt(processor, "<image>?", images=[img])
    as_video = prepare_prompt(processor, "<video>?", videos=[[img, img]])
    assert torch.equal(as_image.pixel_values, as_video.pixel_values_videos)
    assert torch.equal(as_image.image_grid_thw, as_video.video_grid_thw)


def _transformers_video_patchify():
    """transformers' own Qwen2VLVideoProcessor.patchify, taken from its source file.

    The module imports torchvision at the top, so it is parsed, not imported."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil_mod

    src_path = Path(inspect.getfile(pil_mod)).with_name("video_processing_qwen2_vl.py")
    tree = ast.parse(src_path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLVideoProcessor":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "patchify":
                    fn.returns = None
                    for a in fn.args.args:
                        a.annotation = None
                    namespace = {"torch": torch}
                    exec(textwrap.dedent(ast.unparse(fn)), namespace)
                    return namespace["patchify"]
    pytest.skip("transformers' Qwen2VLVideoProcessor.patchify not found")


def test_video_layout_matches_transformers_patchify(processor):
    frames = _frames(5, 84, 112)
    r = prepare_prompt(processor, "<video>?", videos=[frames])
    # Normalised frames through the same PIL pipeline, then transformers' patchify.
    ip = processor.video_processor.frame_processor
    normed = []
    for f in frames:
        x = ip.process_image(Image.fromarray(f), do_convert_rgb=True)
        x = ip.resize(x, size=ip.size, resample=ip.resample, factor=28)
        x = ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std)
        normed.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    video = torch.stack(normed)[None]  # (1, T, C, H, W)
    patchify = _transformers_video_patchify()
    ref, gt, gh, gw = patchify(None, video, patch_size=14, merge_size=2, temporal_patch_size=2)
    assert [gt, gh, gw] == r.video_grid_thw[0].tolist() == [3, 6, 8]
    assert torch.allclose(ref[0], r.pixel_values_videos, atol=1e-6)


def test_processor_call_with_videos_matches(processor):
    """The torchvision-free video processor also serves Qwen2_5_VLProcessor.__call__."""
    frames = _frames(6)
    r = prepare_prompt(processor, "<video>which direction?", videos=[frames])
    ref = processor(text=[r.text], videos=[[Image.fromarray(f) for f in frames]], return_tensors="pt")
    assert torch.equal(ref["input_ids"][0], r.input_ids)
    assert torch.equal(ref["pixel_values_videos"], r.pixel_values_videos)
    assert torch.equal(ref["video_grid_thw"], r.video_grid_thw)
    assert torch.allclose(torch.as_tensor(ref["second_per_grid_ts"], dtype=torch.float32), r.second_per_grid_ts)


def test_transformers_model_accepts_video(processor, tiny_dir):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    r = prepare_prompt(
        processor, "<image><video>which direction does the dot move?", images=[_rand_image(9)], videos=[_frames(5)]
    )
    with torch.no_grad():
        out = model(
            input_ids=r.input_ids[None],
            pixel_values=r.pixel_values,
            image_grid_thw=r.image_grid_thw,
            pixel_values_videos=r.pixel_values_videos,
            video_grid_thw=r.video_grid_thw,
            second_per_grid_ts=r.second_per_grid_ts,
        )
    assert out.logits.shape[:2] == (1, len(r.input_ids))
    assert torch.isfinite(out.logits).all()


def test_bad_videos(processor, tmp_path):
    with pytest.raises(ValueError, match="same size"):
        prepare_prompt(processor, "<video>?", videos=[[_rand_image(0, 56, 56), _rand_image(1, 84, 56)]])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no frame images"):
        prepare_prompt(processor, "<video>?", videos=[empty])
    frames_dir = tmp_path / "clip"
    frames_dir.mkdir()
    Image.fromarray(_rand_image(0)).save(frames_dir / "0.png")
    (frames_dir / "1.png").write_bytes(b"garbage")
    with pytest.raises(MediaLoadError, match="video 0 frame 1.*1.png"):
        prepare_prompt(processor, "<video>?", videos=[frames_dir])
