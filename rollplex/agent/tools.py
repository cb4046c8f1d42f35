"""Tools as plain Python functions, as TRL's `GRPOTrainer(tools=[...])`: the type hints and the Google-style
docstring give the schema the chat template's tool section renders.

    def crop(box: list[int], *, image: PIL.Image.Image) -> PIL.Image.Image:
        \"\"\"Crop the picture to a box.

        Args:
            box: left, top, right, bottom, in pixels.
        \"\"\"

A function's keyword-only parameters (after `*`) are context from the dataset row (verl's
`extra_info.tools_kwargs[tool_name]`, `row_context`), hidden from the model: the schema leaves them
out, so the model calls `crop` with a box only. The other parameters are the model's arguments, and
each needs a type hint and a docstring description.

A call in the model's text is Hermes / Qwen style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(`parse_tool_call`); a tool's answer is text, images or both (`tool_result`). Running calls in worker
processes, with a deadline, is rollplex.agent.workers's.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from rollplex.data.rewards import load_user_object

# verl's tools_kwargs layout: per tool, the kwargs of its create() and execute() (both are context here) and of
# its calc_reward() and release(), which have no counterpart here (the reward function sees the trajectory).
_VERL_KWARGS = ("create_kwargs", "execute_kwargs")
_VERL_OTHER_KWARGS = ("calc_reward_kwargs", "release_kwargs")


@dataclass
class Tool:
    """A tool the model can call: `fn`, and the names of its keyword-only parameters, filled from
    the row (`context_params`), not by the model. Its `schema` is what the chat template renders."""

    name: str
    fn: Callable[..., Any]
    context_params: tuple[str, ...] = ()

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Tool:
        """The tool of `fn`, named as it is. No docstring, a model-facing parameter without a type
        hint or a docstring description, or *args / **kwargs raise a TypeError naming the tool
        (and the parameter)."""
        tool = cls(fn.__name__, fn, tuple(p.name for p in _parameters(fn) if p.kind == p.KEYWORD_ONLY))
        doc = inspect.getdoc(fn)
        if not doc:
            raise TypeError(f"tool {tool.name!r} has no docstring: the model reads it as the tool's description")
        # Imported here: transformers takes ~1 s to import, which only processes that load tools need pay (an
        # environment's workers, which import this module for tool_result, do not). It does not import torch.
        from transformers.utils.chat_template_utils import parse_google_format_docstring

        described = parse_google_format_docstring(doc)[1] or {}
        for parameter in tool.model_params:
            if parameter.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {tool.name!r}: parameter {parameter.name!r} has no type hint (the schema's "
                                f"type); make it keyword-only (after *) if it is the row's context, not the model's")
            if parameter.name not in described:
                raise TypeError(f"tool {tool.name!r}: parameter {parameter.name!r} has no description in the "
                                f"docstring's Args: section (Google style), which the model reads")
        return tool

    @property
    def model_params(self) -> list[inspect.Parameter]:
        """The parameters the model fills: all but the context."""
        return [p for p in _parameters(self.fn) if p.name not in self.context_params]

    @functools.cached_property
    def schema(self) -> dict[str, Any]:
        """{"type": "function", "function": {"name", "description", "parameters"}}: transformers'
        `get_json_schema` of `fn` without its context parameters, which the model never sees (their
        types are often no JSON type: an image). Built on first use: it imports torch, which a
        worker process that only calls the tool need not (`load_tools`)."""
        from transformers.utils.chat_template_utils import get_json_schema

        def model_view() -> None:
            """What get_json_schema reads: the function as the model sees it."""

        annotations = getattr(self.fn, "__annotations__", {})
        model_view.__name__, model_view.__doc__ = self.name, inspect.getdoc(self.fn)
        model_view.__signature__ = inspect.Signature(self.model_params)
        model_view.__annotations__ = {p.name: annotations[p.name] for p in self.model_params}
        model_view.__wrapped__ = self.fn  # get_type_hints resolves string annotations in fn's module
        try:
            return get_json_schema(model_view)
        except Exception as e:  # noqa: BLE001 - transformers' parse errors: a type hint with no JSON type
            raise TypeError(f"tool {self.name!r}: no JSON schema for its arguments: {type(e).__name__}: {e}") from e


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """`fn`'s parameters; *args, **kwargs and positional-only ones raise a TypeError (the model names
    its arguments, and the row's context is keyword-only)."""
    parameters = list(inspect.signature(fn).parameters.values())
    for parameter in parameters:
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise TypeError(f"tool {fn.__name__!r}: parameter {parameter.name!r} ({parameter.kind.description}) is "
                            f"not supported: the model's arguments are named, and the row's context is keyword-only")
    return parameters


