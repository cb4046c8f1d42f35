"""The Qwen3-VL processor, without torchvision, with pixel and frame budgets.

transformers' Qwen3-VL processor is Qwen2-VL's image processor (patch 16, mean and
std 0.5) beside a Qwen3VLVideoProcessor that, like every BaseVideoProcessor, needs
torchvision to resize and normalise. As for Qwen2.5-VL
(rollplex.data.qwen2_vl_processor, whose torchvision-free video processor this
one derives from), frames go through the PIL image processor and only the temporal
grouping is ours; what Qwen3-VL changes is kept as transformers has it
(transformers 5.17 and 5.24 agree on all of it):

- sampling: `int(frames / native fps * fps)` frames, at least `min_frames` (4),
  at most `max_frames` (768) and the clip's own count, spread evenly over the clip
  (`np.linspace`), as `Qwen3VLVideoProcessor.sample_frames`;
- sizing: `size` is a budget for the whole clip (all its frames together), read by
  Qwen3-VL's own smart_resize (`cap_pixels_per_frame` / `max_video_tokens` bound
  each frame as transformers does when a folder sets them), and a clip needs at
  least temporal_patch_size frames;
- text: transformers' `Qwen3VLProcessor.replace_video_token`, which this processor
  inherits, writes `<{t:.1f} seconds>` and a <|vision_start|> ... <|vision_end|> of
  its own for every frame group, at the time `_calculate_timestamps` gives (the
  mean of the group's first and last frame, from the sampled frame indices and the
  native fps in the metadata `sample` returns). transformers 5 replaces the
  template's <|video_pad|> alone, so the template's own <|vision_start|> /
  <|vision_end|> stay around the frame groups (transformers 4.x's processor and
  vLLM replace all three).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np
from PIL import Image
from transformers import Qwen3VLProcessor
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as image_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_smart_resize
from transformers.video_utils import VideoMetadata

from rollplex.data.media import VideoFile, VideoLike, video_frames_and_fps, load_image
from rollplex.data.qwen2_vl_processor import (AcceptsTorchFreeVideo, TorchFreeQwen2VLVideoProcessor,
                                              assemble_processor, pixel_pipeline)

# Qwen3VLVideoProcessor's most frames per video, which a tiny folder's clip budget is sized for.
MAX_FRAMES = 768


class TorchFreeQwen3VLVideoProcessor(TorchFreeQwen2VLVideoProcessor):
    """Qwen3-VL video processor without torchvision: Qwen2-VL's pipeline with Qwen3-VL's
    sampling, sizing and defaults (see the module docstring), and rollplex's per-frame
    budget `max_frame_pixels` (None: none) on top."""

    stands_in_for: ClassVar[str] = "Qwen3VLVideoProcessor"
    copied_numbers: ClassVar[tuple[str, ...]] = (
        *TorchFreeQwen2VLVideoProcessor.copied_numbers, "fps", "min_frames", "cap_pixels_per_frame",
        "max_video_tokens",
    )
    patch_size = 16
    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}  # a clip's, all frames together
    image_mean = IMAGENET_STANDARD_MEAN
    image_std = IMAGENET_STANDARD_STD
    max_frames = MAX_FRAMES

    def __init__(self, min_frames: int = 4, cap_pixels_per_frame: bool | None = None, max_video_tokens: int = 768,
                 max_frame_pixels: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.min_frames = min_frames
        # transformers' None (the default) is False, with a warning that the default will change.
        self.cap_pixels_per_frame = bool(cap_pixels_per_frame)
        self.max_video_tokens = max_video_tokens
        self.max_frame_pixels = max_frame_pixels

    def sample(self, video: VideoLike, fps: float, native_fps: float | None,
               name: str) -> tuple[list[Image.Image], VideoMetadata]:
        """Qwen3-VL's frames of one video, and metadata as Qwen3VLVideoProcessor returns it:
        the native frame count and rate and the indices kept, which the processor's
        timestamps are computed from. The native rate is a video file's own, else a dict
        video's "fps", else `native_fps`, else the frames are taken as being at `fps`
        (rollplex.data.media.sample_video's rule)."""
        raw, dict_fps = video_frames_and_fps(video, name)
        given = dict_fps if dict_fps is not None else native_fps if native_fps is not None else fps
        native = raw.fps if isinstance(raw, VideoFile) else float(given)
        total = len(raw)
        count = min(max(int(total / native * fps), self.min_frames), self.max_frames, total)
        indices = np.linspace(0, total - 1, count).round().astype(int)
        if isinstance(raw, VideoFile):
            frames = raw.decode(indices.tolist())
            indices = indices[: len(frames)]  # a container may hold fewer frames than it lists
        else:
            frames = [load_image(raw[i], f"{name} frame {i}") for i in indices]
        if len(frames) < self.temporal_patch_size:
            raise ValueError(f"{name}: a Qwen3-VL video needs at least {self.temporal_patch_size} frames (one "
                             f"temporal patch), got {len(frames)}")
        width, height = frames[0].size
        return frames, VideoMetadata(total_num_frames=total, fps=native, width=width, height=height,
                                     duration=total / native, frames_indices=indices)

    def frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL: the clip's frames within `size` together, as Qwen3VLVideoProcessor.resize
        sizes them; then, where that is above `max_frame_pixels`, the frame is shrunk to it
        as an image would be, keeping its aspect ratio."""
        factor = self.patch_size * self.merge_size
        shortest, longest = self.size["shortest_edge"], self.size["longest_edge"]
        if self.cap_pixels_per_frame:  # Qwen3VLVideoProcessor.resize's cap, the same in 5.17 and 5.24
            per_frame = max(min(self.max_video_tokens * factor * factor, longest // num_frames), int(shortest * 1.05))
            longest = per_frame * num_frames
        h, w = clip_smart_resize(num_frames, height, width, self.temporal_patch_size, factor, shortest, longest)
        if self.max_frame_pixels is not None and h * w > self.max_frame_pixels:
            h, w = image_smart_resize(height, width, factor, factor * factor, self.max_frame_pixels)
        return h, w


class TorchFreeQwen3VLProcessor(AcceptsTorchFreeVideo, Qwen3VLProcessor):
    """Qwen3VLProcessor with the torchvision-free video processor."""


def load_processor(
    path: str | os.PathLike,
    image_backend: str = "pil",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    video_max_frames: int | None = None,
) -> TorchFreeQwen3VLProcessor:
    """The Qwen3-VL processor of a checked model folder (rollplex.data.processor.load_processor
    checks it and comes here by config.json's model_type), see
    rollplex.data.qwen2_vl_processor.assemble_processor.

    Budgets (None: the folder's): an image is resized, keeping its aspect ratio, to
    between `min_pixels` and `max_pixels` pixels (whole 32x32 merged patches, one vision
    token each); a video frame to at most `video_max_pixels`, below the folder's budget
    for the whole clip; a video keeps at most `video_max_frames` frames (the folder's
    max_frames, else Qwen3-VL's 768).
    """
    frame_cap = {} if video_max_frames is None else {"max_frames": video_max_frames}
    video_processor = TorchFreeQwen3VLVideoProcessor.from_pretrained(path, max_frame_pixels=video_max_pixels,
                                                                     **frame_cap)
    return assemble_processor(path, TorchFreeQwen3VLProcessor, video_processor, image_backend,
                              min_pixels=min_pixels, max_pixels=max_pixels)


def tiny_processor_files(spec: Any) -> dict[str, dict[str, Any]]:
    """The processor files of a tiny Qwen3-VL (`spec`, a rollplex.tiny.TinySpec; its
    patch_size is the vision tower's, 16 as Qwen3-VL's): preprocessor_config.json and
    video_preprocessor_config.json.

    The image processor is pinned to the PIL backend (see
    the Qwen2.5-VL family's tiny_processor_files), images between
    spec.min_pixels and spec.max_pixels. The spec's video budget is per frame
    (spec.video_max_pixels), which Qwen3-VL spells as `cap_pixels_per_frame` with
    `max_video_tokens` merged patches a frame, inside a clip budget (`size`) that lets
    MAX_FRAMES frames have it.
    """
    factor = spec.patch_size * spec.spatial_merge_size
    pipeline = pixel_pipeline(spec, "Qwen3VLProcessor", IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)
    return {
        "preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessorPil", **pipeline,
            "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        },
        "video_preprocessor_config.json": {
            "video_processor_type": "Qwen3VLVideoProcessor", **pipeline,
            "size": {"shortest_edge": spec.video_min_pixels, "longest_edge": spec.video_max_pixels * MAX_FRAMES},
            "cap_pixels_per_frame": True,
            "max_video_tokens": spec.video_max_pixels // (factor * factor),
            "fps": 2.0,
            "min_frames": 4,
            "max_frames": MAX_FRAMES,
        },
    }
