"""Video files (.mp4, .mkv, ...) read with PyAV, the optional `video` extra: sampled at
video_fps from the file's own rate, within the frame budget; without PyAV, an error
that names the extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollplex.data.datasets import PromptDataset
from rollplex.data.media import MediaLoadError, sample_video
from rollplex.data.processing import prepare_prompt
from rollplex.data.processor import load_processor

try:
    import av
except ImportError:  # the `video` extra is not installed: only the test of that case runs
    av = None
needs_av = pytest.mark.skipif(av is None, reason="needs PyAV: pip install 'rollplex[video]'")

# Frame i of a test video is flat grey at this level: which frames were kept shows through lossy coding.
GREY_STEP = 25


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int] = (48, 64)) -> Path:
    """A small video file, `frames` flat grey frames (frame i at i * GREY_STEP), written as the container of
    `path`'s suffix holds it (.mp4 stores a frame count, .mkv does not)."""
    h, w = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for i in range(frames):
            image = np.full((h, w, 3), i * GREY_STEP, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())  # flush
    return path


def grey_levels(frames) -> list[int]:
    """Which test-video frame each decoded frame is."""
    return [round(float(np.asarray(f).mean()) / GREY_STEP) for f in frames]


@needs_av
@pytest.mark.parametrize("suffix", [".mp4", ".mkv"])
def test_a_video_file_is_sampled_at_video_fps_from_its_own_rate(tmp_path, suffix):
    path = write_video(tmp_path / f"clip{suffix}", frames=10, fps=10)
    frames, rate = sample_video(path, video_fps=2.0)
    assert grey_levels(frames) == [0, 5] and rate == 2.0  # t = 0 s and 0.5 s of a 1 s clip
    assert frames[0].size == (64, 48) and frames[0].mode == "RGB"
    frames, rate = sample_video(str(path), video_fps=30.0)
    assert grey_levels(frames) == list(range(10)) and rate == 10.0  # never above the file's rate


@needs_av
def test_a_video_file_prompt_equals_its_decoded_frames(processor, tmp_path):
    path = write_video(tmp_path / "clip.mp4", frames=10, fps=10)
    from_file = prepare_prompt(processor, "<video> which way ?", videos=[path], video_fps=2.0)
    frames, _ = sample_video(path, video_fps=2.0)
    from_frames = prepare_prompt(processor, "<video> which way ?", videos=[frames], video_fps=2.0)
    for name in ("input_ids", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        assert torch.equal(getattr(from_file, name), getattr(from_frames, name)), name
    assert from_file.second_per_grid_ts.tolist() == [1.0]  # two frames 0.5 s apart make one temporal patch
    # qwen-vl-utils / verl style content items carry the file too.
    messages = [{"role": "user", "content": [{"type": "video", "video": str(path)}, {"type": "text", "text": "hi"}]}]
    assert torch.equal(prepare_prompt(processor, messages, video_fps=2.0).pixel_values_videos,
                       from_file.pixel_values_videos)


@needs_av
def test_video_max_frames_caps_a_file(tiny_dir, tmp_path):
    path = write_video(tmp_path / "clip.mkv", frames=10, fps=10)
    capped = load_processor(tiny_dir, video_max_frames=3)
    frames, rate = sample_video(path, video_fps=10.0, max_frames=capped.video_processor.max_frames)
    assert grey_levels(frames) == [0, 3, 6] and rate == 3.0
    prompt = prepare_prompt(capped, "<video> which way ?", videos=[path], video_fps=10.0)
    assert prompt.video_grid_thw[0, 0] == 2  # 3 frames, the last repeated: 2 temporal patches


@needs_av
def test_a_file_that_is_not_a_video_is_a_media_error(processor, tmp_path):
    bad = tmp_path / "clip.mp4"
    bad.write_text("not a video")
    with pytest.raises(MediaLoadError, match=r"video 0 \(.*clip.mp4'\): InvalidDataError"):
        prepare_prompt(processor, "<video> which way ?", videos=[bad])
    with pytest.raises(MediaLoadError, match="no such video file or folder"):
        prepare_prompt(processor, "<video> which way ?", videos=[tmp_path / "missing.mp4"])


def test_without_pyav_the_error_names_the_extra(processor, tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"\x00" * 64)  # never read: the import fails first
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now fails as if PyAV were not installed
    with pytest.raises(ImportError, match=r"clip.mp4.*pip install 'rollplex\[video\]' \(or: pip install av\)"):
        prepare_prompt(processor, "<video> which way ?", videos=[path])
    # In a dataset the missing extra stops the run: it is not one bad row to skip.
    data = _write_rows(tmp_path / "train.jsonl", [{"problem": "<video> which way ?", "answer": "left",
                                                   "videos": ["clip.mp4"]}])
    with pytest.raises(ImportError, match="rollplex\\[video\\]"):
        PromptDataset(data, processor=processor, max_prompt_length=4096)[0]


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_av
def test_a_dataset_of_video_files(processor, tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(clips / "a.mp4", frames=8, fps=4)
    write_video(clips / "b.mkv", frames=4, fps=2)
    (clips / "broken.mp4").write_bytes(b"\x00" * 64)
    data = _write_rows(tmp_path / "train.jsonl", [
        {"problem": "<video> which way ?", "answer": "left", "videos": ["clips/a.mp4"]},
        {"problem": "<video> then <video> which way ?", "answer": "up", "videos": ["clips/a.mp4", "clips/b.mkv"]},
        {"problem": "<video> which way ?", "answer": "down", "videos": "clips/broken.mp4"},
    ])
    dataset = PromptDataset(data, processor=processor, max_prompt_length=4096, video_fps=2.0)
    with pytest.warns(UserWarning, match=r"line 3: skipping row 2 \(bad_video\)"):
        examples = list(dataset)
    assert [e.answer for e in examples] == ["left", "up"]
    assert examples[0].prompt.video_grid_thw.tolist() == [[2, 4, 4]]  # 2 s at 2 fps: 4 frames of 56x56
    assert examples[1].prompt.video_grid_thw.tolist() == [[2, 4, 4], [2, 4, 4]]
    assert examples[1].prompt.second_per_grid_ts.tolist() == [1.0, 1.0]
    assert dict(dataset.skipped) == {"bad_video": 1}


@needs_av
def test_a_run_on_video_files_only_keeps_the_budgets(tmp_path):
    from rollplex.config import load_config
    from rollplex.metrics import read_metrics
    from rollplex.rl.loop import RLTrainer

    rows = []
    for i in range(4):
        write_video(tmp_path / f"{i}.mp4", frames=6, fps=4)
        rows.append({"problem": "<video> which way ?", "answer": "left", "videos": f"{i}.mp4"})
    data = _write_rows(tmp_path / "train.jsonl", rows)
    trainer = RLTrainer(load_config([
        "--data.train_files", str(data), "--data.video_max_frames", "2", "--data.video_max_pixels", "1568",
        "--trainer.total_steps", "1", "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "2",
        "--trainer.eval_every", "0", "--trainer.save_every", "0", "--logging.no_console",
        "--trainer.output_dir", str(tmp_path / "run")]))
    # 6 frames at 4 fps sampled at 2 fps would keep 3; the cap keeps 2, each at most 1568 pixels: 28x28.
    assert [e.prompt.video_grid_thw.tolist() for e in next(trainer._batches(0))] == [[[1, 2, 2]]] * 2
    trainer.fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1]