def load_tools(specs: list[str], schemas: bool = True) -> list[Tool]:
    """The tools `specs` name, each `path/to/file.py:function` or `package.module:function` (loaded as
    data.reward's user functions are: rollplex.data.rewards.load_user_object). Two tools of one name are
    an error: the model calls them by name. With `schemas`, each tool's schema is built now, so that a
    type hint with no JSON type fails at load, not at the first prompt; a worker process that only
    calls the tools leaves them unbuilt (building one imports torch: ~2 s and ~200 MB a worker)."""
    tools = []
    for spec in specs:
        fn = load_user_object(spec, "tool")
        if not callable(fn):
            raise TypeError(f"tool {spec!r} is a {type(fn).__name__}, not a function")
        tools.append(Tool.of(fn))
        if schemas:
            tools[-1].schema  # noqa: B018 - built for its errors; kept, cached
    names = [tool.name for tool in tools]
    if duplicates := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"tools {', '.join(map(repr, duplicates))} given more than once (rollout.tools: {specs}): "
                         f"the model calls a tool by its function's name, so each name must be one tool's")
    return tools


def row_context(tools_kwargs: Mapping[str, Any] | None, tool: Tool) -> dict[str, Any] | str:
    """The context keyword arguments of `tool` from a row's `tools_kwargs`: verl's layout
    `{"look": {"create_kwargs": {...}, "execute_kwargs": {...}}}` (the two merged) or a flat
    `{"look": {...}}`. Names the tool has no keyword-only parameter for are left out (verl's rows
    carry extras, such as a ground truth, that its tools' create() swallows in **kwargs); a required
    one missing gives an error message instead (the call fails as a tool error)."""
    entry = dict((tools_kwargs or {}).get(tool.name) or {})
    if entry and set(entry) <= {*_VERL_KWARGS, *_VERL_OTHER_KWARGS}:
        entry = {name: value for part in _VERL_KWARGS for name, value in (entry.get(part) or {}).items()}
    entry = {name: value for name, value in entry.items() if name in tool.context_params}
    parameters = inspect.signature(tool.fn).parameters
    missing = [name for name in tool.context_params
               if name not in entry and parameters[name].default is inspect.Parameter.empty]
    if missing:
        return (f"tool {tool.name!r} needs {', '.join(missing)} from the row's tools_kwargs[{tool.name!r}] "
                f"(verl's extra_info.tools_kwargs), which the row does not give")
    return entry


# ----------------------------------------------------------------------------- calls


