"""Prompt + images/videos -> a `Prompt`, the model-ready tensors of a model family.

One entry point, `prepare_prompt`, used by the datasets, the built-in tasks, the
benchmarks and tests. It renders the chat template, loads and preprocesses images
and videos (rollplex.data.media) with the run's processor
(rollplex.data.processor, which holds the pixel and frame budgets), expands every
image / video pad token into the text the family's processor writes for it
(`replace_image_token` / `replace_video_token`: Qwen2.5-VL's one pad per merged
vision token, Qwen3-VL's timestamped frame groups) and tokenizes, giving exactly
what the family's processor of transformers gives.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rollplex.data.media import ImageLike, VideoLike, load_image
from rollplex.data.processor import torch_free
from rollplex.models.inputs import Prompt

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"

_PLACEHOLDER_RE = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


class PlaceholderMismatch(ValueError):
    """The prompt's image / video placeholders and the images / videos given do not pair up; `kind` says which
    ("image" or "video"), so that a dataset can name the column to fix."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


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
            raise PlaceholderMismatch(
                kind, f"the prompt has {len(items)} {kind} placeholder(s) ({placeholder} / {kind} content items) "
                f"but {len(given)} {kind}(s) were given"
            )
        return given
    found = []
    for i, item in enumerate(items):
        data = item.get(kind, item.get("image_url") if kind == "image" else None)
        if isinstance(data, dict) and kind == "image" and "url" in data and len(data) == 1:
            data = data["url"]  # OpenAI-style {"image_url": {"url": ...}}
        if data is None:
            raise PlaceholderMismatch(
                kind, f"the prompt has {len(items)} {kind} placeholder(s) but no {kind}s were given "
                f"({kind} item {i} carries no data)"
            )
        found.append(data)
    return found


def _expand_pads(text: str, pad: str, replacements: list[str], kind: str) -> str:
    """`text` with its i-th `pad` replaced by replacements[i], as transformers' processors do it."""
    parts = text.split(pad)
    if len(parts) - 1 != len(replacements):
        raise PlaceholderMismatch(kind, f"the rendered prompt has {len(parts) - 1} {pad} tokens but "
                                        f"{len(replacements)} {kind}(s)")
    out = [parts[0]]
    for replacement, rest in zip(replacements, parts[1:]):
        out.append(replacement)
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
        processor: from `load_processor`, or any transformers processor of a supported
            family (its video processor is made torchvision-free, rollplex.data.processor.torch_free).
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
        PlaceholderMismatch (a ValueError) when placeholders and given media do not match.
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
    elif (pad := processor.image_token) in text:
        raise PlaceholderMismatch("image", f"the rendered prompt has {text.count(pad)} {pad} tokens but no images")
    if video_inputs:
        natives = _native_rates(native_fps, len(video_inputs))
        expanded = _add_videos(processor, video_inputs, natives, video_fps, result, expanded)
    elif (pad := processor.video_token) in text:
        raise PlaceholderMismatch("video", f"the rendered prompt has {text.count(pad)} {pad} tokens but no videos")

    # The template already holds every special token; Qwen's tokenizer adds none.
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    result.input_ids = torch.tensor(ids, dtype=torch.long)
    return result


def _add_images(processor: Any, images: Sequence[ImageLike], result: Prompt, text: str) -> str:
    """Preprocess `images` into `result`; returns `text` with each image's pad token
    replaced by the processor's text for it."""
    pil_images = [load_image(img, f"image {i}") for i, img in enumerate(images)]
    out = processor.image_processor(images=pil_images, return_tensors="pt")
    result.pixel_values = out["pixel_values"]
    result.image_grid_thw = out["image_grid_thw"].long()
    replacements = [processor.replace_image_token(out, i) for i in range(len(pil_images))]
    return _expand_pads(text, processor.image_token, replacements, "image")


def _native_rates(native_fps: float | Sequence[float | None] | None, videos: int) -> list[float | None]:
    if native_fps is None or isinstance(native_fps, (int, float)):
        return [native_fps] * videos
    if len(native_fps) != videos:
        raise ValueError(f"native_fps has {len(native_fps)} entries for {videos} videos")
    return list(native_fps)


def _add_videos(processor: Any, videos: Sequence[VideoLike], natives: list[float | None], video_fps: float,
                result: Prompt, text: str) -> str:
    """Sample and preprocess `videos` into `result`; returns `text` with each video's
    pad token replaced by the processor's text for it (which may read the sampled
    frames' times from their metadata)."""
    vp = torch_free(processor.video_processor)
    rows, grids, metadata = [], [], []
    for i, (video, native) in enumerate(zip(videos, natives)):
        frames, sampled = vp.sample(video, video_fps, native, f"video {i}")
        patches, grid = vp.frames_to_patches(frames)
        rows.append(patches)
        grids.append(grid)
        metadata.append(sampled)
    result.pixel_values_videos = torch.from_numpy(np.concatenate(rows, axis=0))
    result.video_grid_thw = torch.tensor(grids, dtype=torch.long)
    if "second_per_grid_ts" in processor.model_input_names:
        # Seconds per temporal patch, as transformers' Qwen2.5-VL processor computes them.
        result.second_per_grid_ts = torch.tensor([vp.temporal_patch_size / m.sampled_fps for m in metadata],
                                                 dtype=torch.float32)
    inputs = {"video_grid_thw": result.video_grid_thw, "video_metadata": metadata}
    replacements = [processor.replace_video_token(inputs, i) for i in range(len(metadata))]
    return _expand_pads(text, processor.video_token, replacements, "video")
