"""Qwen2-VL's processor without torchvision: what every Qwen VL family's processor
builds on (transformers' Qwen2.5-VL and Qwen3-VL processors derive from Qwen2-VL's
too), so no family imports another's.

transformers 5's Qwen2-VL *video* processor (and every BaseVideoProcessor) needs
torchvision, which cannot be installed beside the CPU torch we test with, so
`AutoProcessor.from_pretrained` of a Qwen VL directory fails without it. A
family's `load_processor` (rollplex.models.<family>.processor) assembles its
transformers processor from parts (`assemble_processor`) with a torchvision-free
video processor derived from `TorchFreeQwen2VLVideoProcessor`. That one does the
video path with the PIL image processor: a Qwen2-VL image is a video of
`temporal_patch_size` identical frames, so frames are resized / rescaled /
normalised / patchified by the image processor (one frame per temporal patch) and
only the temporal grouping is ours. Images and videos thus share one pixel
pipeline, on every machine, with or without torchvision. A family changes how
frames are sampled (`sample`) and sized (`frame_size`).

Pixel and frame budgets (least/most pixels per image, most pixels per video frame,
most frames per video) are settings of the processors (`within_pixel_budget`), so
every prompt made with a processor keeps to them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
from transformers.processing_utils import ProcessorMixin
from transformers.video_utils import VideoMetadata

from rollplex.data.media import VideoLike, is_single_video, sample_video


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


class TorchFreeQwen2VLVideoProcessor(BaseImageProcessor):
    """Qwen2-VL video processor without torchvision, and the base of later Qwen families'.

    Derives from BaseImageProcessor, which needs no torchvision and is the same in
    every transformers 5 release we support. transformers' own video bases do not
    fit: BaseVideoProcessor needs torchvision, and VideoProcessorMixin (the
    torchvision-free base that later releases split off it) is missing from 5.17.
    `AcceptsTorchFreeVideo` processors accept this class. Holds the video
    preprocessing numbers (pixel budget per frame, frame cap, normalisation,
    patch sizes), resizes each frame with PIL to `frame_size`, has a PIL
    `Qwen2VLImageProcessorPil` built from those numbers rescale / normalise /
    patchify it, then groups frames into temporal patches in the same row/column
    order as transformers' `Qwen2VLVideoProcessor.patchify`.

    The class attributes below are the defaults of the transformers class this one
    stands in for (`stands_in_for`); a folder's video_preprocessor_config.json
    overrides them. A subclass for another family changes them, `sample` and
    `frame_size`.
    """

    model_input_names = ["pixel_values_videos", "video_grid_thw"]
    stands_in_for: ClassVar[str] = "Qwen2VLVideoProcessor"
    # What `stand_in` copies off a transformers video processor, beside `size`.
    copied_numbers: ClassVar[tuple[str, ...]] = (
        "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor", "max_frames",
    )
    patch_size = 14
    size = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    max_frames: int | None = None  # most frames kept per video (None: no cap); a longer clip is sampled sparser

    def __init__(
        self,
        patch_size: int | None = None,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        size: dict[str, int] | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        image_mean: Sequence[float] | None = None,
        image_std: Sequence[float] | None = None,
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
        # Per-frame pixel budget (a subclass may read `size` otherwise). Same precedence as transformers:
        # explicit min/max_pixels override `size`; hub configs also spell `size` as {"min_pixels", "max_pixels"}.
        # None: the class's defaults, which are transformers'.
        size = dict(size or {})
        self.size = {
            "shortest_edge": int(min_pixels or size.get("shortest_edge") or size.get("min_pixels")
                                 or type(self).size["shortest_edge"]),
            "longest_edge": int(max_pixels or size.get("longest_edge") or size.get("max_pixels")
                                or type(self).size["longest_edge"]),
        }
        # Class-name keys are dropped; other unknown keys of a hub config are kept
        # as attributes by the base class, as transformers does.
        for key in ("video_processor_type", "image_processor_type", "processor_class"):
            kwargs.pop(key, None)
        super().__init__(**kwargs)
        self.patch_size = patch_size or type(self).patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.image_mean = list(image_mean or type(self).image_mean)
        self.image_std = list(image_std or type(self).image_std)
        self.rescale_factor = rescale_factor
        self.do_resize = do_resize
        self.do_rescale = do_rescale
        self.do_normalize = do_normalize
        self.do_convert_rgb = do_convert_rgb
        self.resample = int(resample)
        self.fps = fps
        self.max_frames = max_frames if max_frames is not None else type(self).max_frames
        self._frame_processor = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any):
        """Read video_preprocessor_config.json, else preprocessor_config.json (as transformers
        does for hub checkpoints that ship no video config)."""
        path = Path(path)
        cfg = _read_json(path / "video_preprocessor_config.json") or _read_json(path / "preprocessor_config.json")
        cfg.update(kwargs)
        return cls(**cfg)

    @classmethod
    def stand_in(cls, vp: Any) -> TorchFreeQwen2VLVideoProcessor:
        """`vp` itself if it is torchvision-free, else the torchvision-free processor with its numbers.

        A transformers video processor (e.g. loaded by AutoProcessor with torchvision) is
        replaced by the subclass that `stands_in_for` its class; an object of no
        transformers class gives this class's numbers (duck-typed). A transformers class
        no subclass stands in for is an error: its sampling or sizing rules are unknown."""
        if isinstance(vp, TorchFreeQwen2VLVideoProcessor):
            return vp
        stand_in = cls._stand_ins().get(type(vp).__name__)
        if stand_in is None:
            if type(vp).__module__.startswith("transformers."):
                raise TypeError(f"no torchvision-free video processor stands in for {type(vp).__name__} (known: "
                                f"{', '.join(cls._stand_ins())})")
            stand_in = cls
        numbers = {name: getattr(vp, name) for name in stand_in.copied_numbers if hasattr(vp, name)}
        return stand_in(size={"shortest_edge": vp.size["shortest_edge"], "longest_edge": vp.size["longest_edge"]},
                        **numbers)

    @classmethod
    def _stand_ins(cls) -> dict[str, type[TorchFreeQwen2VLVideoProcessor]]:
        """This class and its subclasses (imported so far) by the transformers class each stands in for."""
        found, todo = {}, [cls]
        while todo:
            klass = todo.pop()
            found.setdefault(klass.stands_in_for, klass)
            todo.extend(klass.__subclasses__())
        return found

    def to_dict(self) -> dict[str, Any]:
        # The cached frame processor is derived state; keep it out of repr/save.
        out = super().to_dict()
        out.pop("_frame_processor", None)
        out.pop("image_processor_type", None)
        out["video_processor_type"] = type(self).__name__
        return out

    @property
    def frame_processor(self) -> Qwen2VLImageProcessorPil:
        """The PIL image processor that does the per-frame work (temporal patch of 1)."""
        if self._frame_processor is None:
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

    def sample(self, video: VideoLike, fps: float, native_fps: float | None,
               name: str) -> tuple[list[Image.Image], VideoMetadata]:
        """One video's kept frames, and the metadata the family's transformers processor reads of them.

        Qwen2-VL: sampled at `fps` (at most the native rate, lower past max_frames; see
        rollplex.data.media.sample_video). The metadata describes the sampled clip as a video
        of its own at the sampled rate, whose `sampled_fps` Qwen2.5-VL's processor turns
        into second_per_grid_ts."""
        frames, used_fps = sample_video(video, fps, native_fps, name, self.max_frames)
        width, height = frames[0].size
        return frames, VideoMetadata(total_num_frames=len(frames), fps=used_fps, width=width, height=height,
                                     duration=len(frames) / used_fps, frames_indices=list(range(len(frames))))

    def frame_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) every frame of a `num_frames`-frame video of `height` x `width` is resized to.

        Qwen2-VL: each frame on its own, as an image within the per-frame budget `size`."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.size["shortest_edge"],
                            self.size["longest_edge"])

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
        frames = list(frames)
        if self.do_resize:
            # PIL's resize, as the PIL image processor's own resize does it (so equal to it where both apply).
            width, height = frames[0].size
            new_height, new_width = self.frame_size(len(frames), height, width)
            frames = [f.resize((new_width, new_height), resample=self.resample) for f in frames]
        out = self.frame_processor.preprocess(frames, do_resize=False, return_tensors=None)
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
    ) -> BatchFeature:
        """transformers-style call: one video or a list of videos -> BatchFeature.

        `fps` is the sampling rate (default self.fps); a video's native fps comes from
        `video_metadata` (dict/VideoMetadata with "fps", one per video), else the frames
        are taken as already at `fps`. Returned metadata is `sample`'s, what the family's
        processor reads (second_per_grid_ts, timestamps).
        """
        target_fps = float(fps) if fps is not None else float(self.fps)
        video_list = [videos] if is_single_video(videos) else list(videos)
        if video_metadata is None or isinstance(video_metadata, (dict, VideoMetadata)):
            video_metadata = [video_metadata] * len(video_list)
        all_rows, grids, metas = [], [], []
        for i, (video, meta) in enumerate(zip(video_list, video_metadata)):
            native = meta.get("fps") if meta is not None else None
            frames, sampled = self.sample(video, target_fps, native, f"video {i}")
            rows, grid = self.frames_to_patches(frames)
            all_rows.append(rows)
            grids.append(grid)
            metas.append(sampled)
        data = {
            "pixel_values_videos": np.concatenate(all_rows, axis=0),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
        }
        out = BatchFeature(data=data, tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metas
        return out

    def __call__(self, videos: Any, **kwargs: Any) -> BatchFeature:
        return self.preprocess(videos, **kwargs)

    def get_num_of_video_patches(self, num_frames: int, height: int, width: int, videos_kwargs=None) -> int:
        h, w = self.frame_size(num_frames, height, width)
        grid_t = -(-num_frames // self.temporal_patch_size)
        return grid_t * (h // self.patch_size) * (w // self.patch_size)


class AcceptsTorchFreeVideo(ProcessorMixin):
    """A processor (mixed in before a transformers Qwen processor) that accepts a
    TorchFreeQwen2VLVideoProcessor as its video processor.

    ProcessorMixin checks each part against a class looked up by name on the
    `transformers` module (BaseVideoProcessor in 5.17, VideoProcessorMixin in
    5.19+); neither is our base, and without torchvision neither is exported.
    """

    def check_argument_for_proper_class(self, argument_name: str, argument: Any):
        if argument_name == "video_processor" and isinstance(argument, TorchFreeQwen2VLVideoProcessor):
            return type(argument)
        return super().check_argument_for_proper_class(argument_name, argument)


def assemble_processor(path: str | os.PathLike, processor_class: type[ProcessorMixin],
                       video_processor: TorchFreeQwen2VLVideoProcessor, image_backend: str = "pil", *,
                       min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """A Qwen family's processor, assembled from the folder's parts: tokenizer, image processor
    (images between `min_pixels` and `max_pixels`, None: the folder's), the given
    torchvision-free video processor and chat template.

    Always from parts, so that preprocessing is the same on every machine whether
    torchvision is installed or not. `image_backend="auto"` lets transformers pick the
    image backend (torchvision when installed). Nothing is looked for on the hub.
    """
    from transformers import AutoTokenizer
    # From its module: transformers 5.17's top-level name is a placeholder that demands
    # torchvision even for the PIL backend.
    from transformers.models.auto.image_processing_auto import AutoImageProcessor

    path = Path(path)
    # local_files_only: the folder is checked, and nothing of it is to be looked for on the hub.
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    backend = {} if image_backend == "auto" else {"backend": image_backend}
    image_processor = within_pixel_budget(
        functools.partial(AutoImageProcessor.from_pretrained, path, local_files_only=True, **backend),
        "image", min_pixels, max_pixels,
    )
    chat_template = getattr(tokenizer, "chat_template", None)
    if chat_template is None and (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    if chat_template is None:
        chat_template = _read_json(path / "chat_template.json").get("chat_template")
    return processor_class(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                           chat_template=chat_template)


def within_pixel_budget(load: Callable[..., Any], what: str, min_pixels: int | None, max_pixels: int | None) -> Any:
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


def pixel_pipeline(spec: Any, processor_class: str, image_mean: Sequence[float],
                   image_std: Sequence[float]) -> dict[str, Any]:
    """What a tiny Qwen folder's image and video processor configs share: resize, normalise, patchify
    (their pixel budgets are each family's)."""
    return {
        "processor_class": processor_class,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(image_mean),
        "image_std": list(image_std),
        "resample": 3,  # bicubic
        "patch_size": spec.patch_size,
        "temporal_patch_size": spec.temporal_patch_size,
        "merge_size": spec.spatial_merge_size,
    }
