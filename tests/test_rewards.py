"""Reward functions, by hand-written cases; user functions loaded from files (importing the
modules beside them) and modules; user functions scored in worker processes that survive
hangs (a batch's calls sharing one time limit) and crashes."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollplex.config import ConfigError, DataConfig
from rollplex.data.reward_scoring import RewardScorer
from rollplex.data.rewards import (RewardTypeError, exact_match, extract_math_answer, format_reward, last_boxed,
                                   load_reward, math_answer)


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
    # math-verify is a dependency of rollplex: the math reward compares symbolically.
    assert math_answer(r"\boxed{x+1}", "1+x") == 1.0
    assert math_answer(r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}") == 1.0
    assert math_answer(r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}") == 1.0
    assert math_answer(r"\boxed{x+2}", "1+x") == 0.0


def test_math_answer_without_math_verify_warns_and_reads_bare_latex_arguments(monkeypatch):
    from rollplex.data.rewards import _math_verify

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed: its import raises ImportError
    _math_verify.cache_clear()
    try:
        with pytest.warns(UserWarning, match="WITHOUT math-verify"):
            assert math_answer(r"\boxed{x+1}", "1+x") == 0.0  # only a symbolic comparison sees these equal
        # \sqrt3 is \sqrt{3} and \frac12 is \frac{1}{2}, with or without math-verify.
        assert math_answer(r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}") == 1.0
        assert math_answer(r"\boxed{\dfrac12}", "0.5") == 1.0
    finally:
        _math_verify.cache_clear()


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


def test_a_reward_named_without_its_function_takes_compute_score_or_the_one_public_function(tmp_path, monkeypatch):
    """As verl's custom_reward_function.path without .name: compute_score; else the file's only function of its own
    (imported functions and _private ones do not count)."""
    verl_file = tmp_path / "verl_reward.py"
    verl_file.write_text("def helper(x):\n    return 0.0\n\n"
                         "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    assert load_reward(str(verl_file)).__name__ == "compute_score"
    single = tmp_path / "single.py"
    single.write_text("from math import floor, sqrt\n\ndef _normalise(text):\n    return text\n\n"
                      "def my_score(response, answer):\n    return float(_normalise(response) == answer)\n")
    assert load_reward(str(single))("a", "a") == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_reward("single").__name__ == "my_score"  # a module name, without a path
    finally:
        sys.modules.pop("single", None)
    several = tmp_path / "several.py"
    several.write_text("def first(response, answer):\n    return 0.0\n\ndef second(response, answer):\n    return 1.0\n")
    with pytest.raises(ImportError, match=r"no compute_score; its public functions are first, second\. Name the "
                                          rf"reward function: data.reward {several}:first"):
        load_reward(str(several))
    (tmp_path / "empty.py").write_text("from math import sqrt\n")
    with pytest.raises(ImportError, match="it defines no public function"):
        load_reward(str(tmp_path / "empty.py"))


def write_reward_folder(folder: Path, bonus: float) -> str:
    """A reward file that imports a module beside it, as a script imports one beside it; its spec."""
    folder.mkdir()
    (folder / "grading_helpers.py").write_text(f"BONUS = {bonus}\n")
    (folder / "reward.py").write_text(textwrap.dedent("""
        from grading_helpers import BONUS

        def score(response, answer):
            return len(response) + BONUS
    """))
    return f"{folder / 'reward.py'}:score"


@pytest.fixture
def restore_imports(monkeypatch):
    """Undoes what loading reward files from folders does: their folders on sys.path, their modules cached."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("grading_helpers", None)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_file_imports_the_modules_beside_it(tmp_path, workers, restore_imports):
    reward = write_reward_folder(tmp_path / "rewards", bonus=0.5)
    with RewardScorer(reward, workers=workers) as scorer:  # in this process, and in a worker process
        assert scorer.score(["ab"], [""]).scores == [2.5]


def test_reward_files_in_two_folders_each_import_their_own_module(tmp_path, restore_imports):
    first = write_reward_folder(tmp_path / "first", bonus=0.5)
    second = write_reward_folder(tmp_path / "second", bonus=0.25)
    # Loaded again, a file still imports its own folder's module, and its folder is on sys.path once.
    for spec, bonus in ((first, 0.5), (second, 0.25), (first, 0.5)):
        assert load_reward(spec)("ab", "") == 2 + bonus
    for folder in ("first", "second"):
        assert sys.path.count(str((tmp_path / folder).resolve())) == 1


def test_a_module_beside_a_reward_file_never_shadows_the_standard_librarys(tmp_path, restore_imports):
    """A long-lived process (and its reward workers, which copy its sys.path) goes on importing the
    library's modules after a reward file beside a colorsys.py was loaded."""
    reward = write_reward_folder(tmp_path / "rewards", bonus=0.5)
    (tmp_path / "rewards" / "colorsys.py").write_text("shadowed = True\n")
    load_reward(reward)
    sys.modules.pop("colorsys", None)
    import colorsys

    assert hasattr(colorsys, "rgb_to_hsv") and not hasattr(colorsys, "shadowed")


