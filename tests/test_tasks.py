"""Synthetic tasks: classes, determinism, token counts, vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.image_utils import OPENAI_CLIP_MEAN as IMAGE_MEAN, OPENAI_CLIP_STD as IMAGE_STD

from rollplex.data.tasks import (
    BACKGROUND_MAX,
    COLOURS,
    VAL_START,
    ColorTask,
    DirectionTask,
    Task,
    make_task,
    task_batches,
    validation_examples,
)


def _same_prompt(a, b) -> bool:
    fields = ("input_ids", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def _pads(processor, example, token: str) -> int:
    return int((example.prompt.input_ids == processor.tokenizer.convert_tokens_to_ids(token)).sum())


@pytest.mark.parametrize("name", ["color", "direction"])
def test_examples_cover_every_class_and_are_deterministic(processor, name):
    task = make_task(name)
    examples = [task.example(i, processor, seed=0) for i in range(40)]
    assert {e.answer for e in examples} == set(task.answers)
    assert [e.index for e in examples] == list(range(40))
    again = task.example(7, processor, seed=0)
    assert again.answer == examples[7].answer and _same_prompt(again.prompt, examples[7].prompt)
    # Another index or another seed is another example.
    assert not _same_prompt(examples[7].prompt, examples[8].prompt)
    assert not _same_prompt(task.example(7, processor, seed=1).prompt, examples[7].prompt)


@pytest.mark.parametrize("name", ["color", "direction"])
def test_words_in_vocabulary_and_pads_match_grid(processor, name):
    task = make_task(name)
    tok = processor.tokenizer
    merge2 = processor.image_processor.merge_size ** 2
    for answer in task.answers:
        assert tok.convert_tokens_to_ids(answer) != tok.unk_token_id, answer
    example = task.example(0, processor, seed=3)
    assert tok.unk_token_id not in example.prompt.input_ids.tolist()
    assert task.question in example.prompt.text
    if name == "color":
        grid = example.prompt.image_grid_thw
        assert grid.tolist() == [[1, 4, 4]] and example.prompt.pixel_values_videos is None
        assert _pads(processor, example, "<|image_pad|>") == int(grid.prod()) // merge2 == 4
    else:
        grid = example.prompt.video_grid_thw
        assert grid.tolist() == [[2, 4, 4]] and example.prompt.pixel_values is None
        assert _pads(processor, example, "<|video_pad|>") == int(grid.prod()) // merge2 == 8


def test_colours_distinct_after_normalisation():
    mean, std = np.array(IMAGE_MEAN), np.array(IMAGE_STD)
    normed = {c: (np.array(rgb) / 255 - mean) / std for c, rgb in COLOURS.items()}
    names = list(normed)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert np.linalg.norm(normed[a] - normed[b]) > 1.0, (a, b)
    assert "black" not in COLOURS and ColorTask.answers == tuple(COLOURS)


def test_colour_image_shows_its_colour():
    task = ColorTask()
    for i in range(20):
        img, colour = task.sample(np.random.default_rng([0, i]))
        assert img.shape == (56, 56, 3) and img.dtype == np.uint8
        shape = img.max(-1) >= BACKGROUND_MAX
        assert shape.sum() > 40
        assert np.abs(img[shape].mean(0) - COLOURS[colour]).max() < 20


def test_dot_moves_in_the_answer_direction():
    task = DirectionTask(num_frames=5)
    seen = set()
    for i in range(20):
        video, direction = task.sample(np.random.default_rng([0, i]))
        assert video.shape == (5, 56, 56, 3)
        centres = []
        for frame in video:
            ys, xs = np.nonzero(frame.max(-1) >= BACKGROUND_MAX)
            centres.append((xs.mean(), ys.mean()))
        dx, dy = np.subtract(centres[-1], centres[0])
        moved = {"right": dx, "left": -dx, "down": dy, "up": -dy}[direction]
        assert moved > 20 and abs(dy if direction in ("left", "right") else dx) < 1
        seen.add(direction)
    assert seen == {"left", "right", "up", "down"}


def test_more_and_larger_frames_mean_more_video_tokens(processor):
    small = DirectionTask().example(0, processor, seed=0).prompt
    big = DirectionTask(num_frames=8, frame_size=112).example(0, processor, seed=0).prompt
    assert big.video_grid_thw.tolist() == [[4, 8, 8]]
    assert len(big.input_ids) - len(small.input_ids) == (4 * 8 * 8 - 2 * 4 * 4) // 4


def test_make_task_errors_and_options():
    with pytest.raises(ValueError, match="unknown task 'colour'.*color, direction"):
        make_task("colour")
    task = make_task("direction", num_frames=6, frame_size=84)
    assert isinstance(task, DirectionTask) and isinstance(task, Task) and task.num_frames == 6
    with pytest.raises(ValueError, match="num_frames"):
        DirectionTask(num_frames=1)
    with pytest.raises(ValueError, match="image_size"):
        ColorTask(image_size=10)


def test_batches_resume_and_validation_split(processor):
    task = ColorTask()
    stream = task_batches(task, processor, batch_size=3, seed=5)
    first = [next(stream) for _ in range(3)]
    assert [e.index for b in first for e in b] == list(range(9))
    resumed = next(task_batches(task, processor, batch_size=3, seed=5, start_step=2))
    assert [e.answer for e in resumed] == [e.answer for e in first[2]]
    assert all(_same_prompt(a.prompt, b.prompt) for a, b in zip(resumed, first[2]))
    val = validation_examples(task, processor, 4, seed=5)
    assert [e.index for e in val] == [VAL_START + k for k in range(4)]
    assert not any(_same_prompt(v.prompt, e.prompt) for v in val for b in first for e in b)
