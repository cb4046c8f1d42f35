"""The built-in `look` tool of the `look` task (rollplex.data.tasks): the question comes without its picture, and
this tool, called with no arguments, returns it.

`image` is keyword-only: row context that the example's `tools_kwargs["look"]` passes (verl's
`extra_info.tools_kwargs`), hidden from the schema the model reads (rollplex.agent.tools), so the model calls
`look` with no arguments.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

# The tool's spec, as rollout.tools names tools (`module:function`).
LOOK_TOOL = "rollplex.agent.look:look"


def look(*, image: np.ndarray | Image.Image) -> Image.Image:
    """Look at the picture the question is about."""
    if isinstance(image, Image.Image):
        return image
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"look's image must be an HxWx3 uint8 array or a PIL image, got {array.dtype} "
                         f"{array.shape}")
    return Image.fromarray(array)
