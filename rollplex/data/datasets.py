"""Prompt datasets from files: JSONL or JSON (native) or parquet (needs the optional `pyarrow`), each named
as itself or by its folder (`data_files`).

Two row layouts, as the common VLM-RL recipes store them:

  EasyR1 / geometry3k:
      {"problem": "<image> Find x.", "answer": "3", "images": ["img/1.png"]}
  verl:
      {"prompt": [{"role": "user", "content": "<image> Find x."}],
       "images": [...], "reward_model": {"ground_truth": "3"}}

`format="auto"` picks the layout per file from its first row. Images are file
paths (relative ones resolve against the data file's folder), encoded bytes, or
{"bytes": ..., "path": ...} dicts as HF datasets store them. Videos are video
files (.mp4, .webm, ...: needs the `video` extra, PyAV), frame folders or lists of
frame paths (see `_videos_of`). A prompt template (EasyR1's format_prompt,
`PromptTemplate`) and a system prompt are applied as a row becomes chat messages.

Rows are read when the dataset is built (so a bad file fails at once, naming the
file and line) but rendered lazily: images are decoded and the chat template
applied only when an example is asked for. A row that cannot be used (its prompt
longer than `max_prompt_length` tokens after image expansion, an image that does
not decode, a missing column, placeholders without their images) is skipped and
counted in `dataset.skipped`; prompts are never truncated. Warnings come per
cause, not per row: one at the first row of each reason, then, once every row has
been read, one summary with a line per reason (how many, the first few file
lines, the setting that fixes it). A dataset without one usable row is an error
that holds that summary.
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rollplex.data.media import FRAME_EXTENSIONS, MISSING, UNDECODABLE, UNUSABLE, MediaLoadError
from rollplex.data.processing import (
    IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, PlaceholderMismatch, prepare_prompt, text_to_messages,
)
from rollplex.data.rows import DATA_FILE_EXTENSIONS, JsonArrayRows, JsonlRows, ParquetRows, read_rows
from rollplex.models.inputs import Prompt

FORMATS = ("auto", "easyr1", "verl")
# verl's own name for the chat-messages column, used when `prompt_key` (EasyR1's
# "problem" by default) is not a column of a verl file.
VERL_PROMPT_KEY = "prompt"
# Dict keys of an image/video item that may hold a file path (HF datasets: "path";
# verl / qwen-vl-utils: "image", "video"; rollplex videos: "frames").
_PATH_KEYS = ("path", "image", "video", "frames")
_SHOWN_ROWS = 3  # rows named in a skip summary's line, per reason
# What mends rows whose image or video fails, by MediaLoadError.problem: a missing file and a corrupt one are told
# apart (their rows are summed up on lines of their own), as their fixes differ.
_MEDIA_FIXES = {
    MISSING: "check the {kind} paths and data.{kind}_key (relative paths start from the data file's folder)",
    UNDECODABLE: "these {kind} files are corrupt or of another type: replace or re-encode them, or drop their rows",
    UNUSABLE: "check what the column data.{kind}_key names holds: {kind} file paths (relative ones start from the "
              "data file's folder) or encoded bytes",
}


@dataclass
class Example:
    """One prompt, ready for rollout."""

    prompt: Prompt  # input_ids + vision tensors + rendered text
    answer: str  # ground truth, for the reward
    index: int  # position in the dataset (for resume / logging)
    # The row's columns but its images and videos, for the reward (verl's data_source, extra_info, ...), with the
    # prompt as the row holds it (text or chat messages) under "prompt". Empty for the synthetic tasks.
    columns: dict[str, Any] = field(default_factory=dict)
    # The pass over the training rows it was drawn in, 0 first (training/epoch); None where there are no passes:
    # validation rows, the synthetic tasks (endless, no example repeats).
    epoch: int | None = None
    # What the row gives a multi-turn episode (rollplex.agent), passed on unchanged: its tools' context, {tool name:
    # {keyword: value}}, and its environment's reset() keyword arguments. From a row's columns of these names, else
    # from verl's extra_info.tools_kwargs / extra_info.interaction_kwargs.
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    interaction_kwargs: dict[str, Any] = field(default_factory=dict)


class RowSkipped(ValueError):
    """`dataset[i]` of a row that cannot be used; `reason` is its key in `dataset.skipped`."""

    def __init__(self, index: int, reason: str, message: str):
        super().__init__(f"row {index} skipped ({reason}): {message}")
        self.index = index
        self.reason = reason


class _BadRow(ValueError):
    """A row that lacks a column or holds the wrong type; `fix` says what mends rows like it."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class _TooLong(ValueError):
    """The rendered prompt is over max_prompt_length tokens."""


