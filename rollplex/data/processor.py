"""A model folder's processor, of whichever family the folder's config.json names.

The processor is family-specific (rollplex.models.<family>.processor: its classes,
(built on rollplex.data.qwen2_vl_processor),
its frame sampling and sizing, its placeholder text); what is the same for every
family is here: which files a folder must hold, the choice of the family by
config.json's `model_type` (rollplex.models.registry), and `torch_free`, which
the data side calls to get a video processor that runs without torchvision.

What the data side (rollplex.data.processing) calls on a processor, so what a new
family's must provide: transformers' processor API (`tokenizer`, `image_processor`,
`video_processor`, `apply_chat_template`, `image_token` / `video_token`,
`replace_image_token` / `replace_video_token`, `model_input_names`), with a video
processor that `torch_free` accepts: a TorchFreeQwen2VLVideoProcessor (`sample`,
`frames_to_patches`, `temporal_patch_size`), or a transformers video processor one stands in for.

Pixel and frame budgets (least/most pixels per image, most pixels per video frame,
most frames per video) are settings of the processors: `load_processor` sets them,
so every prompt made with that processor keeps to them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rollplex.models.loader import CONFIG_NAME, check_model_folder, has_file
from rollplex.data.qwen2_vl_processor import TorchFreeQwen2VLVideoProcessor
from rollplex.models.registry import family_of_config


def _has_tokenizer(folder: Path) -> bool:
    return has_file("tokenizer.json")(folder) or all(has_file(f)(folder) for f in ("vocab.json", "merges.txt"))


# What load_processor reads of a model folder, each with its test: the files transformers would otherwise
# look for on the hub, failing with its own errors (the weights: rollplex.models.loader.WEIGHT_FILES).
PROCESSOR_FILES = {
    CONFIG_NAME: has_file(CONFIG_NAME),
    "tokenizer.json (or vocab.json and merges.txt)": _has_tokenizer,
    "preprocessor_config.json": has_file("preprocessor_config.json"),
}


def load_processor(
    path: str | os.PathLike,
    image_backend: str = "pil",
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    video_max_pixels: int | None = None,
    video_max_frames: int | None = None,
) -> Any:
    """The processor of a model folder, without torchvision: its family's (by config.json's
    model_type), assembled from the folder's parts so that preprocessing is the same on
    every machine whether torchvision is installed or not. `image_backend="auto"` lets
    transformers pick the image backend (torchvision when installed).

    `path` must be a local folder holding PROCESSOR_FILES (else a CheckpointError says
    what it lacks), of a supported family (else a CheckpointError names the supported
    ones); nothing is looked for on the hub.

    Budgets (None: the folder's value): an image is resized, keeping its aspect ratio,
    to between `min_pixels` and `max_pixels` pixels (rounded to whole merged patches,
    one vision token each); a video frame to at most `video_max_pixels`; a video keeps
    at most `video_max_frames` frames. The family's load_processor says how its folder's
    own values read.
    """
    path = check_model_folder(path, PROCESSOR_FILES)
    config = path / CONFIG_NAME
    family = family_of_config(json.loads(config.read_text()), str(config))
    return family.load_processor(path, image_backend, min_pixels=min_pixels, max_pixels=max_pixels,
                                 video_max_pixels=video_max_pixels, video_max_frames=video_max_frames)


def torch_free(vp: Any) -> TorchFreeQwen2VLVideoProcessor:
    """A processor's video processor that runs without torchvision: `vp` itself when it is one;
    a transformers video processor (e.g. loaded by AutoProcessor with torchvision) gives its
    numbers to the torchvision-free one of its family, which does the work.

    Every family's torchvision-free video processor derives from Qwen2-VL's (as transformers'
    Qwen video processors do), which finds the one standing in for `vp`'s class."""
    return TorchFreeQwen2VLVideoProcessor.stand_in(vp)
