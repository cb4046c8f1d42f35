"""The built-in agentic task `look` (rollplex.data.tasks.LookTask) and its tool (rollplex.agent.look): the question
comes without its picture, the `look` tool returns it, and the tiny vocabulary holds the whole call as one token."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from rollplex.agent.look import LOOK_TOOL, look
from rollplex.agent.observation import ObservationRenderer
from rollplex.agent.tools import ToolCall, call_tool, load_tools, parse_tool_call, row_context
from rollplex.data.datasets import PromptDataset
from rollplex.data.processing import hermes_tools_section
from rollplex.data.tasks import COLOURS, ColorTask, LookTask, make_task
from rollplex.tiny_tokenizer import LOOK_CALL, TOOL_TAGS, bytes_tokenizer


def test_the_look_call_is_one_token_that_decodes_to_a_parseable_call(processor):
    tokenizer = processor.tokenizer
    ids = tokenizer(LOOK_CALL, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == LOOK_CALL
    assert parse_tool_call(tokenizer.decode(ids)) == ToolCall("look", {})
    # After a word, and the tags on their own, as Qwen's vocabulary has them.
    ids = tokenizer(f"red {LOOK_CALL}", add_special_tokens=False)["input_ids"]
    assert len(ids) == 2 and tokenizer.decode(ids) == f"red {LOOK_CALL}"
    for tag in TOOL_TAGS:
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    text = "<tool_response>\nred\n</tool_response>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    # The byte-level vocabulary spells the call byte by byte, and reads it back.
    spelled = bytes_tokenizer().encode(LOOK_CALL).ids
    assert len(spelled) == len(LOOK_CALL.encode()) and bytes_tokenizer().decode(spelled) == LOOK_CALL


def test_the_look_tool_returns_the_rows_picture():
    tool = load_tools([LOOK_TOOL])[0]
    assert tool.context_params == ("image",) and tool.schema["function"]["parameters"]["properties"] == {}
    picture = np.full((28, 28, 3), 200, dtype=np.uint8)
    result = call_tool(tool, ToolCall("look", {}), row_context({"look": {"image": picture}}, tool))
    assert result.text == "" and len(result.images) == 1 and np.array_equal(np.asarray(result.images[0]), picture)
    same = Image.fromarray(picture)
    assert look(image=same) is same


def test_the_prompt_holds_the_question_and_the_tool_not_the_picture(processor):
    task = make_task("look")
    assert isinstance(task, LookTask) and task.tools == (LOOK_TOOL,)
    example = task.example(0, processor, seed=3)
    prompt = example.prompt
    assert not prompt.has_vision and "<|image_pad|>" not in prompt.text and "<|vision_start|>" not in prompt.text
    assert task.question in prompt.text
    assert hermes_tools_section([load_tools([LOOK_TOOL])[0].schema]) in prompt.text
    image = example.tools_kwargs["look"]["image"]
    assert image.dtype == np.uint8 and image.shape == (56, 56, 3) and example.answer in COLOURS


def test_the_same_examples_as_the_colour_task_for_a_seed(processor):
    look_task, colour_task = LookTask(), ColorTask()
    for i in range(12):
        example = look_task.example(i, processor, seed=5)
        again = look_task.example(i, processor, seed=5)
        colour = colour_task.example(i, processor, seed=5)
        assert example.answer == again.answer == colour.answer and example.index == i
        assert np.array_equal(example.tools_kwargs["look"]["image"], again.tools_kwargs["look"]["image"])
        assert torch.equal(example.prompt.input_ids, again.prompt.input_ids)
        # The picture the tool gets is the one the colour task shows.
        shown = processor.image_processor(images=[Image.fromarray(example.tools_kwargs["look"]["image"])],
                                          return_tensors="pt")["pixel_values"]
        assert torch.equal(shown, colour.prompt.pixel_values)
    assert not colour_task.example(0, processor, seed=5).tools_kwargs


def test_an_episode_looks_then_answers_in_known_words(processor):
    """prompt, the call (one token), the look's observation (the picture's pads), the answer: no <unk> after the
    prompt, whose tools section the tiny vocabulary mostly lacks."""
    tokenizer = processor.tokenizer
    example = LookTask().example(0, processor, seed=0)
    tool = load_tools([LOOK_TOOL])[0]
    result = call_tool(tool, ToolCall("look", {}), row_context(example.tools_kwargs, tool))
    observation = ObservationRenderer(processor, max_observation_tokens=64).render([result])
    assert observation.prompt.image_grid_thw.tolist() == [[1, 4, 4]] and not observation.truncated
    response = [*tokenizer(LOOK_CALL, add_special_tokens=False)["input_ids"], *observation.prompt.input_ids.tolist(),
                *tokenizer(example.answer, add_special_tokens=False)["input_ids"]]
    assert tokenizer.unk_token_id not in response and len(response) == 1 + 16 + 1


def test_a_verl_rows_tools_and_interaction_kwargs_reach_the_example_unchanged(processor, tmp_path):
    """The data-file counterpart of a task's tools_kwargs: verl's extra_info.tools_kwargs / interaction_kwargs, or
    columns of those names; a row with neither gets empty ones, and one that is no dict is skipped."""
    tools_kwargs = {"look": {"create_kwargs": {"image": "img.png"}}, "crop": {"box": [0, 0, 4, 4]}}
    rows = [
        {"prompt": [{"role": "user", "content": "what colour ?"}], "reward_model": {"ground_truth": "red"},
         "extra_info": {"index": 0, "tools_kwargs": tools_kwargs, "interaction_kwargs": {"name": "game", "seed": 1}}},
        {"prompt": [{"role": "user", "content": "what colour ?"}], "reward_model": {"ground_truth": "red"},
         "tools_kwargs": {"look": {"image": "own.png"}}, "extra_info": {"tools_kwargs": tools_kwargs}},
        {"prompt": [{"role": "user", "content": "what colour ?"}], "reward_model": {"ground_truth": "red"}},
        {"prompt": [{"role": "user", "content": "what colour ?"}], "reward_model": {"ground_truth": "red"},
         "extra_info": {"tools_kwargs": "look"}},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    dataset = PromptDataset(path, processor, max_prompt_length=1024)
    with pytest.warns(UserWarning, match="tools_kwargs must hold a dict"):
        examples = list(dataset)
    assert examples[0].tools_kwargs == tools_kwargs and examples[0].interaction_kwargs == {"name": "game", "seed": 1}
    assert examples[1].tools_kwargs == {"look": {"image": "own.png"}} and examples[1].interaction_kwargs == {}
    assert examples[2].tools_kwargs == {} == examples[2].interaction_kwargs
    assert len(examples) == 3 and dataset.skipped == {"bad_row": 1}
