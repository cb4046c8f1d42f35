"""Where a user's code failed (rollplex.user_code): the traceback from its own frame on and the line a one-line
message names, the user's own file rather than a library it called; a data.format_prompt template that fails
stops the run on its own line, not by skipping every row as if the rows were bad."""

import json
import textwrap

import pytest

from rollplex.data.datasets import PromptDataset, PromptTemplate, PromptTemplateError
from rollplex.data.reward_scoring import RewardScorer
from rollplex.data.rewards import score_of
from rollplex.user_code import last_user_frame, user_traceback


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_the_line_named_is_the_users_own_not_the_library_it_called(tmp_path):
    (tmp_path / "reward.py").write_text(textwrap.dedent("""
        import json

        def reward(response, answer):
            return json.loads(response)["score"]
    """))
    with RewardScorer(f"{tmp_path / 'reward.py'}:reward", workers=0) as scorer:
        scores = scorer.score(["not json"], ["a"], warn=False)
    assert scores.first_error.startswith("JSONDecodeError: Expecting value")
    assert scores.first_error.endswith("(reward.py:5 in reward)")  # json's own frames are below it
    assert f'File "{tmp_path / "reward.py"}", line 5, in reward' in scores.first_traceback
    assert "json/decoder.py" in scores.first_traceback and "rollplex" not in scores.first_traceback


def test_a_reward_file_that_does_not_parse_is_named_with_its_line(tmp_path):
    (tmp_path / "reward.py").write_text("def reward(response, answer):\n    return (\n")
    with pytest.raises(ImportError) as failed:
        RewardScorer(f"{tmp_path / 'reward.py'}:reward", workers=0)
    assert last_user_frame(failed.value) == "reward.py:2"


def test_a_check_of_rollplex_names_no_line_of_the_users():
    with pytest.raises(TypeError) as refused:
        score_of(None)  # Rollplex's own check of a result, called from here as a script would
    assert last_user_frame(refused.value) == ""
    assert "rollplex/data/rewards.py" in user_traceback(refused.value)  # nothing of the user's: all of it


def test_a_failing_format_prompt_stops_on_the_templates_line(processor, tmp_path):
    (tmp_path / "math.jinja").write_text("\n\nSolve:\n{{ content + 1 }}\n")  # line 4 of the file
    data = write_jsonl(tmp_path / "rows.jsonl", [{"problem": "1 + 1 ?", "answer": "2"}])
    dataset = PromptDataset(data, processor, 256, format_prompt=str(tmp_path / "math.jinja"))
    with pytest.raises(PromptTemplateError) as failed:
        dataset[0]  # not skipped as a bad row: every row would be
    assert str(failed.value) == (f"data.format_prompt file {tmp_path / 'math.jinja'} failed to render a prompt at "
                                 f"line 4: TypeError: can only concatenate str (not \"int\") to str")
    assert 'File "<template>", line 2, in top-level template code' in user_traceback(failed.value.__cause__)
    with pytest.raises(PromptTemplateError, match="at line 1: UndefinedError: 'str object' has no attribute"):
        PromptTemplate("{{ content.no_such_attribute }}")("a prompt")