@dataclass
class ToolCall:
    """A call the model made: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(_TOOL_CALL_OPEN) + r"(.*?)" + re.escape(_TOOL_CALL_CLOSE), re.DOTALL)


def parse_tool_call(text: str) -> ToolCall | str | None:
    """The first tool call in a turn's `text`, Hermes / Qwen style:
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (whitespace around the JSON allowed;
    `arguments` may also be a JSON string holding an object, as some models write it). Only the
    first call of a turn is run, as verl's default max_parallel_calls of 1: the turn ends at its
    closing tag. None when `text` holds no call; an error message (for the model) when it holds
    one that does not parse: bad JSON, no name, arguments that are no object, no closing tag."""
    start = text.find(_TOOL_CALL_OPEN)
    if start < 0:
        return None
    match = _TOOL_CALL.match(text, start)
    if match is None:
        return f"the tool call has no closing {_TOOL_CALL_CLOSE}"
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON: {e}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return 'the tool call must be a JSON object with a "name" (a string) and "arguments" (an object)'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"the tool call's arguments are a string that is not valid JSON: {e}"
    if not isinstance(arguments, dict):
        return f"the tool call's arguments must be a JSON object, not {type(arguments).__name__}"
    return ToolCall(call["name"], arguments)


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> None:
    """Raise a TypeError when `arguments` name a parameter the schema lacks (the context's too) or
    leave out a required one (one without a default, the schema's "required")."""
    known = [p.name for p in tool.model_params]
    if unknown := sorted(set(arguments) - set(known)):
        raise TypeError(f"tool {tool.name!r} has no argument {', '.join(map(repr, unknown))} "
                        f"(its arguments: {', '.join(known) or 'none'})")
    required = [p.name for p in tool.model_params if p.default is inspect.Parameter.empty]
    if missing := [name for name in required if name not in arguments]:
        raise TypeError(f"tool {tool.name!r} needs the argument {', '.join(map(repr, missing))}")


def call_tool(tool: Tool, call: ToolCall, context: Mapping[str, Any]) -> ToolResult:
    """Run `call` on `tool` with the row's `context` (`row_context`): its arguments checked against
    the schema (a TypeError when they do not fit), its return value normalised (`tool_result`)."""
    check_arguments(tool, call.arguments)
    return tool_result(tool.fn(**call.arguments, **context))


# ----------------------------------------------------------------------------- results


@dataclass
class ToolResult:
    """A tool's (or an environment's) answer: text, images, or both."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)


_ACCEPTED = ("a str, a PIL image, a uint8 array (HxWx3 or HxW), a list of those, "
             "a dict {'text': ..., 'images': [...]} / {'image': ...} or a ToolResult")


def tool_result(value: Any) -> ToolResult:
    """What a tool returned, as a ToolResult: a str; a PIL image; a uint8 numpy array, HxWx3 or HxW
    (an image); a list or tuple of those (texts joined by newlines, images in order); a dict with
    "text" and "images" (or "image"); a ToolResult. Anything else raises a TypeError naming its type."""
    if isinstance(value, ToolResult):
        return ToolResult(value.text, [_image(image) for image in value.images])
    if isinstance(value, str):
        return ToolResult(str(value))
    if isinstance(value, (Image.Image, np.ndarray)):
        return ToolResult(images=[_image(value)])
    if isinstance(value, (list, tuple)):
        parts = [tool_result(part) for part in value]
        texts = [part.text for part in parts if part.text]
        return ToolResult("\n".join(texts), [image for part in parts for image in part.images])
    if isinstance(value, Mapping):
        return _dict_result(value)
    raise TypeError(f"a tool returned {_type_name(value)}; a tool returns {_ACCEPTED}")


def _dict_result(value: Mapping[Any, Any]) -> ToolResult:
    if unknown := sorted(map(str, set(value) - {"text", "images", "image"})):
        raise TypeError(f"a tool returned a dict with {', '.join(unknown)}; a dict holds 'text' and 'images' "
                        f"(or 'image')")
    text = value.get("text", "")
    if not isinstance(text, str):
        raise TypeError(f"a tool returned a dict whose 'text' is {_type_name(text)}, not a str")
    images = value.get("images", [])
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"a tool returned a dict whose 'images' is {_type_name(images)}, not a list")
    images = list(images)
    if "image" in value:
        images.insert(0, value["image"])
    return ToolResult(str(text), [_image(image) for image in images])


def _image(value: Any) -> Image.Image:
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and \
            (value.ndim == 2 or (value.ndim == 3 and value.shape[2] == 3)):
        return Image.fromarray(value)
    raise TypeError(f"a tool returned {_type_name(value)} as an image; an image is a PIL image or a uint8 "
                    f"array, HxWx3 or HxW")


def _type_name(value: Any) -> str:
    """What `value` is, for an error: "an int", "a numpy array of float32 shaped (2, 2)", "None"."""
    if isinstance(value, np.ndarray):
        return f"a numpy array of {value.dtype} shaped {value.shape}"
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