@dataclass
class _SkipGroup:
    """The rows skipped for one reason and fix: how many, where the first few are, the first one's error."""

    reason: str
    fix: str
    error: str
    places: list[tuple[Path, str]] = field(default_factory=list)  # (file, "line 3" / "row 2")
    count: int = 0

    def add(self, path: Path, where: str) -> None:
        self.count += 1
        if len(self.places) < _SHOWN_ROWS:
            self.places.append((path, where))

    def line(self) -> str:
        shown = [where if i and path == self.places[i - 1][0] else f"{path.name}, {where}"
                 for i, (path, where) in enumerate(self.places)]
        more = "; ..." if self.count > len(self.places) else ""
        rows = "row" if self.count == 1 else "rows"
        return f"  {self.reason}: {self.count} {rows} ({'; '.join(shown)}{more}): {self.error}; {self.fix}"


@dataclass
class _Source:
    """One data file: its rows, its layout and where its rows start in the dataset."""

    path: Path
    rows: JsonlRows | JsonArrayRows | ParquetRows
    layout: str  # "easyr1" or "verl"
    start: int


# --------------------------------------------------------------------------------------
# Data file names -> data files
# --------------------------------------------------------------------------------------
# A Hugging Face hub dataset as EasyR1 names one: org/name, with @split or not.
_HUB_DATASET = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/(?P<name>[\w.-]+))(?:@(?P<split>[\w.-]+))?")


def data_files(names: Sequence[str | os.PathLike]) -> list[Path]:
    """The data files that data.train_files / val_files name: a file stands for itself, a folder for its .jsonl,
    .json and .parquet files (sorted by name). A name that is neither, but looks like a hub dataset, is an error
    that says how to download it."""
    files: list[Path] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            files += _folder_data_files(path)
        elif not path.exists() and path.suffix.lower() not in DATA_FILE_EXTENSIONS and \
                (hub := _HUB_DATASET.fullmatch(str(name))):
            raise FileNotFoundError(_hub_dataset_message(str(name), hub))
        else:
            files.append(path)  # read_rows names it when it is missing
    return files


def _folder_data_files(folder: Path) -> list[Path]:
    def data_files_in(path: Path) -> list[Path]:
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in DATA_FILE_EXTENSIONS)

    if found := data_files_in(folder):
        return found
    message = f"the folder {folder} holds no data files ({', '.join(DATA_FILE_EXTENSIONS)})"
    if below := sorted(str(sub) for sub in folder.iterdir() if sub.is_dir() and data_files_in(sub)):
        message += f"; these folders in it do: {', '.join(below)}. Name the one (or the files) of your split"
    raise FileNotFoundError(message)


def _hub_dataset_message(name: str, hub: re.Match) -> str:
    local = f"data/{hub['name']}"
    split = f"its {hub['split']!r} split's files" if hub["split"] else "the files of the split you want"
    return (f"data file {name!r} is neither a local file nor a folder; it looks like a Hugging Face hub dataset "
            f"(org/name@split, as EasyR1 names them). Rollplex reads local files only: download it first,\n"
            f"  huggingface-cli download --repo-type dataset {hub['repo']} --local-dir {local}\n"
            f"then set data.train_files (or data.val_files) to {split} there (ls -R {local}), or to a folder that "
            f"holds only them (a folder's {', '.join(DATA_FILE_EXTENSIONS)} files are all read)")


