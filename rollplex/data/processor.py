"""The Qwen2.5-VL processor, without torchvision, with pixel and frame budgets.

transformers 5's Qwen2-VL *video* processor (and every BaseVideoProcessor) needs
torchvision, which cannot be installed beside the CPU torch we test with, so
`AutoProcessor.from_pretrained` of any Qwen2.5-VL directory fails without it.
`load_processor` assembles the same `Qwen2_5_VLProcessor` from its parts with a
torchvision-free video processor defined here. It does the video path with the
PIL image processor: a Qwen2-VL image is a video of `temporal_patch_size`
identical frames, so frames are resized / rescaled / normalised / patchified by
the image processor (one frame per temporal patch) and only the temporal grouping
is ours. Images and videos thus share one pixel pipeline, on every machine, with
or without torchvision.

Pixel and frame budgets (least/most pixels per image, most pixels per video frame,
most frames per video) are settings of the processors: `load_processor` sets them,
so every prompt made with that processor keeps to them.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import Qwen2_5_VLProcessor
from transformers.image_processing_utils import BaseImageProcessor

from rollplex.data.media import is_single_video, sample_video
from rollplex.models.loader import CONFIG_NAME, check_model_folder, has_file


def _has_tokenizer(folder: Path) -> bool:
    return has_file("tokenizer.json")(folder) or all(has_file(f)(folder) for f in ("vocab.json", "merges.txt"))


# What load_processor reads of a model folder, each with its test: the files transformers would otherwise
# look for on the hub, failing with its own errors (the weights: rollplex.models.loader.WEIGHT_FILES).
PROCESSOR_FILES = {
    CONFIG_NAME: has_file(CONFIG_NAME),
    "tokenizer.json (or vocab.json and merges.txt)": _has_tokenizer,
    "preprocessor_config.json": has_file("preprocessor_config.json"),
}


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
        video_list = [videos] if is_single_video(videos) else list(videos)
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

    `path` must be a local folder holding PROCESSOR_FILES (else a CheckpointError says
    what it lacks); nothing is looked for on the hub.

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

    path = check_model_folder(path, PROCESSOR_FILES)
    # local_files_only: the folder is checked, and nothing of it is to be looked for on the hub.
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    backend = {} if image_backend == "auto" else {"backend": image_backend}
    image_processor = _within_pixel_budget(
        functools.partial(AutoImageProcessor.from_pretrained, path, local_files_only=True, **backend),
        "image", min_pixels, max_pixels,
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


def torch_free(vp: Any) -> TorchFreeQwen2VLVideoProcessor:
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
        max_frames=getattr(vp, "max_frames", None),  # transformers' frame cap, where it has one
    )
