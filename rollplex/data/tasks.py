"""Built-in synthetic visual tasks, generated on the fly (no files).

  color:     one shape (square / circle / triangle) of one colour on a noisy dark
             background; "what colour is the shape ?" -> a colour word.
  direction: a dot moving left / right / up / down over a few video frames;
             "which direction does the dot move ?" -> a direction word. With more
             or larger frames it is also the prefix-heavy benchmark workload (a
             long video prompt, a one-word answer).
  look:      the colour task's picture behind a tool (agentic, multi-turn): the
             prompt holds the question and the `look` tool's schema, no image; the
             model calls `look` (rollplex.agent.look), which returns the picture,
             then names the colour.

Every word of the questions and answers is in the tiny checkpoint's word
vocabulary, so a tiny model can learn them.

Example i under `seed` is a pure function of (seed, i): its random stream is
seeded by both, so any example can be made alone, in any order, on any rank.
Splits are disjoint index ranges under one seed: training uses indices 0, 1,
2, ... (`task_batches`), validation uses VAL_START, VAL_START + 1, ...
(`validation_examples`), which training never reaches.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from rollplex.agent.look import LOOK_TOOL
from rollplex.data.datasets import Example
from rollplex.data.processing import prepare_prompt
from rollplex.models.inputs import Prompt

# Well apart in RGB, hence after the image processor's per-channel affine
# normalisation too (it only scales each channel by ~1/0.27), and all far above
# the background's 0-59 (black is left out: it would vanish into it).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (40, 200, 60),
    "blue": (40, 80, 235),
    "yellow": (235, 225, 40),
    "purple": (150, 40, 200),
    "orange": (245, 140, 20),
    "white": (240, 240, 240),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
DIRECTIONS: tuple[str, ...] = ("left", "right", "up", "down")
BACKGROUND_MAX = 60  # background pixels are uniform noise in [0, BACKGROUND_MAX)
COLOUR_JITTER = 12  # each example's shape colour is moved by up to this per channel
# Validation indices start here; training would need 2^40 examples to reach them.
VAL_START = 1 << 40
# The smallest side the Qwen2.5-VL processor maps to one merged token (14 px patches, merge 2).
MIN_SIDE = 28


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    return rng.integers(0, BACKGROUND_MAX, (height, width, 3), dtype=np.uint8)


class Task(ABC):
    """A synthetic task: example i under a seed is an image or video prompt and a one-word answer."""

    name: str
    question: str
    answers: tuple[str, ...]  # every possible answer
    # The tools the model may call, as rollout.tools names them (`module:function`); the run loads them.
    tools: tuple[str, ...] = ()

    def example(self, i: int, processor: Any, seed: int) -> Example:
        """Example `i` under `seed`, rendered with the model's processor; deterministic in (seed, i)."""
        if i < 0 or seed < 0:
            raise ValueError(f"example index and seed must be >= 0, got i={i}, seed={seed}")
        media, answer = self.sample(np.random.default_rng([seed, i]))
        return Example(prompt=self.prompt(processor, media), answer=answer, index=i,
                       tools_kwargs=self.tools_kwargs(media))

    @abstractmethod
    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        """Draw one example: (image HxWx3 or video TxHxWx3 uint8, answer word)."""

    @abstractmethod
    def prompt(self, processor: Any, media: np.ndarray) -> Prompt:
        """The question about `media`, rendered with the chat template."""

    def tools_kwargs(self, media: np.ndarray) -> dict[str, dict[str, Any]]:
        """What the example gives its tools besides the model's arguments: {tool name: {keyword: value}}."""
        return {}


class ColorTask(Task):
    """What colour is the one shape in the image."""

    name = "color"
    question = "what colour is the shape ?"
    answers = tuple(COLOURS)

    def __init__(self, image_size: int = 56):
        # 56 px gives the tiny processor a 4x4 patch grid = 4 image tokens.
        if image_size < MIN_SIDE:
            raise ValueError(f"image_size must be >= {MIN_SIDE}, got {image_size}")
        self.image_size = image_size

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        s = self.image_size
        colour = self.answers[rng.integers(len(self.answers))]
        shape = SHAPES[rng.integers(len(SHAPES))]
        base = np.array(COLOURS[colour])
        fill = tuple(int(c) for c in np.clip(base + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3), 0, 255))
        size = int(rng.integers(int(s * 0.3), int(s * 0.55) + 1))
        x0, y0 = (int(v) for v in rng.integers(2, s - size - 1, 2))
        x1, y1 = x0 + size - 1, y0 + size - 1
        img = Image.fromarray(_background(rng, s, s))
        draw = ImageDraw.Draw(img)
        if shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
        return np.asarray(img), colour

    def prompt(self, processor: Any, media: np.ndarray) -> Prompt:
        return prepare_prompt(processor, f"<image> {self.question}", images=[media])