def test_raising_user_function_from_file_is_counted(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(textwrap.dedent("""
        def score(response, answer):
            if response == "boom":
                raise RuntimeError("parser exploded")
            if response == "nan":
                return float("nan")
            if response == "none":
                return None
            return 1.0 if response == answer else 0.0
    """))
    responses = ["a", "boom", "b", "nan", "boom", "none"]
    answers = ["a", "a", "a", "a", "a", "a"]
    with RewardScorer(f"{path}:score", workers=0) as scorer:
        with pytest.warns(UserWarning, match=r"failed on 4 of 6.*first error: RuntimeError: parser exploded") as caught:
            result = scorer.score(responses, answers)
    assert len(caught) == 1
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and result.errors == 4
    assert all(math.isfinite(s) for s in result.scores)


def test_score_in_process_clean_and_mismatch(recwarn):
    scorer = RewardScorer("exact_match")
    result = scorer.score(["red", "blue <|im_end|>"], ["red", "red"])
    assert (result.scores, result.errors, result.first_error) == ([1.0, 0.0], 0, "")
    assert not recwarn.list
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        scorer.score(["a", "b"], ["a"])


TYPED_REWARD = """
import numpy, torch

def score(response, answer):
    return {"text": "1.0", "dict": {"score": "0.5"}, "bool": response == answer, "numpy": numpy.float32(0.25),
            "tensor": torch.tensor([0.75])}.get(response, 0.0)
"""


@pytest.mark.parametrize("workers", [0, 1])
def test_a_score_that_is_not_a_number_stops_the_run_naming_the_function(tmp_path, workers):
    (tmp_path / "typed.py").write_text(TYPED_REWARD)
    spec = f"{tmp_path / 'typed.py'}:score"
    with RewardScorer(spec, workers=workers) as scorer:
        # What verl takes is taken: a bool (an `a == b` check), numpy's numbers, a one-element tensor.
        assert scorer.score(["bool", "bool", "numpy", "tensor"], ["bool", "x", "", ""]).scores == [1.0, 0.0, 0.25,
                                                                                                   0.75]
        with pytest.raises(RewardTypeError, match=rf"^reward function {re.escape(spec)} returned str '1.0', not a "
                                                  r"number: return float\('1.0'\) \(a float, an int or a bool\)"):
            scorer.score(["a", "text", "b"], [""] * 3)
        with pytest.raises(RewardTypeError, match=r"returned a dict whose 'score' entry is str '0.5', not a number: "
                                                  r"make it float\('0.5'\)"):
            scorer.score(["dict"], [""])
        assert scorer.score(["a"], [""]).scores == [0.0]  # the scorer, and its workers, go on


def test_reward_clip_bounds_every_score_and_a_huge_reward_warns_once(tmp_path, recwarn):
    (tmp_path / "huge.py").write_text("def score(response, answer):\n    return float(response)\n")
    spec = f"{tmp_path / 'huge.py'}:score"
    with RewardScorer(spec, workers=0, clip=10.0) as clipped:
        assert clipped.score(["1e30", "-1e30", "0.5"], [""] * 3).scores == [10.0, -10.0, 0.5]
    assert not recwarn.list  # clipped, nothing trains beyond LARGE_REWARD
    with RewardScorer(spec, workers=0) as scorer:
        with pytest.warns(UserWarning, match=rf"reward function {re.escape(spec)} returned -1e\+30: a reward beyond "
                                             r"±1e\+06 .*data\.reward_clip") as caught:
            assert scorer.score(["1", "-1e30"], ["", ""]).scores == [1.0, -1e30]
        assert len(caught) == 1
        scorer.score(["1e30"], [""])
    assert not recwarn.list  # once per run: the second huge batch did not warn again


# ----------------------------------------------------------------------------- worker processes

USER_REWARD = """
import math, os, time

def score(response, answer):
    if response == "hang":
        time.sleep(3600)
    if response == "abort":
        os.abort()  # a crash in native code: no exception, the process is gone
    if response == "raise":
        raise RuntimeError("parser exploded")
    if response == "nan":
        return math.nan
    if response.startswith("sleep"):  # "sleep <seconds> <score>"
        _, seconds, value = response.split()
        time.sleep(float(seconds))
        return float(value)
    return float(len(response))
"""


@pytest.fixture
def user_reward(tmp_path) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(USER_REWARD)
    return f"{path}:score"


def test_workers_by_default_for_user_functions_only(user_reward, time_limit):
    assert RewardScorer("exact_match").workers == 0
    with RewardScorer(user_reward) as scorer:
        assert scorer.workers == 2 and scorer.timeout_s == 60.0
        assert scorer.score(["ab", "abc"], ["", ""]).scores == [2.0, 3.0]


def test_a_reward_that_never_returns_times_out(user_reward, time_limit):
    with RewardScorer(user_reward, workers=2, timeout_s=0.5) as scorer:
        start = time.monotonic()
        with pytest.warns(UserWarning, match=r"1 of 4 responses were not scored within 0.5 s"):
            result = scorer.score(["a", "hang", "bb", "ccc"], [""] * 4)
        assert time.monotonic() - start < 5
        assert (result.scores, result.errors, result.timeouts) == ([1.0, 0.0, 2.0, 3.0], 0, 1)
        # The hung worker was killed and replaced: the next batch uses both workers again.
        assert scorer.score(["dddd", "e"], ["", ""]).scores == [4.0, 1.0]


def test_a_steps_reward_calls_share_one_deadline(user_reward, time_limit):
    # A limit per call would cost 7 hung calls on 2 workers 4 x 0.5 s; one deadline for the batch, 0.5 s.
    with RewardScorer(user_reward, workers=2, timeout_s=0.5) as scorer:
        hung = [worker.process for worker in scorer._pool.workers]
        start = time.monotonic()
        with pytest.warns(UserWarning, match=r"7 of 8 responses were not scored within 0\.5 s "
                                             r"\(data\.reward_timeout_s"):
            result = scorer.score(["a"] + ["hang"] * 7, [""] * 8)
        assert time.monotonic() - start < 1.25
        # "a" was scored; two calls hung till the deadline, and the other five were never made.
        assert (result.scores, result.errors, result.timeouts) == ([1.0] + [0.0] * 7, 0, 7)
        assert [process.returncode for process in hung] == [-signal.SIGKILL] * 2  # killed, and reaped
        # Their replacements score the next batch, with its own deadline.
        assert scorer.score(["ab", "abc"], ["", ""]).scores == [2.0, 3.0]


def test_workers_starting_do_not_use_up_the_time_limit(tmp_path, time_limit):
    reward = tmp_path / "slow_start.py"  # a reward that loads a model, say, before it can score
    reward.write_text(USER_REWARD + "\ntime.sleep(0.75)\n")
    with RewardScorer(f"{reward}:score", workers=2, timeout_s=0.5) as scorer:
        assert scorer.score(["hang", "hang"], ["", ""], warn=False).timeouts == 2  # both workers killed
        # The batch's limit starts with its first call, once a replacement has started.
        assert scorer.score(["ab", "abc"], ["", ""]).scores == [2.0, 3.0]


def test_a_crashing_worker_costs_its_sample_and_is_replaced(user_reward, time_limit):
    with RewardScorer(user_reward, workers=2, timeout_s=10) as scorer:
        with pytest.warns(UserWarning, match=r"failed on 1 of 3.*worker process died \(killed by SIGABRT\)"):
            result = scorer.score(["a", "abort", "bb"], [""] * 3)
        assert (result.scores, result.errors, result.timeouts) == ([1.0, 0.0, 2.0], 1, 0)
        assert scorer.score(["abc", "abcd", "x"], [""] * 3).scores == [3.0, 4.0, 1.0]


def test_raising_and_non_finite_rewards_are_errors_in_workers(user_reward, time_limit):
    with RewardScorer(user_reward, workers=1) as scorer:
        with pytest.warns(UserWarning, match=r"failed on 2 of 3.*first error: RuntimeError: parser exploded"):
            result = scorer.score(["raise", "nan", "ok"], [""] * 3)
    assert (result.scores, result.errors, result.timeouts) == ([0.0, 0.0, 2.0], 2, 0)


def test_workers_score_in_parallel_and_keep_the_order(user_reward, time_limit):
    # The later samples sleep less, so they finish first.
    responses = [f"sleep {0.1 * (5 - i):.1f} {i}" for i in range(5)]
    with RewardScorer(user_reward, workers=3) as scorer:
        start = time.monotonic()
        result = scorer.score(responses, [""] * 5)
        elapsed = time.monotonic() - start
    assert result.scores == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert elapsed < 1.2  # 1.5 s one after another; about 0.5 s on 3 workers


def test_close_stops_the_workers(user_reward, tmp_path, time_limit):
    scorer = RewardScorer(user_reward, workers=2, timeout_s=10)
    processes = [worker.process for worker in scorer._pool.workers]
    scorer.close()
    assert all(process.returncode == 0 for process in processes)  # exited, and reaped
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["a"], [""])
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_package_qq\n")
    with pytest.raises(ImportError, match=r"in a worker process: ImportError.*not_a_real_package_qq"):
        RewardScorer(f"{broken}:score", workers=1)


@pytest.mark.skipif(sys.platform != "linux", reason="workers die with the trainer through Linux's PR_SET_PDEATHSIG")
def test_a_hung_worker_dies_with_a_killed_trainer(user_reward, time_limit):
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from rollplex.data.reward_scoring import RewardScorer
        scorer = RewardScorer({user_reward!r}, workers=2)
        print(*[worker.process.pid for worker in scorer._pool.workers], flush=True)
        scorer.score(["hang", "hang"], ["", ""])
    """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    workers = [int(pid) for pid in trainer.stdout.readline().split()]
    time.sleep(0.5)  # both calls hang
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 10
    while any(map(running, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, workers))


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited: reaping an orphan is init's business)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("field, value", [("reward_workers", -2), ("reward_timeout_s", 0.0),
                                          ("reward_timeout_s", math.nan), ("reward_timeout_s", math.inf)])
def test_reward_worker_settings_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"data.{field} must be"):
        DataConfig(**{field: value})
