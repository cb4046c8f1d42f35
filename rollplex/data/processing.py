"""Prompt + images/videos -> model-ready tensors for Qwen2.5-VL.

One entry point, `prepare_prompt`, used by the data loader, the engine and tests.
It renders the chat template, loads and preprocesses images and videos, expands
every `<|image_pad|>` / `<|video_pad|>` to the number of merged vision tokens and
tokenizes, giving exactly what the Qwen2.5-VL processor of transformers gives.

Why not just call the transformers processor:
  - transformers 5's Qwen2-VL *video* processor (and every BaseVideoProcessor)
    needs torchvision, which cannot be installed beside the CPU torch we test with.
    `AutoProcessor.from_pretrained` of any Qwen2.5-VL directory therefore fails
    without torchvision. `load_processor` assembles the same `Qwen2_5_VLProcessor`
    from its parts with a torchvision-free video processor defined here.
  - The video path is done here with the PIL image processor: a Qwen2-VL image is
    a video of `temporal_patch_size` identical frames, so frames are resized /
    rescaled / normalised / patchified by the image processor (one frame per
    temporal patch) and only the temporal grouping is ours. Images and videos thus
    share one pixel pipeline, on every machine, with or without torchvision.

Pixel and frame budgets (least/most pixels per image, most pixels per video frame,
most frames per video) are settings of the processors: `load_processor` sets them,
so every prompt made with that processor keeps to them. Video files (.mp4, .webm,
...) are decoded with PyAV, the optional `video` extra; only the sampled frames are
turned into images.
"""

from __future__ import annotations

import io
import json
import contextlib
import functools
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image

from transformers import Qwen2_5_VLProcessor
from transformers.image_processing_utils import BaseImageProcessor

from rollplex.models.inputs import Prompt

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")

# An image: PIL image, HxWxC / HxW array (uint8, or float in [0, 1]), file path,
# encoded bytes, or a HF-datasets style {"bytes": ..., "path": ...} dict.
ImageLike = Union[Image.Image, np.ndarray, torch.Tensor, str, os.PathLike, bytes, bytearray, dict]
# A video: a sequence of frames (ImageLike each), a TxHxWxC array, a folder of frame
# images (sorted by name, numbers compared numerically), a video file (any container
# FFmpeg reads; its own frame rate is used), or {"frames": ..., "fps": native_fps}.
VideoLike = Union[Sequence[ImageLike], np.ndarray, str, os.PathLike, dict]