# --------------------------------------------------------------------------------------
# Rows -> prepare_prompt arguments
# --------------------------------------------------------------------------------------
def _resolve_paths(item: Any, folder: Path) -> Any:
    """Make the relative file paths of an image/video item absolute, against `folder`."""
    if isinstance(item, str):
        return item if os.path.isabs(item) else str(folder / item)
    if isinstance(item, list):
        return [_resolve_paths(x, folder) for x in item]
    if isinstance(item, dict):
        return {k: _resolve_paths(v, folder) if k in _PATH_KEYS and isinstance(v, (str, list)) else v
                for k, v in item.items()}
    return item  # bytes (parquet binary columns)


def _images_of(value: Any) -> list[Any]:
    """An image column value -> list of images (a lone image counts as a list of one)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _videos_of(value: Any) -> list[Any]:
    """A video column value -> list of videos.

    A string or dict is one video (a video file or frame folder / {"video"|"frames": ...}).
    A list of strings that all name frame images (.png, .jpg, ...) is the frames of
    one video; any other list (e.g. of .mp4 files) holds one video per entry.
    """
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]
    value = list(value)
    if value and all(isinstance(v, str) and Path(v).suffix.lower() in FRAME_EXTENSIONS for v in value):
        return [value]
    return value


class PromptTemplateError(RuntimeError):
    """data.format_prompt failed to render a prompt: the template's mistake, not the row's, so the run stops on it
    (with the template's line) rather than skip every row."""


class PromptTemplate:
    """EasyR1's format_prompt: a jinja template around each row's prompt, which it gets as `content`.

    `source` names a template file, or else is the template itself; as in EasyR1, its outer whitespace is dropped.
    A render that fails raises PromptTemplateError, naming the template's line.
    """

    def __init__(self, source: str):
        import jinja2
        import jinja2.meta

        text, where = source, "data.format_prompt"
        if _is_file(source):
            text, where = Path(source).read_text(encoding="utf-8"), f"data.format_prompt file {source}"
        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        try:
            variables = jinja2.meta.find_undeclared_variables(env.parse(text.strip()))
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{where}: jinja syntax error on line {e.lineno}: {e.message}") from None
        if variables != {"content"}:
            # A template without `content` would drop every prompt; any other name has no value to take.
            raise ValueError(f"{where} {text.strip()[:80]!r} must use {{{{ content }}}} (the row's prompt) and no "
                             f"other variable; it uses {sorted(variables)} (a template file must exist)")
        self.template = env.from_string(text.strip())
        self.where = where
        self.lines_stripped = text[:len(text) - len(text.lstrip())].count("\n")  # to number lines as the source does

    def __call__(self, prompt: str) -> str:
        try:
            return self.template.render(content=prompt)
        except Exception as e:  # noqa: BLE001 - the template's code may raise anything (TypeError, UndefinedError)
            # jinja puts the template's own frame, named "<template>", into the traceback.
            line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                         if frame.filename == "<template>"), None)
            at = f" at line {line + self.lines_stripped}" if line is not None else ""
            raise PromptTemplateError(f"{self.where} failed to render a prompt{at}: {type(e).__name__}: {e}") from e


def _is_file(name: str) -> bool:
    try:
        return Path(name).is_file()
    except OSError:  # a long template is no valid file name
        return False


def _episode_kwargs(row: dict[str, Any], key: str) -> dict[str, Any]:
    """The row's `key` column, else its verl `extra_info[key]`, as it is; {} when it has neither."""
    extra_info = row.get("extra_info")
    value = row.get(key)
    if value is None and isinstance(extra_info, dict):
        value = extra_info.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _BadRow(f"{key} must hold a dict ({{tool name: kwargs}} for tools_kwargs, keyword arguments for "
                      f"interaction_kwargs), not {type(value).__name__}",
                      f"give these rows' {key} (a column or extra_info.{key}) a dict")
    return value


