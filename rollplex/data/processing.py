"""Prompt + images/videos -> a `Prompt`, the model-ready tensors of a model family.

One entry point, `prepare_prompt`, used by the datasets, the built-in tasks, the
benchmarks and tests. It renders the chat template (`render_chat`, with the tools
the model may call), loads and preprocesses images and videos (rollplex.data.media)
with the run's processor (rollplex.data.processor, which holds the pixel and frame
budgets), expands every image / video pad token into the text the family's
processor writes for it (`replace_image_token` / `replace_video_token`: Qwen2.5-VL's
one pad per merged vision token, Qwen3-VL's timestamped frame groups) and tokenizes,
giving exactly what the family's processor of transformers gives. The second half,
rendered text + media -> `Prompt` (`prompt_from_rendered`), also makes the tokens of
a tool's answer in a multi-turn episode (rollplex.agent.observation).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
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


# Qwen's Hermes-style tools section (Qwen2.5's and Qwen3's chat templates write it into the system message), for a
# template that renders no tools of its own (Qwen2.5-VL's).
_HERMES_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                      "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_HERMES_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                      "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                      "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
# The system prompt Qwen2-VL's and Qwen2.5-VL's templates write when the messages have none.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def hermes_tools_section(tools: Sequence[dict[str, Any]]) -> str:
    """The tools section Qwen's templates write after the system prompt: one JSON schema a line (as their
    `tool | tojson` writes it, transformers' `json.dumps(..., ensure_ascii=False)`)."""
    schemas = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _HERMES_TOOLS_HEAD + schemas + _HERMES_TOOLS_TAIL


def _with_tools_section(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the Hermes tools section after the system prompt (the default one when there is none)."""
    section = "\n\n" + hermes_tools_section(tools)
    if not messages or messages[0].get("role") != "system":
        return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT + section}, *messages]
    system = messages[0]
    content = system.get("content") or ""
    if isinstance(content, str):
        content = content + section
    else:
        content = [*content, {"type": "text", "text": section}]
    return [{**system, "content": content}, *messages[1:]]


def render_chat(processor: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                tools: Sequence[dict[str, Any]] | None = None) -> str:
    """`messages` through the processor's chat template (the tokenizer's when the processor has none), pads not
    expanded. `tools` (function schemas, transformers' / OpenAI's `{"type": "function", "function": {...}}`) go
    through the template's tools section; a template that ignores them (it renders the same with and without,
    as Qwen2.5-VL's does) gets Qwen's Hermes tools section in its system message instead."""
    renderer = processor if getattr(processor, "chat_template", None) else processor.tokenizer

    def render(conversation: Sequence[dict[str, Any]], **tools_kwargs: Any) -> str:
        return renderer.apply_chat_template(list(conversation), tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **tools_kwargs)

    plain = render(messages)
    if not tools:
        return plain
    with_tools = render(messages, tools=list(tools))
    if with_tools != plain:
        return with_tools
    return render(_with_tools_section(list(messages), tools))


def prepare_prompt(
    processor: Any,
    messages_or_text: str | Sequence[dict[str, Any]],
    images: Sequence[ImageLike] | None = None,
    videos: Sequence[VideoLike] | None = None,
    video_fps: float = 2.0,
    add_generation_prompt: bool = True,
    native_fps: float | Sequence[float | None] | None = None,
    system_prompt: str | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
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
        tools: function schemas the model may call, rendered by the chat template's tools
            section (`render_chat`).

    Raises:
        MediaLoadError (a ValueError) naming an image/frame that cannot be decoded;
        PlaceholderMismatch (a ValueError) when placeholders and given media do not match.
    """
    if isinstance(messages_or_text, str):
        messages = text_to_messages(messages_or_text, system_prompt)
    else:
        messages = _normalize_messages(messages_or_text)
    image_items, video_items = _media_in_messages(messages)
    image_inputs = _resolve_media("image", image_items, images, IMAGE_PLACEHOLDER)
    video_inputs = _resolve_media("video", video_items, videos, VIDEO_PLACEHOLDER)
    text = render_chat(processor, messages, add_generation_prompt, tools)
    return prompt_from_rendered(processor, text, ImageInputs.of(processor, image_inputs), video_inputs,
                                video_fps, native_fps)


@dataclass
class ImageInputs:
    """Images through the processor's image processor: their patch rows, their grids, and the text each one's pad
    token becomes in a prompt (`replace_image_token`). Rows follow the images' order."""

    pixel_values: torch.Tensor  # (patches of every image, C*T*p*p)
    grid_thw: torch.Tensor  # (images, 3) long
    pad_texts: list[str]

    @classmethod
    def of(cls, processor: Any, images: Sequence[ImageLike]) -> ImageInputs | None:
        """`images` (any `load_image` input) preprocessed; None when there are none."""
        if not images:
            return None
        pil_images = [load_image(img, f"image {i}") for i, img in enumerate(images)]
        out = processor.image_processor(images=pil_images, return_tensors="pt")
        pad_texts = [processor.replace_image_token(out, i) for i in range(len(pil_images))]
        return cls(out["pixel_values"], out["image_grid_thw"].long(), pad_texts)

    def select(self, indices: Sequence[int]) -> ImageInputs | None:
        """Only the images at `indices` (in that order); None for none. The image processor treats each image on its
        own (an image's rows are its grid's t*h*w patches), so this equals preprocessing those images alone."""
        if not indices:
            return None
        ends = torch.cumsum(self.grid_thw.prod(-1), 0).tolist()
        starts = [0, *ends[:-1]]
        rows = torch.cat([self.pixel_values[starts[i]:ends[i]] for i in indices])
        return ImageInputs(rows, self.grid_thw[list(indices)], [self.pad_texts[i] for i in indices])


def prompt_from_rendered(
    processor: Any,
    text: str,
    images: ImageInputs | None = None,
    videos: Sequence[VideoLike] = (),
    video_fps: float = 2.0,
    native_fps: float | Sequence[float | None] | None = None,
) -> Prompt:
    """A chat template's rendered `text` (one pad token per image / video) and its media, in pad order, into a
    `Prompt`: every pad expanded into the text the family's processor writes for it, then tokenized. The prompt's
    pads and its media match exactly, or PlaceholderMismatch is raised."""
    result = Prompt(input_ids=torch.empty(0, dtype=torch.long), text=text)
    expanded = text
    if images is not None:
        result.pixel_values = images.pixel_values
        result.image_grid_thw = images.grid_thw
        expanded = _expand_pads(expanded, processor.image_token, images.pad_texts, "image")
    elif (pad := processor.image_token) in text:
        raise PlaceholderMismatch("image", f"the rendered prompt has {text.count(pad)} {pad} tokens but no images")
    if videos:
        natives = _native_rates(native_fps, len(videos))
        expanded = _add_videos(processor, videos, natives, video_fps, result, expanded)
    elif (pad := processor.video_token) in text:
        raise PlaceholderMismatch("video", f"the rendered prompt has {text.count(pad)} {pad} tokens but no videos")

    # The template already holds every special token; Qwen's tokenizer adds none.
    ids = processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    result.input_ids = torch.tensor(ids, dtype=torch.long)
    return result


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
