"""Images and videos: loading, decoding and frame sampling.

An image is a PIL image, an array, a file path, encoded bytes or an HF-datasets
`{"bytes", "path"}` dict. A video is a sequence of frames, an array, a folder of
frame images, a video file (decoded with PyAV, the optional `video` extra; only
the sampled frames become images) or `{"frames": ..., "fps": native_fps}`.
Anything that cannot be read raises `MediaLoadError`, naming it.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from PIL import Image

FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")

# An image: PIL image, HxWxC / HxW array (uint8, or float in [0, 1]), file path,
# encoded bytes, or a HF-datasets style {"bytes": ..., "path": ...} dict.
ImageLike = Union[Image.Image, np.ndarray, torch.Tensor, str, os.PathLike, bytes, bytearray, dict]
# A video: a sequence of frames (ImageLike each), a TxHxWxC array, a folder of frame
# images (sorted by name, numbers compared numerically), a video file (any container
# FFmpeg reads; its own frame rate is used), or {"frames": ..., "fps": native_fps}.
VideoLike = Union[Sequence[ImageLike], np.ndarray, str, os.PathLike, dict]


# What went wrong with an image or video (MediaLoadError.problem): each has its own fix, so rows skipped for one
# are reported apart from rows skipped for another.
MISSING = "missing"  # no file (or no frames in a folder) where the row points
UNDECODABLE = "undecodable"  # the data is there but does not decode: a corrupt or truncated file, not an image
UNUSABLE = "unusable"  # a value of the wrong type or shape


class MediaLoadError(ValueError):
    """An image or video frame could not be read or decoded. `name` says which one, `problem` what went wrong
    (MISSING, UNDECODABLE or UNUSABLE)."""

    def __init__(self, name: str, reason: str, problem: str = UNUSABLE):
        verb = "decode" if problem == UNDECODABLE else "load"
        super().__init__(f"cannot {verb} {name}: {reason}")
        self.name = name
        self.reason = reason
        self.problem = problem


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
            raise MediaLoadError(name, f"{type(e).__name__}: {e}", UNDECODABLE) from e
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
            raise MediaLoadError(label, "no such file", MISSING)
        return _decode(p, label)
    raise MediaLoadError(name, f"unsupported image type {type(image).__name__}")


def _decode(source: Any, label: str) -> Image.Image:
    try:
        with Image.open(source) as img:
            img.load()  # force decoding now, so corrupt data fails here
            return _to_rgb(img)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise MediaLoadError(label, f"{type(e).__name__}: {e}", UNDECODABLE) from e


def _natural_key(name: str) -> list[Any]:
    # frame_2 before frame_10.
    return [int(s) if s.isdigit() else s.lower() for s in re.split(r"(\d+)", name)]


def list_frame_files(folder: str | os.PathLike) -> list[Path]:
    """Frame images of a folder, sorted by name with numbers compared numerically."""
    folder = Path(folder)
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_EXTENSIONS]
    return sorted(files, key=lambda p: _natural_key(p.name))


def is_single_video(videos: Any) -> bool:
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
            raise MediaLoadError(label, f"no frames or no frame rate ({self.num_frames} frames at {self.fps} fps)",
                                 UNDECODABLE)

    def __len__(self) -> int:
        return self.num_frames

    @contextlib.contextmanager
    def _open(self) -> Iterator[Any]:
        av = _import_av(self.label)
        try:
            with av.open(str(self.path)) as container:
                if not container.streams.video:
                    raise MediaLoadError(self.label, "the file holds no video stream", UNDECODABLE)
                yield container
        except av.error.FFmpegError as e:
            raise MediaLoadError(self.label, f"{type(e).__name__}: {e}", UNDECODABLE) from e

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
            raise MediaLoadError(self.label, "no frame could be decoded", UNDECODABLE)
        return frames


def video_frames_and_fps(video: VideoLike, name: str) -> tuple[Sequence[Any], float | None]:
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
            raise MediaLoadError(label, "no such video file or folder of frame images", MISSING)
        frames: list[Any] = list_frame_files(path)
        if not frames:
            raise MediaLoadError(label, "folder holds no frame images", MISSING)
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
    raw, dict_fps = video_frames_and_fps(video, name)
    given = dict_fps if dict_fps is not None else native_fps if native_fps is not None else video_fps
    native = raw.fps if isinstance(raw, VideoFile) else float(given)
    rate = sampling_rate(len(raw), native, video_fps, max_frames)
    indices = sample_frame_indices(len(raw), native, rate)
    if isinstance(raw, VideoFile):
        return raw.decode(indices), rate
    return [load_image(raw[i], f"{name} frame {i}") for i in indices], rate