def _detect_layout(row: dict[str, Any], prompt_key: str, path: Path) -> str:
    prompt = row.get(prompt_key, row.get(VERL_PROMPT_KEY))
    if "reward_model" in row or isinstance(prompt, list):
        return "verl"
    if prompt_key in row:
        return "easyr1"
    raise ValueError(
        f"{path}: cannot tell the dataset layout from the first row's columns {sorted(row)}: expected "
        f"{prompt_key!r} (EasyR1, prompt_key) or {VERL_PROMPT_KEY!r} chat messages + 'reward_model' (verl); "
        f"set format= and prompt_key= / answer_key="
    )


# --------------------------------------------------------------------------------------
# Dataset
# --------------------------------------------------------------------------------------
class PromptDataset:
    """Prompts from data files (JSONL, JSON, parquet, or folders of them: `data_files`), rendered lazily into
    `Example`s.

    `len(dataset)` counts every row, usable or not. `dataset[i]` renders row i (an
    Example whose index is i) or raises `RowSkipped`; iterating yields the usable
    rows in file order (and raises when there is none); `batches` is the training
    stream. `skipped` counts the skipped rows by reason ("too_long", "bad_image",
    "bad_video", "bad_row"), each row once however often it comes round.
    """

    def __init__(
        self,
        files: str | os.PathLike | Sequence[str | os.PathLike],
        processor: Any,
        max_prompt_length: int,
        format: str = "auto",
        prompt_key: str = "problem",
        answer_key: str = "answer",
        image_key: str = "images",
        video_key: str = "videos",
        video_fps: float = 2.0,
        format_prompt: str = "",
        system_prompt: str = "",
        tools: Sequence[dict[str, Any]] = (),
    ):
        """`tools`: the schemas of a multi-turn run's tools (rollplex.agent.tools), which every prompt's chat
        template renders."""
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        if not files:
            raise ValueError("PromptDataset needs at least one file")
        self.processor = processor
        self.max_prompt_length = max_prompt_length
        self.tools = list(tools)
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.image_key = image_key
        self.video_key = video_key
        self.video_fps = video_fps
        self.template = PromptTemplate(format_prompt) if format_prompt else None
        self.system_prompt = system_prompt
        self.sources: list[_Source] = []
        start = 0
        for path in data_files(files):
            rows = read_rows(path)
            layout = _detect_layout(rows[0], prompt_key, path) if format == "auto" else format
            self.sources.append(_Source(path, rows, layout, start))
            start += len(rows)
        self._starts = [s.start for s in self.sources]
        self._length = start
        # What each row turned out to be, learnt as rows are rendered: a bad row is
        # never rendered (or warned about) twice, and resuming skips rows already known.
        self._bad: dict[int, tuple[str, str]] = {}  # index -> (reason, warning message)
        self._good: set[int] = set()
        self.skipped: Counter[str] = Counter()
        self._skip_groups: dict[tuple[str, str], _SkipGroup] = {}  # (reason, fix) -> its rows, for the summary

    def __len__(self) -> int:
        return self._length

    def _locate(self, index: int) -> tuple[_Source, int]:
        if not 0 <= index < self._length:
            raise IndexError(f"row {index} out of range for a dataset of {self._length} rows")
        source = self.sources[bisect.bisect_right(self._starts, index) - 1]
        return source, index - source.start

    def _prompt_and_answer(self, source: _Source, row: dict[str, Any]) -> tuple[Any, str]:
        if source.layout == "verl":
            key = self.prompt_key if self.prompt_key in row else VERL_PROMPT_KEY
            reward_model = row.get("reward_model")
            if isinstance(reward_model, dict) and "ground_truth" in reward_model:
                answer = reward_model["ground_truth"]
            else:
                answer = row.get(self.answer_key)
        else:
            key = self.prompt_key
            answer = row.get(self.answer_key)
        prompt = row.get(key)
        is_messages = isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)
        if not (isinstance(prompt, str) or is_messages):
            found = f"holds {type(prompt).__name__}" if key in row else f"is missing; the row's columns: {sorted(row)}"
            raise _BadRow(f"column {key!r} (data.prompt_key) must hold a prompt string or chat messages "
                          f"({{role, content}} dicts), but {found}", "set data.prompt_key to the prompt's column")
        if answer is None:
            state = "null" if self.answer_key in row else f"missing; the row's columns: {sorted(row)}"
            verl = "no reward_model.ground_truth and " if source.layout == "verl" else ""
            raise _BadRow(f"no answer: {verl}column {self.answer_key!r} (data.answer_key) is {state}",
                          "set data.answer_key to the answer's column")
        return prompt, str(answer)

    def _render(self, index: int) -> Example:
        """Row `index` -> Example. Raises MediaLoadError / ValueError for an unusable row."""
        source, local = self._locate(index)
        row = source.rows[local]
        prompt, answer = self._prompt_and_answer(source, row)
        folder = source.path.parent
        images = [_resolve_paths(x, folder) for x in _images_of(row.get(self.image_key))]
        videos = [_resolve_paths(x, folder) for x in _videos_of(row.get(self.video_key))]
        inputs = prepare_prompt(self.processor, self._messages(prompt), images=images, videos=videos,
                                video_fps=self.video_fps, tools=self.tools or None)
        if len(inputs.input_ids) > self.max_prompt_length:
            raise _TooLong(f"{len(inputs.input_ids)} tokens > max_prompt_length {self.max_prompt_length}")
        columns = {k: v for k, v in row.items() if k not in (self.image_key, self.video_key)}
        return Example(prompt=inputs, answer=answer, index=index, columns={**columns, "prompt": prompt},
                       tools_kwargs=_episode_kwargs(row, "tools_kwargs"),
                       interaction_kwargs=_episode_kwargs(row, "interaction_kwargs"))

    def _messages(self, prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A row's prompt as chat messages, with data.format_prompt and data.system_prompt applied."""
        if isinstance(prompt, str):
            return text_to_messages(self.template(prompt) if self.template else prompt, self.system_prompt or None)
        messages = list(prompt)
        if self.template:
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if not users or not isinstance(messages[users[-1]]["content"], str):
                raise _BadRow("data.format_prompt needs a user message whose content is a string",
                              "unset data.format_prompt, or give these rows' user message a string content")
            messages[users[-1]] = {**messages[users[-1]], "content": self.template(messages[users[-1]]["content"])}
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _cause(self, error: Exception) -> tuple[str, str]:
        """(reason, fix) of an unusable row: its key in `skipped`, and what mends rows like it."""
        if isinstance(error, _TooLong):
            return "too_long", ("raise data.max_prompt_length, or lower data.max_pixels / data.video_max_pixels "
                                "(fewer vision tokens)")
        if isinstance(error, MediaLoadError):
            # processing names a video frame "video i frame j"; anything else is an image.
            kind = "video" if error.name.startswith("video") else "image"
            return f"bad_{kind}", _MEDIA_FIXES[error.problem].format(kind=kind)
        if isinstance(error, PlaceholderMismatch):
            placeholder = IMAGE_PLACEHOLDER if error.kind == "image" else VIDEO_PLACEHOLDER
            key = self.image_key if error.kind == "image" else self.video_key
            return "bad_row", (f"each {placeholder} of a prompt takes one entry of the column data.{error.kind}_key "
                               f"names (now {key!r})")
        if isinstance(error, _BadRow):
            return "bad_row", error.fix
        return "bad_row", "mend or drop these rows"

    def _skip(self, index: int, error: Exception) -> None:
        reason, fix = self._cause(error)
        source, local = self._locate(index)
        where = source.rows.where(local)
        message = f"{source.path}, {where}: skipping row {index} ({reason}): {error}"
        self._bad[index] = (reason, message)
        self.skipped[reason] += 1
        group = self._skip_groups.setdefault((reason, fix), _SkipGroup(reason, fix, str(error)))
        group.add(source.path, where)
        if group.count == 1:
            warnings.warn(f"{message}; {fix}. Later rows like it are not warned about one by one: they are counted "
                          f"and summed up once every row has been read")

    def _sum_up_skipped(self) -> None:
        """Every row is known now: one warning for all the skipped ones (when none is usable, the caller's error
        holds the summary instead)."""
        if self._bad and self._good:
            warnings.warn(f"{len(self._bad)} of {self._length} rows of {self._files()} skipped:\n"
                          f"{self._skip_lines()}")

    def _skip_lines(self) -> str:
        return "\n".join(group.line() for group in self._skip_groups.values())

    def _files(self) -> str:
        return ", ".join(str(s.path) for s in self.sources)

    def _no_usable_rows(self) -> ValueError:
        return ValueError(f"no usable rows in {self._files()}: skipped {dict(self.skipped)}\n{self._skip_lines()}")

    def _try(self, index: int) -> Example | None:
        """Row `index` rendered, or None when it is (now known to be) unusable."""
        if index in self._bad:
            return None
        newly_known = index not in self._good
        try:
            example = self._render(index)
        except (ValueError, TypeError) as e:  # MediaLoadError, _TooLong and _BadRow are ValueErrors
            self._skip(index, e)
            example = None
        else:
            self._good.add(index)
        if newly_known and len(self._good) + len(self._bad) == self._length:  # the last row to become known
            self._sum_up_skipped()
        return example

    def __getitem__(self, index: int) -> Example:
        example = self._try(index)
        if example is None:
            reason, message = self._bad[index]
            raise RowSkipped(index, reason, message)
        return example

    def __iter__(self) -> Iterator[Example]:
        for i in range(self._length):
            example = self._try(i)
            if example is not None:
                yield example
        if len(self._bad) == self._length:
            raise self._no_usable_rows()

    def _order(self, seed: int) -> Iterator[tuple[int, int]]:
        """(epoch, row index) pairs, epoch after epoch, each epoch in its own seeded shuffle."""
        for epoch in itertools.count():
            for index in np.random.default_rng([seed, epoch]).permutation(self._length).tolist():
                yield epoch, index

    def _advance(self, order: Iterator[tuple[int, int]], render: bool) -> Example | None:
        """Take rows from `order` up to and including the next usable one. Returns its
        Example, marked with its epoch, when `render`; otherwise None, and a row already
        known good is not rendered again (fast-forwarding only needs to know which rows are usable)."""
        for epoch, index in order:
            if not render and index in self._good:
                return None
            example = self._try(index)
            if example is not None:
                if not render:
                    return None
                example.epoch = epoch
                return example
            if len(self._bad) == self._length:
                raise self._no_usable_rows()
        raise AssertionError("the row order is endless")

    def batches(self, batch_size: int, seed: int, start_step: int = 0) -> Iterator[list[Example]]:
        """Endless training stream: lists of `batch_size` Examples, epoch after epoch.

        Each epoch visits the rows in a shuffle seeded by (seed, epoch). Skipped rows
        are passed over and the next rows fill the batch, so every batch is full and a
        batch may run into the next epoch. Batch k is the same whatever `start_step`
        the stream began at, so resuming at step k continues a run exactly. To find
        where step k starts, the rows of the earlier batches must be known good or
        bad: in a fresh process that renders (and drops) up to one epoch of rows once.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        order = self._order(seed)
        for _ in range(start_step * batch_size):
            self._advance(order, render=False)
        while True:
            yield [self._advance(order, render=True) for _ in range(batch_size)]