class DirectionTask(Task):
    """Which way a dot moves across the frames of a video."""

    name = "direction"
    question = "which direction does the dot move ?"
    answers = DIRECTIONS

    def __init__(self, num_frames: int = 4, frame_size: int = 56, fps: float = 2.0):
        # Video tokens = ceil(frames / 2) * (side / 28)^2 within the processor's
        # per-frame pixel budget: 4 frames of 56 px give the tiny processor 8; for a
        # prefix-heavy benchmark use e.g. 32 frames of 224 px (1024 tokens with the
        # real Qwen2.5-VL processor).
        if num_frames < 2:
            raise ValueError(f"num_frames must be >= 2 (motion needs two frames), got {num_frames}")
        if frame_size < MIN_SIDE:
            raise ValueError(f"frame_size must be >= {MIN_SIDE}, got {frame_size}")
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        self.num_frames = num_frames
        self.frame_size = frame_size
        self.fps = fps

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, str]:
        s, t = self.frame_size, self.num_frames
        direction = self.answers[rng.integers(len(self.answers))]
        fill = COLOURS[list(COLOURS)[rng.integers(len(COLOURS))]]
        r = max(2, round(s * 0.07))
        travel = s // 2  # the dot crosses half the frame over the clip
        lo, hi = r + 1, s - r - 1  # dot centres that keep the whole dot inside
        # Along the motion: start where the whole path fits; across it: anywhere.
        forward = direction in ("right", "down")
        start = int(rng.integers(lo, hi - travel + 1)) + (0 if forward else travel)
        across = int(rng.integers(lo, hi + 1))
        sign = 1 if forward else -1
        frames = []
        for k in range(t):
            along = start + sign * travel * k / (t - 1)
            cx, cy = (along, across) if direction in ("left", "right") else (across, along)
            img = Image.fromarray(_background(rng, s, s))
            ImageDraw.Draw(img).ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
            frames.append(np.asarray(img))
        return np.stack(frames), direction

    def prompt(self, processor: Any, media: np.ndarray) -> Prompt:
        # The frames are taken at `fps` and sampled at `fps`, so all are kept.
        return prepare_prompt(processor, f"<video> {self.question}", videos=[media], video_fps=self.fps)


class LookTask(ColorTask):
    """The colour task with the picture behind the `look` tool: the prompt holds only the question and the tool's
    schema; the example hands the picture to the tool. Its examples are the colour task's (same pictures and
    answers for the same seed), so a policy that never looks scores 1/7 at best."""

    name = "look"
    tools = (LOOK_TOOL,)

    def __init__(self, image_size: int = 56):
        from rollplex.agent.tools import load_tools

        super().__init__(image_size)
        self.tool_schemas = [tool.schema for tool in load_tools(list(self.tools))]

    def prompt(self, processor: Any, media: np.ndarray) -> Prompt:
        return prepare_prompt(processor, self.question, tools=self.tool_schemas)

    def tools_kwargs(self, media: np.ndarray) -> dict[str, dict[str, Any]]:
        return {"look": {"image": media}}


TASKS: dict[str, type[Task]] = {"color": ColorTask, "direction": DirectionTask, "look": LookTask}


def make_task(name: str, **options: Any) -> Task:
    """The built-in task `name`, with its constructor options (e.g. num_frames=32)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    return TASKS[name](**options)


def task_batches(
    task: Task, processor: Any, batch_size: int, seed: int, start_step: int = 0
) -> Iterator[list[Example]]:
    """Endless training batches, the synthetic counterpart of PromptDataset.batches:
    batch k holds examples k*batch_size ... (k+1)*batch_size - 1, so resuming at a
    step costs nothing."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for step in itertools.count(start_step):
        yield [task.example(step * batch_size + j, processor, seed) for j in range(batch_size)]


def validation_examples(task: Task, processor: Any, n: int, seed: int) -> list[Example]:
    """The first `n` validation examples: indices VAL_START ... VAL_START + n - 1."""
    return [task.example(VAL_START + k, processor, seed) for k in range(n)]
