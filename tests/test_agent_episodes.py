"""A generation's episodes (rollplex.agent.episodes) as the engine drives them: a turn's
tool call runs in a worker and comes back as an observation (text, an image); tools that
raise, hang, return garbage or overflow the observation limit are survived and counted;
a turn without a call ends the episode, max_turns ends one that keeps calling. The
reward function sees the trajectory. The engine calls end_turn / poll / finish; here the
test plays the engine, with the turns' text written out (a scripted policy)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from rollplex.agent.episodes import Agent, episode_metrics
from rollplex.agent.look import LOOK_TOOL
from rollplex.config import RolloutConfig
from rollplex.data.processor import load_processor
from rollplex.data.reward_scoring import RewardScorer
from rollplex.dist import init_distributed
from rollplex.models.loader import read_model_args
from rollplex.models.inputs import Observation, Sample
from rollplex.tiny import TinySpec, write_tiny_files
from rollplex.tiny_tokenizer import IM_END, LOOK_CALL

TOOLS = '''
import time
from PIL import Image


def paint(colour: str) -> Image.Image:
    """Paint a square.

    Args:
        colour: its colour.
    """
    return Image.new("RGB", (56, 56), colour)


def fail() -> str:
    """Run out of paint."""
    raise RuntimeError("out of paint")


def hang() -> str:
    """Take forever."""
    time.sleep(60)


def garbage() -> str:
    """Return what is no observation."""
    return 3.5


def chatter() -> str:
    """Talk at length."""
    return "word " * 400
'''


def call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>{IM_END}'


@pytest.fixture(scope="module")
def bytes_dir(tmp_path_factory):
    """A byte-level tiny tokenizer: any call's JSON round-trips (the word-level one holds only the look call)."""
    folder = tmp_path_factory.mktemp("bytes")
    write_tiny_files(folder, TinySpec(vocab="bytes"))
    return folder


@pytest.fixture(scope="module")
def bytes_processor(bytes_dir):
    return load_processor(bytes_dir)


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> list[str]:
    path = tmp_path_factory.mktemp("tools") / "paint_tools.py"
    path.write_text(TOOLS)
    return [f"{path}:{name}" for name in ("paint", "fail", "hang", "garbage", "chatter")]


def rope_spec(folder):
    return read_model_args(folder).rope_spec


def drain(episodes, keys: set) -> dict:
    """Poll as the engine does when nothing else runs, until every key has its outcome."""
    outcomes = {}
    while keys - set(outcomes):
        outcomes.update(episodes.poll(wait=True))
    return outcomes


