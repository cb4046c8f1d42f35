"""The Qwen2.5-VL processor, without torchvision, with pixel and frame budgets:
transformers' `Qwen2_5_VLProcessor` assembled from the folder's parts with
Qwen2-VL's torchvision-free video processor (rollplex.data.qwen2_vl_processor),
and the processor files of a tiny Qwen2.5-VL."""

from __future__ import annotations

import functools
import os
from typing import Any

from transformers import Qwen2_5_VLProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from rollplex.data.qwen2_vl_processor import (AcceptsTorchFreeVideo, TorchFreeQwen2VLVideoProcessor,
                                              assemble_processor, pixel_pipeline, within_pixel_budget)


class TorchFreeQwen2_5_VLProcessor(AcceptsTorchFreeVideo, Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor with the torchvision-free video processor."""


def load_processor(
    path: str | os.PathLike,
    image_backend: str = "pil",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    video_max_frames: int | None = None,
) -> TorchFreeQwen2_5_VLProcessor:
    """The Qwen2.5-VL processor of a checked model folder (rollplex.data.processor.load_processor
    checks it and comes here by config.json's model_type), see `assemble_processor`.

    Budgets (None: the folder's preprocessor_config.json value): an image is resized,
    keeping its aspect ratio, to between `min_pixels` and `max_pixels` pixels (rounded
    to whole 28x28 merged patches, one vision token each); a video frame to at most
    `video_max_pixels` (its floor is the folder's); a video keeps at most
    `video_max_frames` frames (None and no folder value: no cap).
    """
    frame_cap = {} if video_max_frames is None else {"max_frames": video_max_frames}
    video_processor = within_pixel_budget(
        functools.partial(TorchFreeQwen2VLVideoProcessor.from_pretrained, path, **frame_cap),
        "video frame", None, video_max_pixels,
    )
    return assemble_processor(path, TorchFreeQwen2_5_VLProcessor, video_processor, image_backend,
                              min_pixels=min_pixels, max_pixels=max_pixels)


def _budget(min_pixels: int, max_pixels: int) -> dict[str, Any]:
    # Spelled both ways, as the hub's Qwen2.5-VL files do.
    return {"min_pixels": min_pixels, "max_pixels": max_pixels,
            "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}


def tiny_processor_files(spec: Any) -> dict[str, dict[str, Any]]:
    """The processor files of a tiny Qwen2.5-VL (`spec`, a rollplex.tiny.TinySpec):
    preprocessor_config.json and video_preprocessor_config.json.

    The image processor is pinned to the PIL backend: "Qwen2VLImageProcessor" is
    transformers 5's torchvision backend (AutoImageProcessor falls back to PIL only when
    torchvision is missing); pinning keeps pixels identical on every machine. The video
    config names transformers' Qwen2VLVideoProcessor, which needs torchvision;
    `load_processor` reads its numbers into TorchFreeQwen2VLVideoProcessor.
    """
    pipeline = pixel_pipeline(spec, "Qwen2_5_VLProcessor", OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    return {
        "preprocessor_config.json": {"image_processor_type": "Qwen2VLImageProcessorPil", **pipeline,
                                     **_budget(spec.min_pixels, spec.max_pixels)},
        "video_preprocessor_config.json": {"video_processor_type": "Qwen2VLVideoProcessor", **pipeline,
                                           **_budget(spec.video_min_pixels, spec.video_max_pixels)},
    }