class MediaLoadError(ValueError):
    """An image or video frame could not be read or decoded. `name` says which one."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"cannot load {name}: {reason}")
        self.name = name
        self.reason = reason


# --------------------------------------------------------------------------------------
# Processor loading
# --------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class TorchFreeQwen2VLVideoProcessor(BaseImageProcessor):
    """Qwen2-VL video processor without torchvision.

    Derives from BaseImageProcessor, which needs no torchvision and is the same in
    every transformers 5 release we support. transformers' own video bases do not
    fit: BaseVideoProcessor needs torchvision, and VideoProcessorMixin (the
    torchvision-free base that later releases split off it) is missing from 5.17.
    TorchFreeQwen2_5_VLProcessor accepts this class by name. Holds the video
    preprocessing numbers (pixel budget per frame, frame cap, normalisation,
    patch sizes) and processes frames with a PIL `Qwen2VLImageProcessorPil` built
    from them, then groups frames into temporal patches in the same row/column
    order as transformers' `Qwen2VLVideoProcessor.patchify`.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(
        self,
        patch_size: int = 14,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        size: dict[str, int] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        image_mean: Sequence[float] = (0.48145466, 0.4578275, 0.40821073),
        image_std: Sequence[float] = (0.26862954, 0.26130258, 0.27577711),
        rescale_factor: float = 1 / 255,
        do_resize: bool = True,
        do_rescale: bool = True,
        do_normalize: bool = True,
        do_convert_rgb: bool = True,
        resample: int = 3,
        fps: float = 2.0,
        max_frames: int | None = None,
        **kwargs: Any,
    ):
        # Per-frame pixel budget. Same precedence as transformers: explicit
        # min/max_pixels override `size`; hub configs also spell `size` as
        # {"min_pixels", "max_pixels"}. Defaults are Qwen2VLVideoProcessor's.
        size = dict(size or {})
        self.size = {
            "shortest_edge": int(min_pixels or size.get("shortest_edge") or size.get("min_pixels") or 128 * 28 * 28),
            "longest_edge": int(max_pixels or size.get("longest_edge") or size.get("max_pixels") or 28 * 28 * 768),
        }
        # Class-name keys are dropped; other unknown keys of a hub config are kept
        # as attributes by the base class, as transformers does.
        for key in ("video_processor_type", "image_processor_type", "processor_class"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.rescale_factor = rescale_factor
        self.do_resize = do_resize
        self.do_rescale = do_rescale
        self.do_normalize = do_normalize
        self.do_convert_rgb = do_convert_rgb
        self.resample = int(resample)
        self.fps = fps
        # Most frames kept per video (None: no cap); a longer clip is sampled sparser.
        self.max_frames = max_frames
        self._frame_processor = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any):
        """Read video_preprocessor_config.json, else preprocessor_config.json (as transformers
        does for hub checkpoints that ship no video config)."""
        path = Path(path)
        cfg = _read_json(path / "video_preprocessor_config.json") or _read_json(path / "preprocessor_config.json")
        cfg.update(kwargs)
        return cls(**cfg)

    def to_dict(self) -> dict[str, Any]:
        # The cached frame processor is derived state; keep it out of repr/save.
        out = super().to_dict()
        out.pop("_frame_processor", None)
        out.pop("image_processor_type", None)
        out["video_processor_type"] = type(self).__name__
        return out

    @property
    def frame_processor(self):
        """The PIL image processor that does the per-frame work (temporal patch of 1)."""
        if self._frame_processor is None:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            self._frame_processor = Qwen2VLImageProcessorPil(
                size={"shortest_edge": self.size["shortest_edge"], "longest_edge": self.size["longest_edge"]},
                patch_size=self.patch_size,
                temporal_patch_size=1,
                merge_size=self.merge_size,
                image_mean=self.image_mean,
                image_std=self.image_std,
                rescale_factor=self.rescale_factor,
                do_resize=self.do_resize,
                do_rescale=self.do_rescale,
                do_normalize=self.do_normalize,
                do_convert_rgb=self.do_convert_rgb,
                resample=self.resample,
            )
        return self._frame_processor

    def frames_to_patches(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Frames (all the same size) -> (rows of C*T*p*p float32, (grid_t, grid_h, grid_w)).

        An odd frame count is padded to a multiple of temporal_patch_size by
        repeating the last frame, as transformers / qwen-vl-utils do.
        """
        if not frames:
            raise ValueError("a video needs at least one frame")
        sizes = {f.size for f in frames}
        if len(sizes) != 1:
            raise ValueError(f"all frames of a video must have the same size, got {sorted(sizes)}")
        out = self.frame_processor.preprocess(list(frames), return_tensors=None)
        grids = np.asarray(out["image_grid_thw"])
        _, grid_h, grid_w = (int(x) for x in grids[0])
        p, c, t = self.patch_size, 3, self.temporal_patch_size
        n = grid_h * grid_w
        # Per frame: rows in (h/m, w/m, m, m) order, columns (C, p, p).
        per_frame = np.asarray(out["pixel_values"], dtype=np.float32).reshape(len(frames), n, c, p, p)
        if pad := -len(frames) % t:
            per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)], axis=0)
        grid_t = per_frame.shape[0] // t
        # (gt, T, N, C, p, p) -> (gt, N, C, T, p, p): rows (t, h/m, w/m, m, m), columns
        # (C, T, p, p) -- the order of Qwen2VLVideoProcessor.patchify.
        patches = per_frame.reshape(grid_t, t, n, c, p, p).transpose(0, 2, 3, 1, 4, 5)
        return np.ascontiguousarray(patches.reshape(grid_t * n, c * t * p * p)), (grid_t, grid_h, grid_w)

    def preprocess(
        self,
        videos: Any,
        fps: float | None = None,
        video_metadata: Any = None,
        return_metadata: bool = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ):
        """transformers-style call: one video or a list of videos -> BatchFeature.

        `fps` is the sampling rate (default self.fps; lower where a video would keep more
        than self.max_frames frames); a video's native fps comes from `video_metadata`
        (dict/VideoMetadata with "fps", one per video), else the frames are taken as
        already at `fps`. Returned metadata describes the sampled clip, so
        its `sampled_fps` is what Qwen2.5-VL's processor turns into second_per_grid_ts.
        """
        from transformers.image_processing_utils import BatchFeature
        from transformers.video_utils import VideoMetadata

        target_fps = float(fps) if fps is not None else float(self.fps)
        video_list = [videos] if _is_single_video(videos) else list(videos)
        if video_metadata is None or isinstance(video_metadata, (dict, VideoMetadata)):
            video_metadata = [video_metadata] * len(video_list)
        all_rows, grids, metas = [], [], []
        for i, (video, meta) in enumerate(zip(video_list, video_metadata)):
            native = meta.get("fps") if meta is not None else None
            frames, used_fps = sample_video(video, target_fps, native, f"video {i}", self.max_frames)
            rows, grid = self.frames_to_patches(frames)
            all_rows.append(rows)
            grids.append(grid)
            w, h = frames[0].size
            metas.append(
                VideoMetadata(
                    total_num_frames=len(frames),
                    fps=used_fps,
                    width=w,
                    height=h,
                    duration=len(frames) / used_fps,
                    frames_indices=list(range(len(frames))),
                )
            )
        data = {
            "pixel_values_videos": np.concatenate(all_rows, axis=0),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        out = BatchFeature(data=data, tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metas
        return out

    def __call__(self, videos: Any, **kwargs: Any):
        return self.preprocess(videos, **kwargs)

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs=None) -> int:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor, self.size["shortest_edge"], self.size["longest_edge"])
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t * (h // self.patch_size) * (w // self.patch_size)


class TorchFreeQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor that accepts TorchFreeQwen2VLVideoProcessor.

    ProcessorMixin checks each part against a class looked up by name on the
    `transformers` module (BaseVideoProcessor in 5.17, VideoProcessorMixin in
    5.19+); neither is our base, and without torchvision neither is exported.
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any):
        if argument_name == "video_processor" and isinstance(argument, TorchFreeQwen2VLVideoProcessor):
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(
    path: str | os.PathLike,
    image_backend: str = "pil",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    video_max_frames: int | None = None,
) -> Qwen2_5_VLProcessor:
    """The Qwen2.5-VL processor of a checkpoint directory, without torchvision.

    Always assembled from parts (tokenizer, PIL image processor, the torchvision-free
    video processor above, chat template) so that preprocessing is the same on every
    machine whether torchvision is installed or not. `image_backend="auto"` lets
    transformers pick the image backend (torchvision when installed).

    Budgets (None: the folder's preprocessor_config.json value): an image is resized,
    keeping its aspect ratio, to between `min_pixels` and `max_pixels` pixels (rounded
    to whole 28x28 merged patches, one vision token each); a video frame to at most
    `video_max_pixels` (its floor is the folder's); a video keeps at most
    `video_max_frames` frames (None and no folder value: no cap).
    """
    from transformers import AutoTokenizer
    # From its module: transformers 5.17's top-level name is a placeholder that demands
    # torchvision even for the PIL backend.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = {} if image_backend == "auto" else {"backend": image_backend}
    image_processor = _within_pixel_budget(
        functools.partial(AutoImageProcessor.from_pretrained, path, **backend), "image", min_pixels, max_pixels
    )
    frame_cap = {} if video_max_frames is None else {"max_frames": video_max_frames}
    video_processor = _within_pixel_budget(
        functools.partial(TorchFreeQwen2VLVideoProcessor.from_pretrained, path, **frame_cap),
        "video frame", None, video_max_pixels,
    )
    chat_template = getattr(tokenizer, "chat_template", None)
    if chat_template is None and (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    if chat_template is None:
        chat_template = _read_json(path / "chat_template.json").get("chat_template")
    return TorchFreeQwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=chat_template,
    )


def _within_pixel_budget(load: Callable[..., Any], what: str, min_pixels: int | None, max_pixels: int | None) -> Any:
    """`load()`'s processor with its pixels per image bounded by min_pixels / max_pixels
    (None: the folder's value). Loaded again with both as keywords: transformers'
    Qwen2-VL processors take these in every 5.x release, while a `size` argument
    would be overridden by a folder's own min_pixels / max_pixels."""
    processor = load()
    if min_pixels is None and max_pixels is None:
        return processor
    low = processor.size["shortest_edge"] if min_pixels is None else min_pixels
    high = processor.size["longest_edge"] if max_pixels is None else max_pixels
    if low > high:
        if min_pixels is not None:
            raise ValueError(f"{what} min_pixels {low} is above max_pixels {high} (the model folder's when not given)")
        low = high  # the folder's floor gives way to a lower cap, else small inputs would be enlarged past it
    return load(min_pixels=low, max_pixels=high)


# --------------------------------------------------------------------------------------
# Images and videos
# --------------------------------------------------------------------------------------
def _to_rgb(img: Image.Image) -> Image.Image:
    # Transparent pixels go on white, as transformers' convert_to_rgb and
    # qwen-vl-utils do; plain convert("RGB") would keep the hidden colour.
    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _array_to_pil(arr: np.ndarray, name: str) -> Image.Image:
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # CHW -> HWC
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[-1] not in (3, 4)):
        raise MediaLoadError(name, f"array of shape {tuple(arr.shape)} is not an HxW, HxWx3 or HxWx4 image")
    if arr.dtype != np.uint8:
        if np.issubdtype(arr.dtype, np.floating):
            # Floats are taken as [0, 1] intensities.
            arr = np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)
        else:
            arr = np.clip(arr, 0, 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(arr))


def load_image(image: ImageLike, name: str = "image") -> Image.Image:
    """Any supported image input -> decoded RGB PIL image.

    Raises MediaLoadError (a ValueError) naming the image when it cannot be read or decoded.
    """
    if isinstance(image, dict):
        # HF datasets' Image feature: {"bytes": b"..." or None, "path": "..." or None}.
        if image.get("bytes") is not None:
            label = f"{name} ({image.get('path')!r})" if image.get("path") else name
            return load_image(bytes(image["bytes"]), label)
        if image.get("path") is not None:
            return load_image(image["path"], name)
        if image.get("image") is not None:
            return load_image(image["image"], name)
        raise MediaLoadError(name, f"dict image needs 'bytes' or 'path', got keys {sorted(image)}")
    if isinstance(image, Image.Image):
        try:
            image.load()
        except Exception as e:  # a lazily opened, truncated file
            raise MediaLoadError(name, f"{type(e).__name__}: {e}") from e
        return _to_rgb(image)
    if isinstance(image, torch.Tensor):
        return _array_to_pil(image.detach().cpu().numpy(), name)
    if isinstance(image, np.ndarray):
        return _array_to_pil(image, name)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        label = name if "(" in name else f"{name} ({len(data)} bytes)"
        return _decode(io.BytesIO(data), label)
    if isinstance(image, (str, os.PathLike)):
        p = Path(image)
        label = f"{name} ({str(p)!r})"
        if not p.is_file():
            raise MediaLoadError(label, "no such file")
        return _decode(p, label)
    raise MediaLoadError(name, f"unsupported image type {type(image).__name__}")


def _decode(source: Any, label: str) -> Image.Image:
    try:
        with Image.open(source) as img:
            img.load()  # force decoding now, so corrupt data fails here
            return _to_rgb(img)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaLoadError(label, f"{type(e).__name__}: {e}") from e


def _natural_key(name: str) -> list[Any]:
    # frame_2 before frame_10.
    return [int(s) if s.isdigit() else s.lower() for s in re.split(r"(\d+)", name)]


def list_frame_files(folder: str | os.PathLike) -> list[Path]:
    """Frame images of a folder, sorted by name with numbers compared numerically."""
    folder = Path(folder)
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_EXTENSIONS]
    return sorted(files, key=lambda p: _natural_key(p.name))


def _is_single_video(videos: Any) -> bool:
    """True if `videos` is one video (not a list of videos)."""
    if isinstance(videos, (str, os.PathLike, dict)):
        return True
    if isinstance(videos, (np.ndarray, torch.Tensor)):
        return videos.ndim == 4
    if isinstance(videos, (list, tuple)) and videos:
        first = videos[0]
        return isinstance(first, (Image.Image, bytes, bytearray)) or (
            isinstance(first, (np.ndarray, torch.Tensor)) and first.ndim in (2, 3)
        )
    return False


def _import_av(label: str) -> Any:
    try:
        import av
    except ImportError:
        raise ImportError(
            f"reading {label} needs PyAV, an optional extra: "
            "pip install 'rollplex[video]' (or: pip install av)"
        ) from None
    return av


class VideoFile:
    """A video container file, read with PyAV: its frame count and native rate
    when opened, then only the frames asked for are turned into images."""

    def __init__(self, path: Path, label: str):
        self.path, self.label = path, label
        with self._open() as container:
            stream = container.streams.video[0]
            self.fps = float(stream.average_rate or stream.guessed_rate or 0)
            # WebM / Matroska store no frame count: count the packets, which needs no decoding.
            self.num_frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        if self.num_frames <= 0 or self.fps <= 0:
            raise MediaLoadError(label, f"no frames or no frame rate ({self.num_frames} frames at {self.fps} fps)")

    def __len__(self) -> int:
        return self.num_frames

    @contextlib.contextmanager
    def _open(self) -> Iterator[Any]:
        av = _import_av(self.label)
        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    raise MediaLoadError(self.label, "the file holds no video stream")
                yield container
        except av.error.FFmpegError as e:
            raise MediaLoadError(self.label, f"{type(e).__name__}: {e}") from e

    def decode(self, indices: Sequence[int]) -> list[Image.Image]:
        """RGB images of the frames at `indices` (ascending), decoding no further than the last."""
        wanted = set(indices)
        frames = []
        with self._open() as container:
            for i, frame in enumerate(container.decode(container.streams.video[0])):
                if i in wanted:
                    frames.append(frame.to_image())
                if i >= indices[-1]:
                    break
        # A container may list more frames than it holds; the frames read keep their times.
        if not frames:
            raise MediaLoadError(self.label, "no frame could be decoded")
        return frames


def _video_frames_and_fps(video: VideoLike, name: str) -> tuple[Sequence[Any], float | None]:
    """Unpack a video input into raw frame inputs (or a VideoFile) and its native fps
    (None if not given)."""
    native = None
    if isinstance(video, dict):
        native = video.get("fps")
        video = video.get("frames", video.get("video"))
        if video is None:
            raise ValueError(f"{name}: dict video needs 'frames' (a frame list, folder or video file)")
    if isinstance(video, (str, os.PathLike)):
        path = Path(video)
        label = f"{name} ({str(path)!r})"
        if path.is_file():
            return VideoFile(path, label), native
        if not path.is_dir():
            raise MediaLoadError(label, "no such video file or folder of frame images")
        frames: list[Any] = list_frame_files(path)
        if not frames:
            raise MediaLoadError(label, "folder holds no frame images")
        return frames, native
    if isinstance(video, (np.ndarray, torch.Tensor)):
        if video.ndim != 4:
            raise ValueError(f"{name}: a video array must be T x H x W x C, got shape {tuple(video.shape)}")
        return list(video), native
    if isinstance(video, (list, tuple)):
        if not video:
            raise ValueError(f"{name}: a video needs at least one frame")
        return list(video), native
    raise ValueError(f"{name}: unsupported video type {type(video).__name__}")


def sample_frame_indices(num_frames: int, native_fps: float, video_fps: float) -> list[int]:
    """Indices of the frames kept when a clip at `native_fps` is sampled at `video_fps`.

    Frame i is at time i/native_fps; we keep the frame at or just before each time
    k/video_fps within the clip. Sampling above the native rate keeps every frame
    (duplicating frames adds no information).
    """
    if num_frames <= 0:
        return []
    if native_fps <= 0 or video_fps <= 0:
        raise ValueError(f"fps must be positive, got native_fps={native_fps}, video_fps={video_fps}")
    if native_fps <= video_fps:
        return list(range(num_frames))
    step = native_fps / video_fps
    n = math.floor((num_frames - 1) / step + 1e-9) + 1
    return [min(num_frames - 1, math.floor(k * step + 1e-9)) for k in range(n)]


def sampling_rate(num_frames: int, native_fps: float, video_fps: float, max_frames: int | None = None) -> float:
    """The rate a clip of `num_frames` at `native_fps` is sampled at: `video_fps`, at
    most the native rate, and lowered where needed so that at most `max_frames`
    frames are kept, evenly spread over the whole clip."""
    rate = min(float(native_fps), float(video_fps))
    if max_frames is not None and len(sample_frame_indices(num_frames, native_fps, rate)) > max_frames:
        # Frames num_frames / max_frames apart: exactly max_frames of them fit in the clip.
        rate = max_frames * native_fps / num_frames
    return rate


def sample_video(
    video: VideoLike,
    video_fps: float,
    native_fps: float | None = None,
    name: str = "video",
    max_frames: int | None = None,
) -> tuple[list[Image.Image], float]:
    """Load and fps-sample one video -> (RGB frames, fps of the sampled frames).

    `native_fps` (or a dict video's "fps") is the rate the frames were taken at;
    by default they are taken as being at `video_fps`, so every frame is kept. A
    video file's own rate is always used. Past `max_frames` kept frames, the clip is
    sampled at a lower rate (see `sampling_rate`). Only the kept frames are decoded.
    """
    raw, dict_fps = _video_frames_and_fps(video, name)
    given = dict_fps if dict_fps is not None else native_fps if native_fps is not None else video_fps
    native = raw.fps if isinstance(raw, VideoFile) else float(given)
    rate = sampling_rate(len(raw), native, video_fps, max_frames)
    indices = sample_frame_indices(len(raw), native, rate)
    if isinstance(raw, VideoFile):
        return raw.decode(indices), rate
    return [load_image(raw[i], f"{name} frame {i}") for i in indices], rate


# --------------------------------------------------------------------------------------
# Prompt
# --------------------------------------------------------------------------------------
_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    """'<image>a<video>b' -> image item, text item, video item, text item (in order)."""
    content: list[dict[str, Any]] = []
    for piece in _PLACEHOLDER_RE.split(text):
        if piece == IMAGE_PLACEHOLDER:
            content.append({"type": "image"})
        elif piece == VIDEO_PLACEHOLDER:
            content.append({"type": "video"})
        elif piece:
            content.append({"type": "text", "text": piece})
    return content


def text_to_messages(text: str, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """EasyR1-style prompt string -> chat messages.

    Each `<image>` / `<video>` becomes an image / video content item of one user
    message, in order, with the text between them as text items.
    """
    messages: list[dict[str, Any]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": _split_placeholders(text)})
    return messages


def _normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # EasyR1 datasets also put placeholders inside string contents of chat
    # messages; turn those into content items too.
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and _PLACEHOLDER_RE.search(content):
            message = {**message, "content": _split_placeholders(content)}
        out.append(message)
    return out


def _item_kind(item: Any) -> str | None:
    # Mirrors the chat template's tests for image / video content items.
    if not isinstance(item, dict):
        return None
    if item.get("type") == "image" or "image" in item or "image_url" in item:
        return "image"
    if item.get("type") == "video" or "video" in item:
        return "video"
    return None


def _media_in_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    images, videos = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for item in content:
            kind = _item_kind(item)
            if kind == "image":
                images.append(item)
            elif kind == "video":
                videos.append(item)
    return images, videos


def _resolve_media(
    kind: str, items: list[dict], given: Sequence[Any] | None, placeholder: str
) -> list[Any]:
    """The media to use, in order: `given` if passed, else the data carried by the items."""
    if given is not None:
        given = list(given)
        if len(given) != len(items):
            raise ValueError(
                f"the prompt has {len(items)} {kind} placeholder(s) ({placeholder} / {kind} content items) "
                f"but {len(given)} {kind}(s) were given"
            )
        return given
    found = []
    for i, item in enumerate(items):
        data = item.get(kind, item.get("image_url") if kind == "image" else None)
        if isinstance(data, dict) and kind == "image" and "url" in data and len(data) == 1:
            data = data["url"]  # OpenAI-style {"image_url": {"url": ...}}
        if data is None:
            raise ValueError(
                f"the prompt has {len(items)} {kind} placeholder(s) but no {kind}s were given "
                f"({kind} item {i} carries no data)"
            )
        found.append(data)
    return found


def _expand_pads(text: str, pad: str, counts: list[int], kind: str) -> str:
    parts = text.split(pad)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"the rendered prompt has {len(parts) - 1} {pad} tokens but {len(counts)} {kind}(s)")
    out = [parts[0]]
    for n, rest in zip(counts, parts[1:]):
        out.append(pad * n)
        out.append(rest)
    return "".join(out)


def prepare_prompt(
    processor: Any,
    messages_or_text: str | Sequence[dict[str, Any]],
    images: Sequence[ImageLike] | None = None,
    videos: Sequence[VideoLike] | None = None,
    video_fps: float = 2.0,
    add_generation_prompt: bool = True,
    native_fps: float | Sequence[float | None] | None = None,
    system_prompt: str | None = None,
) -> Prompt:
    """Render, load media, preprocess and tokenize one prompt.

    Args:
        processor: from `load_processor` (any Qwen2.5-VL processor with tokenizer,
            image_processor and video_processor attributes works).
        messages_or_text: chat messages ([{role, content}], content a string or a list
            of {"type": "text"/"image"/"video", ...} items) or a string with `<image>` /
            `<video>` placeholders, which becomes one user message.
        images / videos: in placeholder order. When None, the data is taken from the
            content items ({"type": "image", "image": ...}), qwen-vl-utils style.
        video_fps: rate videos are sampled at (within the video processor's
            max_frames, see `load_processor` for the budgets).
        native_fps: the rate the given frames were taken at (scalar, or one per video);
            default: frames are already at `video_fps` and all are kept. A dict video's
            "fps" wins over this.
        system_prompt: only for string prompts; None keeps the template's default.

    Raises:
        MediaLoadError (a ValueError) naming an image/frame that cannot be decoded;
        ValueError when placeholders and given media do not match.
    """
    tokenizer = processor.tokenizer
    if isinstance(messages_or_text, str):
        messages = text_to_messages(messages_or_text, system_prompt)
    else:
        messages = _normalize_messages(messages_or_text)
    image_items, video_items = _media_in_messages(messages)
    image_inputs = _resolve_media("image", image_items, images, IMAGE_PLACEHOLDER)
    video_inputs = _resolve_media("video", video_items, videos, VIDEO_PLACEHOLDER)

    render = processor if getattr(processor, "chat_template", None) else tokenizer
    text = render.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    result = Prompt(input_ids=torch.empty(0, dtype=torch.long), text=text)
    expanded = text
    if image_inputs:
        expanded = _add_images(processor, image_inputs, result, expanded)
    elif IMAGE_PAD in text:
        raise ValueError(f"the rendered prompt has {text.count(IMAGE_PAD)} {IMAGE_PAD} tokens but no images")
    if video_inputs:
        natives = _native_rates(native_fps, len(video_inputs))
        expanded = _add_videos(processor, video_inputs, natives, video_fps, result, expanded)
    elif VIDEO_PAD in text:
        raise ValueError(f"the rendered prompt has {text.count(VIDEO_PAD)} {VIDEO_PAD} tokens but no videos")

    # The template already holds every special token; Qwen's tokenizer adds none.
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    result.input_ids = torch.tensor(ids, dtype=torch.long)
    return result


def _add_images(processor: Any, images: Sequence[ImageLike], result: Prompt, text: str) -> str:
    """Preprocess `images` into `result`; returns `text` with each image's pad token
    repeated once per merged patch."""
    pil_images = [load_image(img, f"image {i}") for i, img in enumerate(images)]
    out = processor.image_processor(images=pil_images, return_tensors="pt")
    result.pixel_values = out["pixel_values"]
    result.image_grid_thw = out["image_grid_thw"].long()
    merge = processor.image_processor.merge_size
    counts = [int(g.prod()) // merge**2 for g in result.image_grid_thw]
    return _expand_pads(text, IMAGE_PAD, counts, "image")


def _native_rates(native_fps: float | Sequence[float | None] | None, videos: int) -> list[float | None]:
    if native_fps is None or isinstance(native_fps, (int, float)):
        return [native_fps] * videos
    if len(native_fps) != videos:
        raise ValueError(f"native_fps has {len(native_fps)} entries for {videos} videos")
    return list(native_fps)


def _torch_free(vp: Any) -> TorchFreeQwen2VLVideoProcessor:
    """A transformers video processor (e.g. loaded by AutoProcessor with torchvision)
    gives its numbers; the work is done the torchvision-free way."""
    if isinstance(vp, TorchFreeQwen2VLVideoProcessor):
        return vp
    return TorchFreeQwen2VLVideoProcessor(
        patch_size=vp.patch_size,
        temporal_patch_size=vp.temporal_patch_size,
        merge_size=vp.merge_size,
        size={"shortest_edge": vp.size["shortest_edge"], "longest_edge": vp.size["longest_edge"]},
        image_mean=vp.image_mean,
        image_std=vp.image_std,
        rescale_factor=vp.rescale_factor,
    )


def _add_videos(processor: Any, videos: Sequence[VideoLike], natives: list[float | None], video_fps: float,
                result: Prompt, text: str) -> str:
    """Sample and preprocess `videos` into `result`; returns `text` with each video's
    pad token repeated once per merged patch."""
    vp = _torch_free(processor.video_processor)
    rows, grids, seconds = [], [], []
    for i, (video, native) in enumerate(zip(videos, natives)):
        frames, used_fps = sample_video(video, video_fps, native, f"video {i}", vp.max_frames)
        patches, grid = vp.frames_to_patches(frames)
        rows.append(patches)
        grids.append(grid)
        seconds.append(vp.temporal_patch_size / used_fps)
    result.pixel_values_videos = torch.from_numpy(np.concatenate(rows, axis=0))
    result.video_grid_thw = torch.tensor(grids, dtype=torch.long)
    result.second_per_grid_ts = torch.tensor(seconds, dtype=torch.float32)
    counts = [int(g.prod()) // vp.merge_size**2 for g in result.video_grid_thw]
    return _expand_pads(text, VIDEO_PAD, counts, "video")