def test_failing_tools_are_survived_and_counted(bytes_dir, bytes_processor, tools):
    config = RolloutConfig(tools=tools, tool_workers=2, tool_timeout_s=2.0, max_observation_tokens=256)
    agent = Agent(config, bytes_processor, rope_spec(bytes_dir), tools)
    tokenizer = bytes_processor.tokenizer
    turns = {0: call("paint", '{"colour": "red"}'), 1: call("fail"), 2: call("hang"), 3: call("garbage"),
             4: call("chatter"), 5: call("erase"), 6: "<tool_call>{not json</tool_call>" + IM_END,
             7: call("paint", '{"size": 3}')}
    try:
        episodes = agent.episodes([SimpleNamespace(tools_kwargs={}, interaction_kwargs={})])
        assert episodes.turn_end_ids == frozenset()  # byte tokens: a turn ends at its end-of-turn token
        responses = {(0, i): tokenizer.encode(text) for i, text in turns.items()}
        for key, response in responses.items():
            assert episodes.end_turn(key, response) is None  # each waits for its tool
        start = time.perf_counter()
        outcomes = drain(episodes, set(responses))
        assert time.perf_counter() - start < 20  # the hanging call cost its deadline, not 60 s
    finally:
        agent.close()
    painted = outcomes[0, 0]
    assert isinstance(painted, Observation) and painted.prompt.image_grid_thw.tolist() == [[1, 4, 4]]
    assert painted.start == len(responses[0, 0])
    for i, error in {1: "out of paint", 2: "no answer within 2 s", 3: "float", 5: "erase", 6: "not valid json",
                     7: "size"}.items():
        text = outcomes[0, i].text
        assert "Error" in text and error in text.lower(), (i, text)
    assert len(outcomes[0, 4]) <= 256 and episodes.observations_cut == 1
    logs = {key: episodes.finish(key, Sample(responses[key] + outcome.prompt.input_ids.tolist(), [],
                                             "stop", observations=[outcome]))
            for key, outcome in outcomes.items()}
    assert sum(log.tool_errors for log in logs.values()) == 6 and all(log.tool_calls == 1 for log in logs.values())
    assert all(log.turns == 2 for log in logs.values())
    assert logs[0, 0].messages[0]["content"].startswith("<tool_call>")
    assert logs[0, 0].messages[1] == {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": ""}]}


def test_no_call_ends_the_episode_and_max_turns_ends_a_caller(bytes_dir, bytes_processor, tools):
    config = RolloutConfig(tools=tools, tool_workers=0, max_turns=2)
    agent = Agent(config, bytes_processor, rope_spec(bytes_dir), tools)
    tokenizer = bytes_processor.tokenizer
    episodes = agent.episodes([SimpleNamespace(tools_kwargs={}, interaction_kwargs={})])
    assert episodes.end_turn((0, 0), tokenizer.encode("red" + IM_END)) == "stop"
    first = tokenizer.encode(call("paint", '{"colour": "blue"}'))
    assert episodes.end_turn((0, 1), first) is None
    [(key, observation)] = episodes.poll(wait=True)
    response = first + observation.prompt.input_ids.tolist() + tokenizer.encode(call("paint", '{"colour": "red"}'))
    assert episodes.end_turn((0, 1), response) == "max_turns"  # its second turn, the last allowed, called again
    log = episodes.finish((0, 1), Sample(response, [], "max_turns", observations=[observation]))
    assert (log.turns, log.tool_calls) == (2, 1)
    init_distributed("cpu")  # a group of one: the metrics reduce over the dp ranks
    metrics = episode_metrics([Sample([1], [], "stop"), Sample(response, [], "max_turns",
                                                               observations=[observation], episode=log)], 0.5, None)
    assert metrics["rollout/turns_mean"] == 1.5 and metrics["rollout/tool_calls_mean"] == 0.5
    assert metrics["rollout/observation_tokens_mean"] == len(observation) / 2 and metrics["timing_s/tools"] == 0.5


def test_look_call_is_one_token_and_returns_the_rows_picture(tiny_dir, processor):
    tools = [LOOK_TOOL]
    agent = Agent(RolloutConfig(tools=tools, tool_workers=0), processor, rope_spec(tiny_dir), tools)
    tokenizer = processor.tokenizer
    [call_id] = tokenizer.encode(LOOK_CALL, add_special_tokens=False)
    # A turn ends at a call's closing tag: the tag's own token, or the look call's, whose text ends with it.
    assert agent.turn_end_ids == {call_id, tokenizer.convert_tokens_to_ids("</tool_call>")}
    picture = np.zeros((56, 56, 3), np.uint8)
    episodes = agent.episodes([SimpleNamespace(tools_kwargs={"look": {"image": picture}}, interaction_kwargs={})])
    assert episodes.end_turn((0, 3), [call_id]) is None
    [(key, observation)] = episodes.poll(wait=True)
    assert key == (0, 3) and observation.start == 1 and observation.prompt.image_grid_thw.tolist() == [[1, 4, 4]]
    # The turn ended at the call's closing tag: the observation closes the assistant's turn itself.
    assert observation.text.startswith(IM_END)


def test_the_reward_function_sees_the_trajectory(tmp_path, bytes_processor):
    (tmp_path / "graded.py").write_text(
        "def rollplex_style(response, answer, messages, env_rewards):\n"
        "    return float(response == answer) + len(messages) / 10\n"
        "def verl_style(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return len(kwargs['messages']) + 0.0\n"
        "def trl_style(completions, **kwargs):\n"
        "    return [len(c) + 0.0 for c in completions]\n")
    messages = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "it is red"},
                {"role": "assistant", "content": "red"}]
    episode = SimpleNamespace(messages=messages, rewards=[])
    for name, expected in (("rollplex_style", 1.3), ("verl_style", 3.0), ("trl_style", 3.0)):
        with RewardScorer(f"{tmp_path / 'graded.py'}:{name}", workers=0) as scorer:
            scores = scorer.score(["red"], ["red"], episodes=[episode])
        assert scores.scores == [pytest.approx(expected)], name
