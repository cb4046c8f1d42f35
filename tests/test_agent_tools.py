"""Tools and environments for multi-turn rollouts (rollplex.agent): a tool is a plain function whose
keyword-only parameters are the row's context; the model calls it Hermes / Qwen style; a tool's
answer is text, images or both; calls and environment steps run in worker processes with a
deadline, and whatever a tool does, the run goes on."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from rollplex.agent.environment import EnvironmentRunner, StepResult, load_environment
from rollplex.agent.tools import (Tool, ToolCall, ToolResult, call_tool, load_tools, parse_tool_call, row_context,
                                  tool_result)
from rollplex.agent.workers import ToolFailure, ToolRunner


pytestmark = pytest.mark.usefixtures("time_limit")  # tests/conftest.py: a hanging tool fails its test


def crop(box: list[int], zoom: float = 1.0, *, image: Image.Image) -> Image.Image:
    """Crop the picture to a box.

    Args:
        box: left, top, right, bottom, in pixels.
        zoom: how much to enlarge the crop.
    """
    cropped = image.crop(tuple(box))
    return cropped.resize((int(cropped.width * zoom), int(cropped.height * zoom)))


def test_a_tools_schema_comes_from_its_hints_and_docstring_without_the_rows_context():
    tool = Tool.of(crop)
    assert tool.context_params == ("image",)  # keyword-only: the row's, not the model's
    assert tool.schema == {"type": "function", "function": {
        "name": "crop", "description": "Crop the picture to a box.",
        "parameters": {"type": "object", "required": ["box"], "properties": {
            "box": {"type": "array", "items": {"type": "integer"},
                    "description": "left, top, right, bottom, in pixels."},
            "zoom": {"type": "number", "description": "how much to enlarge the crop."}}}}}

    def look(*, image: np.ndarray) -> Image.Image:
        """Look at the picture the question is about."""

    assert Tool.of(look).schema["function"]["parameters"] == {"type": "object", "properties": {}}

    image = Image.new("RGB", (8, 8))
    cropped = call_tool(tool, ToolCall("crop", {"box": [0, 0, 4, 2], "zoom": 2}), {"image": image})
    assert cropped.images[0].size == (8, 4)
    with pytest.raises(TypeError, match=r"tool 'crop' has no argument 'image'"):  # the model cannot set the context
        call_tool(tool, ToolCall("crop", {"box": [0, 0, 1, 1], "image": None}), {"image": image})
    with pytest.raises(TypeError, match=r"tool 'crop' needs the argument 'box'"):
        call_tool(tool, ToolCall("crop", {}), {"image": image})


TOOLS_FILE = '''
from __future__ import annotations  # string annotations resolve in the file's module

import os
import time

import numpy as np


def echo(text: str) -> str:
    """Say a text back.

    Args:
        text: what to say.
    """
    return text


def paint(colour: str, *, size: int = 4) -> list:
    """A square of one colour, and its name.

    Args:
        colour: red or black.
    """
    return [f"a {colour} square", np.full((size, size, 3), (255, 0, 0) if colour == "red" else 0, np.uint8)]


def misbehave(how: str):
    """Misbehave.

    Args:
        how: raise, hang, crash or garbage.
    """
    if how == "raise":
        raise FileNotFoundError("no picture here")
    if how == "hang":
        time.sleep(600)
    if how == "crash":
        os.abort()
    return 42  # no observation
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


def test_tools_load_from_file_and_module_specs_and_a_name_is_one_tools(tools_file):
    tools = load_tools([f"{tools_file}:echo", f"{tools_file}:paint", "rollplex.agent.look:look"])
    assert [(t.name, t.context_params) for t in tools] == [("echo", ()), ("paint", ("size",)), ("look", ("image",))]
    assert tools[0].schema["function"]["parameters"]["properties"] == {
        "text": {"type": "string", "description": "what to say."}}
    with pytest.raises(ValueError, match=r"tools 'echo' given more than once"):
        load_tools([f"{tools_file}:echo", f"{tools_file}:echo"])
    with pytest.raises(ImportError, match=r"tool '.*my_tools.py:nope': .* has no function 'nope'"):
        load_tools([f"{tools_file}:nope"])


@pytest.mark.parametrize("source, error", [
    ("def f(x: int):\n    '''Do.'''\n", r"tool 'f': parameter 'x' has no description in the docstring's Args"),
    ("def f(x):\n    '''Do.\n\n    Args:\n        x: a thing.\n    '''\n", r"tool 'f': parameter 'x' has no type hint"),
    ("def f(*, image):\n    pass\n", r"tool 'f' has no docstring"),
    ("def f(*args: int):\n    '''Do.'''\n", r"tool 'f': parameter 'args' \(variadic positional\) is not supported"),
])
def test_a_tool_the_model_could_not_call_fails_at_load_naming_it(tmp_path, source, error):
    (tmp_path / "bad_tool.py").write_text(source)
    with pytest.raises(TypeError, match=error):
        load_tools([f"{tmp_path / 'bad_tool.py'}:f"])


def test_a_hint_with_no_json_type_fails_at_load_or_is_an_object(tmp_path):
    """A class of the tool's own has no JSON type: transformers 5.24's get_json_schema refuses it (the tool then
    fails at load, named); 5.17's (the GPU machine's) makes it an object."""
    (tmp_path / "box_tool.py").write_text(BOX_TOOL)
    try:
        [tool] = load_tools([f"{tmp_path / 'box_tool.py'}:f"])
    except TypeError as error:
        assert "tool 'f': no JSON schema for its arguments" in str(error)
    else:
        assert tool.schema["function"]["parameters"]["properties"]["box"]["type"] == "object"


BOX_TOOL = '''
class Box:
    pass


def f(box: Box):
    """Do.

    Args:
        box: a box.
    """
'''


def test_row_context_takes_verls_tools_kwargs_or_a_flat_dict():
    tool = Tool.of(crop)
    image = Image.new("RGB", (2, 2))
    verl = {"crop": {"create_kwargs": {"image": image}, "execute_kwargs": {}, "calc_reward_kwargs": {"x": 1}}}
    assert row_context(verl, tool) == {"image": image}
    assert row_context({"crop": {"image": image}, "other_tool": {"y": 2}}, tool) == {"image": image}
    # The dataset's mistakes are the call's failure (a message for the model and the metrics), not a crash.
    assert "tool 'crop' needs image from the row's tools_kwargs['crop']" in row_context(None, tool)
    # verl rows carry extras their tools' create(**kwargs) swallows: left out.
    assert row_context({"crop": {"create_kwargs": {"image": image, "ground_truth": "red"}}}, tool) == {"image": image}


@pytest.mark.parametrize("text, expected", [
    ('I will look.\n<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>', ToolCall("look", {})),
    ('<tool_call>{"name": "crop", "arguments": {"box": [0, 0, 2, 2]}}</tool_call>',
     ToolCall("crop", {"box": [0, 0, 2, 2]})),
    ('<tool_call>{"name": "crop", "arguments": "{\\"box\\": [1, 1, 3, 3]}"}</tool_call>',  # a JSON string
     ToolCall("crop", {"box": [1, 1, 3, 3]})),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>',
     ToolCall("a", {})),  # the first call only
    ("The answer is red.", None),
])
def test_parse_tool_call(text, expected):
    assert parse_tool_call(text) == expected


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "look", arguments: {}}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'a "name"'),
    ('<tool_call>{"name": "crop", "arguments": [1, 2]}</tool_call>', "arguments must be a JSON object, not list"),
    ('<tool_call>{"name": "crop", "arguments": {}}', "no closing </tool_call>"),
])
def test_a_tool_call_that_does_not_parse_gives_the_model_a_message(text, error):
    assert error in parse_tool_call(text)


def test_tool_result_takes_text_images_or_both():
    red = Image.new("RGB", (2, 2), "red")
    assert tool_result("a red square") == ToolResult("a red square", [])
    assert tool_result(red) == ToolResult("", [red])
    gray = tool_result(np.zeros((3, 5), np.uint8)).images[0]
    assert (gray.size, gray.mode) == ((5, 3), "L")
    mixed = tool_result(["left:", red, ("right:", np.zeros((4, 4, 3), np.uint8))])
    assert mixed.text == "left:\nright:" and [image.size for image in mixed.images] == [(2, 2), (4, 4)]
    assert tool_result({"text": "both", "images": [red]}) == ToolResult("both", [red])
    assert tool_result({"image": red}) == ToolResult("", [red])
    assert tool_result(ToolResult("as is", [red])) == ToolResult("as is", [red])


@pytest.mark.parametrize("garbage, named", [
    (None, "None"), (42, "an int"), (b"bytes", "a bytes"), (np.zeros((2, 2, 3), np.float32), "float32"),
    (np.zeros((2, 2, 4), np.uint8), r"\(2, 2, 4\)"), (["text", None], "None"), ({"txt": "typo"}, "txt"),
])
def test_tool_result_refuses_anything_else_naming_its_type(garbage, named):
    with pytest.raises(TypeError, match=named):
        tool_result(garbage)


def run_all(runner: ToolRunner | EnvironmentRunner) -> dict:
    """Every pending answer, by key."""
    answers = {}
    while runner.pending():
        answers.update(runner.poll(wait=True))
    return answers


def test_tool_calls_run_in_a_worker_process_and_the_run_survives_any_tool(tools_file):
    specs = [f"{tools_file}:{name}" for name in ("echo", "paint", "misbehave")]
    with ToolRunner(specs, workers=1, timeout_s=1.0) as runner:
        runner.submit("echo", ToolCall("echo", {"text": "hi"}), {})  # returns at once
        runner.submit("paint", ToolCall("paint", {"colour": "red"}), {"size": 2})  # the row's context
        for how in ("raise", "garbage", "hang"):
            runner.submit(how, ToolCall("misbehave", {"how": how}), {})
        runner.submit("unknown", ToolCall("zoom", {}), {})
        runner.submit("bad arguments", ToolCall("echo", {"txt": "hi"}), {})
        runner.submit("after the hang", ToolCall("echo", {"text": "still here"}), {})  # on the hung one's replacement
        start = time.monotonic()
        answers = run_all(runner)
        assert time.monotonic() - start < 10
        assert runner.poll(wait=True) == [] and runner.pending() == 0
        runner.submit("crash", ToolCall("misbehave", {"how": "crash"}), {})
        runner.submit("after the crash", ToolCall("echo", {"text": "again"}), {})
        answers.update(run_all(runner))
    assert answers.pop("echo") == ToolResult("hi", [])
    painted = answers.pop("paint")  # the image crossed the process boundary
    assert painted.text == "a red square" and painted.images[0].getpixel((0, 0)) == (255, 0, 0)
    assert answers.pop("after the hang") == ToolResult("still here", [])
    assert answers.pop("after the crash") == ToolResult("again", [])
    assert answers == {
        "raise": ToolFailure("raised", "FileNotFoundError: no picture here"),
        "garbage": ToolFailure("bad_result", "a tool returned an int; a tool returns a str, a PIL image, a uint8 "
                                             "array (HxWx3 or HxW), a list of those, a dict {'text': ..., "
                                             "'images': [...]} / {'image': ...} or a ToolResult"),
        "hang": ToolFailure("timeout", "no answer within 1 s: its worker process was killed"),
        "unknown": ToolFailure("bad_call", "there is no tool 'zoom' (the tools: echo, paint, misbehave)"),
        "bad arguments": ToolFailure("bad_call", "tool 'echo' has no argument 'txt' (its arguments: text)"),
        "crash": ToolFailure("died", "its worker process died (killed by SIGABRT)"),
    }


def test_tool_calls_in_this_process_answer_at_submit(tools_file):
    with ToolRunner([f"{tools_file}:echo", f"{tools_file}:misbehave"], workers=0) as runner:
        runner.submit(1, ToolCall("echo", {"text": "hi"}), {})
        runner.submit(2, ToolCall("misbehave", {"how": "raise"}), {})
        assert runner.pending() == 2
        assert runner.poll(wait=False) == [(1, ToolResult("hi", [])),
                                           (2, ToolFailure("raised", "FileNotFoundError: no picture here"))]


def test_a_tool_file_that_does_not_load_fails_at_the_runners_start(tmp_path):
    (tmp_path / "broken.py").write_text("import not_a_real_package_qq\n")
    with pytest.raises(ImportError, match=r"in a worker process: ImportError.*not_a_real_package_qq"):
        ToolRunner([f"{tmp_path / 'broken.py'}:f"], workers=1)


ENVIRONMENT_FILE = '''
import time

import numpy as np


class Guess:
    """Guess a number; each wrong guess is told higher or lower, with a picture as dark as the gap."""

    def reset(self, *, target: int, hang_at: int = -1):
        self.target, self.hang_at, self.guesses = target, hang_at, 0

    def step(self, action: str):
        self.guesses += 1
        if self.guesses == self.hang_at:
            time.sleep(600)
        guess = int(action)
        if guess == self.target:
            return "right", 1.0, True
        gap = np.full((2, 2), 255 - 25 * abs(guess - self.target), np.uint8)
        return ["higher" if guess < self.target else "lower", gap], -0.1, False


class Broken:
    def reset(self):
        raise RuntimeError("no board")

    def step(self, action: str):
        return "", 0.0, False


class Chatty(Broken):
    def reset(self):
        return "Welcome!"  # TRL's text for the prompt, which was rendered before the episode started
'''


@pytest.fixture
def environment_file(tmp_path):
    path = tmp_path / "guess.py"
    path.write_text(ENVIRONMENT_FILE)
    return path


@pytest.mark.parametrize("workers", [0, 1])
def test_environment_episodes_keep_their_state_from_reset_to_done(environment_file, workers):
    with EnvironmentRunner(f"{environment_file}:Guess", workers=workers, timeout_s=10) as runner:
        for episode, target in (("a", 3), ("b", 7)):
            runner.start(episode, {"target": target})  # the row's interaction_kwargs
        assert runner.poll(wait=False) == [] and runner.pending() == 0  # a start answers nothing
        runner.step("a", "5")
        runner.step("b", "5")
        first = run_all(runner)
        runner.step("a", "3")
        last = run_all(runner)
    assert first["a"].observation.text == "lower" and first["b"].observation.text == "higher"
    assert first["a"].observation.images[0].getpixel((0, 0)) == 205
    assert (first["a"].reward, first["a"].done) == (-0.1, False)
    assert last == {"a": StepResult(ToolResult("right", []), 1.0, True)}


def test_an_environment_step_past_the_deadline_loses_its_workers_episodes(environment_file):
    with EnvironmentRunner(f"{environment_file}:Guess", workers=1, timeout_s=1.0) as runner:
        runner.start("hangs", {"target": 3, "hang_at": 1})
        runner.start("beside it", {"target": 3})  # in the same worker
        runner.step("hangs", "1")
        timed_out = ToolFailure("timeout", "no answer within 1 s: its worker process was killed")
        assert run_all(runner) == {"hangs": timed_out}
        runner.step("beside it", "3")
        lost = run_all(runner)["beside it"]
        assert lost == ToolFailure("died", "the episode's environment was lost with its worker process "
                                           "(no answer within 1 s: its worker process was killed)")
        runner.end("hangs")
        runner.end("beside it")
        runner.start("new", {"target": 3})  # on the replacement
        runner.step("new", "3")
        assert run_all(runner)["new"].done


def test_an_environment_reset_that_raises_fails_its_steps(environment_file):
    with EnvironmentRunner(f"{environment_file}:Broken", workers=0) as runner:
        runner.start("a", {})
        runner.step("a", "go")
        assert runner.poll() == [("a", ToolFailure("raised", "its environment's reset: RuntimeError: no board"))]


def test_a_text_from_an_environments_reset_warns_that_it_is_not_shown(environment_file):
    with EnvironmentRunner(f"{environment_file}:Chatty", workers=0) as runner:
        with pytest.warns(UserWarning, match=r"Chatty.reset returned str 'Welcome!', which is not shown"):
            runner.start("a", {})
        runner.step("a", "go")
        assert runner.poll() == [("a", StepResult(ToolResult("", []), 0.0, False))]


def test_an_environment_class_is_checked_at_load(tmp_path):
    (tmp_path / "envs.py").write_text("class NoStep:\n    def reset(self):\n        pass\n\n"
                                      "class NeedsArgs:\n    def __init__(self, size):\n        pass\n"
                                      "    def reset(self):\n        pass\n    def step(self, action):\n        pass\n")
    with pytest.raises(TypeError, match=r"class NoStep has no step; an environment has reset\(\*\*row_kwargs\)"):
        load_environment(f"{tmp_path / 'envs.py'}:NoStep")
    with pytest.raises(TypeError, match=r"NeedsArgs\(\) needs size; an environment is made with no arguments"):
        load_environment(f"{tmp_path / 'envs.py'}:NeedsArgs")
