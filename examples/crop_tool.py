"""A crop-and-zoom tool for "thinking with images" (DeepEyes-style): the model names a box of the
picture and reads it back enlarged. Use it with a dataset whose rows pass their picture to the tool
(verl's `extra_info.tools_kwargs`: {"crop": {"create_kwargs": {"image": <the picture>}}}):

    python train.py --config my.yaml --rollout.tools examples/crop_tool.py:crop --rollout.max_turns 4
"""

from __future__ import annotations

import numpy as np
from PIL import Image

ZOOMED_SIDE = 448  # the crop's longer side after zooming, in pixels (the processor's budget then applies)


def crop(box: list[int], *, image: Image.Image | np.ndarray | str) -> Image.Image:
    """Crop the picture to a box and zoom in, to look at a detail.

    Args:
        box: The box as [left, top, right, bottom], in pixels of the original picture.
    """
    picture = _picture(image)
    if len(box) != 4 or not all(isinstance(v, (int, float)) for v in box):
        raise ValueError(f"box must be four numbers [left, top, right, bottom], got {box!r}")
    left, top, right, bottom = (int(v) for v in box)
    width, height = picture.size
    left, right = max(0, min(left, right)), min(width, max(left, right))
    top, bottom = max(0, min(top, bottom)), min(height, max(top, bottom))
    if right - left < 1 or bottom - top < 1:
        raise ValueError(f"box {box} holds no pixel of the {width}x{height} picture")
    piece = picture.crop((left, top, right, bottom))
    scale = ZOOMED_SIDE / max(piece.size)
    return piece.resize((max(1, round(piece.width * scale)), max(1, round(piece.height * scale))))


def _picture(image: Image.Image | np.ndarray | str) -> Image.Image:
    """The row's picture: a PIL image, an array, or a file path (as verl rows often hold it)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, str):
        return Image.open(image).convert("RGB")
    return Image.fromarray(np.asarray(image, dtype=np.uint8)).convert("RGB")
