"""examples/crop_tool.py under a scripted policy: the turns a model would write, played through a
generation's episodes (rollplex.agent.episodes) as the engine drives them."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rollplex.agent.episodes import Agent
from rollplex.config import RolloutConfig
from rollplex.models.inputs import Observation
from rollplex.tiny_tokenizer import IM_END
from test_agent_episodes import bytes_dir, bytes_processor, drain, rope_spec  # noqa: F401

CROP = f"{Path(__file__).parent.parent / 'examples' / 'crop_tool.py'}:crop"


def test_crop_tool_zooms_into_the_box_and_refuses_an_empty_one(bytes_dir, bytes_processor):  # noqa: F811
    picture = np.zeros((200, 300, 3), np.uint8)
    picture[50:100, 100:200] = (255, 0, 0)  # a red patch the policy zooms into
    agent = Agent(RolloutConfig(tools=[CROP], tool_workers=1), bytes_processor, rope_spec(bytes_dir), [CROP])
    tokenizer = bytes_processor.tokenizer
    assert "box" in agent.schemas[0]["function"]["parameters"]["properties"]
    assert "image" not in agent.schemas[0]["function"]["parameters"]["properties"]  # row context, hidden
    row = SimpleNamespace(tools_kwargs={"crop": {"create_kwargs": {"image": picture}}}, interaction_kwargs={})
    turns = {0: '<tool_call>\n{"name": "crop", "arguments": {"box": [100, 50, 200, 100]}}\n</tool_call>',
             1: '<tool_call>\n{"name": "crop", "arguments": {"box": [400, 300, 500, 350]}}\n</tool_call>'}
    try:
        episodes = agent.episodes([row])
        responses = {(0, i): tokenizer.encode(text + IM_END) for i, text in turns.items()}
        for key, response in responses.items():
            assert episodes.end_turn(key, response) is None
        outcomes = drain(episodes, set(responses))
    finally:
        agent.close()
    zoomed = outcomes[0, 0]
    assert isinstance(zoomed, Observation) and zoomed.prompt.image_grid_thw is not None
    t, h, w = zoomed.prompt.image_grid_thw[0].tolist()
    assert w > h  # the 100x50 box, zoomed, stays wider than high (the processor rounds to its patches)
    assert "holds no pixel" in outcomes[0, 1].text
    # The policy's answer after the zoom ends the episode.
    answer = responses[0, 0] + zoomed.prompt.input_ids.tolist() + tokenizer.encode("red" + IM_END)
    assert episodes.end_turn((0, 0), answer) == "stop"
