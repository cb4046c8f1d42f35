"""Reward functions, by hand-written cases; user functions loaded from files and modules."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from rollplex.data.rewards import (
    exact_match,
    extract_math_answer,
    format_reward,
    last_boxed,
    load_reward,
    math_answer,
    score_all,
)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("red", "red", 1.0),
        ("Red.", "red", 1.0),
        ("  red <|im_end|>", "Red", 1.0),  # the tiny tokenizer's decode, special token kept
        ("red<|im_end|><|endoftext|>", "red", 1.0),
        ("light  blue !", "Light blue", 1.0),
        ("<think> it looks warm </think> red", "red", 1.0),
        ("<think> hmm </think><answer>left</answer><|im_end|>", "left", 1.0),
        ("blue", "red", 0.0),
        ("red red", "red", 0.0),
        ("the answer is red", "red", 0.0),
        ("<|im_end|>", "", 0.0),
        ("", "red", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert exact_match(response, answer) == expected


def test_last_boxed_and_extraction():
    assert last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert last_boxed(r"\boxed{unclosed") is None and last_boxed("none") is None
    assert extract_math_answer(r"so x = \boxed{3}. Answer: 4") == "3"
    assert extract_math_answer("<think>2+2</think><answer> 4 </answer>") == "4"
    assert extract_math_answer("work...\nAnswer: 12 cm\nthanks") == "12 cm"
    assert extract_math_answer("first 3, then 4.5 and -7/2.") == "-7/2"
    assert extract_math_answer("no idea") == ""


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        (r"so \boxed{3}", "3", 1.0),
        (r"\boxed{3.0}<|im_end|>", "3", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
        ("Answer: 50%", "0.5", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{30^\circ}", "30", 1.0),
        (r"\boxed{\text{B}}", "B", 1.0),
        ("the sides are 3 and 4, so 5", "5", 1.0),
        (r"\boxed{4}", r"\boxed{4}", 1.0),  # a boxed ground truth
        (r"\boxed{3}", "4", 0.0),
        (r"\boxed{1/3}", "0.33", 0.0),
        ("no number here", "3", 0.0),
        (r"\boxed{}", "3", 0.0),
    ],
)
def test_math_answer(response, answer, expected):
    assert math_answer(response, answer) == expected


def test_math_answer_symbolic_with_math_verify():
    pytest.importorskip("math_verify")
    assert math_answer(r"\boxed{x+1}", "1+x") == 1.0
    assert math_answer(r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}") == 1.0
    assert math_answer(r"\boxed{x+2}", "1+x") == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>a b</think> red<|im_end|>", 1.0),
        ("<think>a</think><answer>red</answer>", 1.0),
        ("<think>\nline\n</think>\n<answer>\n42\n</answer>\n", 1.0),
        ("<think>a</think>", 0.0),  # no answer
        ("<think>a</think><answer> </answer>", 0.0),
        ("red", 0.0),
        ("<answer>red</answer>", 0.0),
        ("<think>a</think> red</think>", 0.0),
        ("<think><think>a</think> red", 0.0),
        ("<think>a</think><answer>red</answer> more", 0.0),
        ("<think>a</think><answer>red", 0.0),
        ("so <think>a</think> red", 0.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward(response) == expected


def test_load_builtins_and_errors(tmp_path):
    assert load_reward("exact_match") is exact_match
    assert load_reward("math") is math_answer
    assert load_reward("format")("<think>a</think> b", "ignored") == 1.0
    with pytest.raises(ValueError, match="unknown reward 'exact'.*exact_match, math, format"):
        load_reward("exact")
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_reward("no_such_module_xyz:score")
    with pytest.raises(ImportError, match="math has no function 'nope'"):
        load_reward("math:nope")
    with pytest.raises(TypeError, match="not a function"):
        load_reward("math:pi")
    with pytest.raises(ImportError, match="missing.py not found"):
        load_reward(f"{tmp_path}/missing.py:score")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_package_qq\n")
    with pytest.raises(ImportError, match=r"broken.py failed: ModuleNotFoundError.*not_a_real_package_qq"):
        load_reward(f"{broken}:score")


def test_user_function_from_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text("def length(response, answer):\n    return len(response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward("my_rewards_mod:length")("abc", "") == 3
    finally:
        sys.modules.pop("my_rewards_mod", None)


def test_raising_user_function_from_file_is_counted(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(textwrap.dedent("""
        def score(response, answer):
            if response == "boom":
                raise RuntimeError("parser exploded")
            if response == "nan":
                return float("nan")
            if response == "text":
                return "not a number"
            return 1.0 if response == answer else 0.0
    """))
    fn = load_reward(f"{path}:score")
    responses = ["a", "boom", "b", "nan", "boom", "text"]
    answers = ["a", "a", "a", "a", "a", "a"]
    with pytest.warns(UserWarning, match=r"failed on 4 of 6.*first error: RuntimeError: parser exploded") as caught:
        scores, errors = score_all(fn, responses, answers)
    assert len(caught) == 1
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and errors == 4
    assert all(math.isfinite(s) for s in scores)


def test_score_all_clean_and_mismatch(recwarn):
    scores, errors = score_all(exact_match, ["red", "blue <|im_end|>"], ["red", "red"])
    assert (scores, errors) == ([1.0, 0.0], 0)
    assert not recwarn.list
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score_all(exact_match, ["a", "b"], ["a"])
