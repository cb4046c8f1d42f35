"""A tool's answer as the tokens an episode continues with (rollplex.agent.observation), and the tools section of a
prompt (rollplex.data.processing.render_chat): on the tiny checkpoint's processor and Qwen2.5-VL's template."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from rollplex.agent.observation import (
    IMAGE_LEFT_OUT, TRUNCATION_MARKER, ObservationOverLimit, ObservationRenderer, TemplateNotPrefixStable,
)
from rollplex.agent.tools import ToolResult
from rollplex.data.processing import DEFAULT_SYSTEM_PROMPT, ImageInputs, hermes_tools_section, prepare_prompt
from rollplex.models.inputs import Observation
from rollplex.models.loader import read_model_args

LOOK_SCHEMA = {"type": "function", "function": {"name": "look", "description": "Look at the picture.",
                                                "parameters": {"type": "object", "properties": {}}}}
# A template that renders tools itself (and nothing Qwen-like): prepare_prompt must use it as it is.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for tool in tools %} {{ tool.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3's way with tools' answers, in small: consecutive tool messages share one user turn, each in a
# <tool_response>; the last assistant turn shows an empty reasoning block (so [user, assistant] and the same with an
# observation after it render the assistant's turn differently, which the observation does not depend on).
QWEN3_STYLE_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}{%- for item in content %}"
    "{%- if item.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- else %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + render(m.content) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + render(m.content) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TURN_CLOSE, NEXT_TURN = "<|im_end|>\n", "<|im_start|>assistant\n"
COLOURS = "red green blue yellow purple orange white black"
LONG_TEXT = f"{COLOURS} {COLOURS}"


def picture(side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def with_template(processor, template: str):
    other = copy.copy(processor)
    other.chat_template = template
    return other


def pads(processor, prompt) -> int:
    return int((prompt.input_ids == processor.tokenizer.convert_tokens_to_ids(processor.image_token)).sum())


# ----------------------------------------------------------------------------- the tools section of a prompt


def test_a_template_without_tools_gets_qwens_tools_section(processor):
    plain = prepare_prompt(processor, "what colour is the shape ?")
    prompt = prepare_prompt(processor, "what colour is the shape ?", tools=[LOOK_SCHEMA])
    section = hermes_tools_section([LOOK_SCHEMA])
    assert section.startswith("# Tools\n\nYou may call one or more functions") and section.endswith("</tool_call>")
    assert '\n<tools>\n{"type": "function", "function": {"name": "look", ' in section
    system = f"{DEFAULT_SYSTEM_PROMPT}<|im_end|>"
    expected = plain.text.replace(system, f"{DEFAULT_SYSTEM_PROMPT}\n\n{section}<|im_end|>")
    assert prompt.text == expected != plain.text
    assert torch.equal(prompt.input_ids, processor.tokenizer(expected, add_special_tokens=False,
                                                             return_tensors="pt")["input_ids"][0])
    # A system prompt of the row's own (a string or content items) comes first, then the section.
    own = prepare_prompt(processor, "what colour ?", system_prompt="you are red", tools=[LOOK_SCHEMA])
    assert f"<|im_start|>system\nyou are red\n\n{section}<|im_end|>\n" in own.text
    items = [{"role": "system", "content": [{"type": "text", "text": "you are red"}]},
             {"role": "user", "content": "what colour ?"}]
    assert prepare_prompt(processor, items, tools=[LOOK_SCHEMA]).text == own.text


def test_a_template_that_renders_tools_is_used_as_it_is(processor):
    own = with_template(processor, TOOLS_TEMPLATE)
    prompt = prepare_prompt(own, [{"role": "user", "content": "what colour ?"}], tools=[LOOK_SCHEMA])
    assert prompt.text == "TOOLS: look\n<|im_start|>user\nwhat colour ?<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- observations


def test_a_text_observation_continues_the_assistants_turn(processor):
    renderer = ObservationRenderer(processor)
    assert (renderer.turn_close, renderer.generation_prompt) == (TURN_CLOSE, NEXT_TURN)
    after_call = renderer.render([ToolResult("red is the colour")])
    assert after_call.text == f"{TURN_CLOSE}<|im_start|>tool\nred is the colour{TURN_CLOSE}{NEXT_TURN}"
    assert after_call.prompt.text == after_call.text and not after_call.prompt.has_vision
    assert after_call.prompt.input_ids.tolist() == processor.tokenizer(after_call.text,
                                                                       add_special_tokens=False)["input_ids"]
    assert not after_call.truncated and after_call.dropped_images == 0
    # The policy sampled <|im_end|> itself: the observation does not repeat it.
    after_eos = renderer.render([ToolResult("red is the colour")], after_eos=True)
    assert after_eos.text == after_call.text[len("<|im_end|>"):]
    assert after_eos.prompt.input_ids.tolist() == after_call.prompt.input_ids.tolist()[1:]


def test_an_image_observation_has_one_pad_per_merged_patch(processor, tiny_dir):
    renderer = ObservationRenderer(processor)
    rendered = renderer.render([ToolResult("", [picture(56)])])
    assert rendered.text == (f"{TURN_CLOSE}<|im_start|>tool\n<|vision_start|><|image_pad|><|vision_end|>"
                             f"{TURN_CLOSE}{NEXT_TURN}")
    prompt = rendered.prompt
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4]] and len(prompt.pixel_values) == 16
    assert pads(processor, prompt) == 16 // processor.image_processor.merge_size ** 2
    reference = prepare_prompt(processor, "<image>", images=[picture(56)])
    assert torch.equal(prompt.pixel_values, reference.pixel_values)
    observation = Observation.of(prompt, 7, read_model_args(tiny_dir).rope_spec, rendered.text)
    assert observation.positions.shape == (3, len(prompt.input_ids)) and observation.end == 7 + len(prompt.input_ids)


def test_results_of_several_tools_and_an_environment(processor):
    renderer = ObservationRenderer(processor)
    rendered = renderer.render([ToolResult("red", [picture(56, 1)]), ToolResult("blue", [picture(112, 2)])])
    assert rendered.text.count("<|im_start|>tool\n") == 2 and rendered.text.index("red") < rendered.text.index("blue")
    assert rendered.prompt.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 8]]
    assert pads(processor, rendered.prompt) == 4 + 16
    environment = renderer.render([ToolResult("yes")], role="user", after_eos=True)
    assert environment.text == f"\n<|im_start|>user\nyes{TURN_CLOSE}{NEXT_TURN}"


def test_a_template_that_wraps_tool_answers_in_a_user_turn(processor):
    renderer = ObservationRenderer(with_template(processor, QWEN3_STYLE_TEMPLATE))
    rendered = renderer.render([ToolResult("red", [picture(56)]), ToolResult("blue")])
    assert rendered.text == (f"{TURN_CLOSE}<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|>"
                             f"<|vision_end|>red\n</tool_response>\n<tool_response>\nblue\n</tool_response>"
                             f"{TURN_CLOSE}{NEXT_TURN}")
    assert pads(processor, rendered.prompt) == 4 and rendered.prompt.image_grid_thw.tolist() == [[1, 4, 4]]


def test_a_pad_token_in_a_tools_text_makes_no_pad_without_an_image(processor):
    rendered = ObservationRenderer(processor).render([ToolResult("red <|image_pad|> blue")])
    assert pads(processor, rendered.prompt) == 0 and rendered.prompt.pixel_values is None


def test_text_over_the_limit_is_cut_with_a_marker(processor):
    full = ObservationRenderer(processor).render([ToolResult(LONG_TEXT)])
    limit = len(full.prompt.input_ids) - 4
    rendered = ObservationRenderer(processor, limit).render([ToolResult(LONG_TEXT)])
    # Word tokens: as many words as fit beside the marker, to the token.
    assert len(rendered.prompt.input_ids) == limit and rendered.truncated and rendered.dropped_images == 0
    shown = rendered.text.split("<|im_start|>tool\n")[1].split(TRUNCATION_MARKER)[0]
    assert shown and LONG_TEXT.startswith(shown) and shown != LONG_TEXT
    assert rendered.text.startswith(TURN_CLOSE) and rendered.text.endswith(NEXT_TURN)
    # What fits is not cut.
    assert not ObservationRenderer(processor, len(full.prompt.input_ids)).render([ToolResult(LONG_TEXT)]).truncated


def test_an_image_that_does_not_fit_is_left_out_whole_with_a_note(processor):
    big, small = picture(112, 1), picture(56, 2)
    whole = ObservationRenderer(processor).render([ToolResult("red", [big, small])])
    assert pads(processor, whole.prompt) == 16 + 4
    limit = len(whole.prompt.input_ids) - 1
    rendered = ObservationRenderer(processor, limit).render([ToolResult("red", [big, small])])
    assert rendered.dropped_images == 1 and rendered.truncated and len(rendered.prompt.input_ids) <= limit
    assert IMAGE_LEFT_OUT in rendered.text and rendered.text.count("<|image_pad|>") == 1
    # The small image is kept with exactly its own pixels and pads; the text fits whole.
    alone = ImageInputs.of(processor, [small])
    assert torch.equal(rendered.prompt.pixel_values, alone.pixel_values)
    assert rendered.prompt.image_grid_thw.tolist() == [[1, 4, 4]] and pads(processor, rendered.prompt) == 4
    assert "red" in rendered.text and TRUNCATION_MARKER not in rendered.text
    # No image fits: no pad and no pixels are left.
    bare = ObservationRenderer(processor, 20).render([ToolResult("", [big])])
    assert bare.dropped_images == 1 and bare.prompt.pixel_values is None and pads(processor, bare.prompt) == 0


def test_a_limit_below_the_framing_is_a_clear_error(processor):
    with pytest.raises(ObservationOverLimit, match="max_observation_tokens 5"):
        ObservationRenderer(processor, 5).render([ToolResult(COLOURS)])
    with pytest.raises(ValueError, match=">= 0"):
        ObservationRenderer(processor, -1)


def test_a_template_that_does_not_continue_the_turn_is_refused(processor):
    # The assistant's turn is closed only when it is the last message: an observation after it would not close it.
    unclosed = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
                "{% if m.role != 'assistant' or loop.last %}<|im_end|>\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateNotPrefixStable, match="turn close"):
        ObservationRenderer(with_template(processor, unclosed))
    silent = ("{% for m in messages %}<|im_start|>{{ m.role }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateNotPrefixStable, match="does not hold the assistant's content"):
        ObservationRenderer(with_template(processor, silent))
