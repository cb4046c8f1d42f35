"""Reward functions: rollplex's own `fn(response: str, answer: str) -> float`, and
the calling conventions of verl, EasyR1 and TRL (`Reward`, `REWARD_KINDS`).

Built in: "exact_match" (one-word / short answers, the synthetic tasks), "math"
(a final math answer, checked with math-verify when it is installed), "format"
(the <think>...</think> answer layout) and "look" (the look task's, multi-turn). `load_reward` also loads a user function
from `module:function` or `path/to/file.py:function` (which imports the modules
beside it, as a script does); without `:function`, verl's default `compute_score`
or the module's one public function (`load_user_object` loads tools and environments
the same way). Scoring batches, with a failing call costing only its samples, is
rollplex.data.reward_scoring's.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

RewardFn = Callable[[str, str], float]

# Qwen's special tokens (<|im_end|>, <|endoftext|>, ...). Responses are decoded with
# them kept, and the tiny word tokenizer joins words with spaces, so they can sit
# anywhere with a space on either side.
_SPECIAL_TOKEN = re.compile(r"<\|[^<>|]*\|>")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_TAGS = ("<think>", "</think>")
_ANSWER_TAGS = ("<answer>", "</answer>")
_TRAILING_PUNCT = ".,;:!?"


def _strip_special(text: str) -> str:
    return _SPECIAL_TOKEN.sub(" ", text)


def _final_part(response: str) -> str:
    """What a response answers: the last <answer>...</answer>, else what follows the
    last </think>, else all of it (special tokens removed)."""
    text = _strip_special(response)
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    return text.rsplit("</think>", 1)[-1]


def _normalise(text: str) -> str:
    # Case, runs of whitespace and trailing punctuation ("Red ." / "red!") don't count.
    return " ".join(text.lower().split()).rstrip(_TRAILING_PUNCT + " ")


# ----------------------------------------------------------------------------- exact match


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals `answer` up to case, whitespace
    and trailing punctuation, else 0.0."""
    predicted = _normalise(_final_part(response))
    return float(predicted != "" and predicted == _normalise(answer))


# ----------------------------------------------------------------------------- format


def format_reward(response: str, answer: str = "") -> float:
    """1.0 for `<think>...</think>` followed by a non-empty answer, either plain text or
    `<answer>...</answer>`; 0.0 otherwise (tags missing, repeated or out of place).
    Special tokens such as a final <|im_end|> are ignored. `answer` is unused: it is
    there so that this has a reward function's signature."""
    text = _strip_special(response).strip()
    match = re.fullmatch(r"<think>(.*?)</think>(.*)", text, re.DOTALL)
    if match is None:
        return 0.0
    thought, rest = match.group(1), match.group(2).strip()
    if any(tag in thought for tag in _THINK_TAGS + _ANSWER_TAGS) or any(tag in rest for tag in _THINK_TAGS):
        return 0.0
    tagged = re.fullmatch(r"<answer>(.*)</answer>", rest, re.DOTALL)
    body = tagged.group(1) if tagged else rest
    if any(tag in body for tag in _ANSWER_TAGS):
        return 0.0
    return float(body.strip() != "")


# ----------------------------------------------------------------------------- math


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: the response was cut off inside the box


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?|-?\.\d+%?")
_ANSWER_PREFIX = re.compile(r"answer\s*:", re.IGNORECASE)


def extract_math_answer(response: str) -> str:
    """The final answer of a math response: the last \\boxed{...}, else the last
    <answer>...</answer>, else the rest of the line after the last "answer:", else the
    last number; "" when there is none."""
    text = _strip_special(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    prefixes = list(_ANSWER_PREFIX.finditer(text))
    if prefixes:
        return text[prefixes[-1].end():].strip().split("\n", 1)[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


# LaTeX that does not change a value: spacing, sizing, text wrappers, degrees, $.
_LATEX_NOISE = re.compile(r"\\left|\\right|\\[,;:! ]|\\displaystyle|\$|\^\{?\\circ\}?|°")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
# One-character arguments without braces, as LaTeX allows them: \sqrt3, \frac12.
_BARE_SQRT = re.compile(r"\\sqrt(\w)")
_BARE_FRAC = re.compile(r"\\([dt]?frac)(\w)(\w)")


def _normalise_math(text: str) -> str:
    text = _TEXT_WRAPPER.sub(r"\1", text)
    text = _LATEX_NOISE.sub("", text)
    text = _BARE_FRAC.sub(r"\\\1{\2}{\3}", _BARE_SQRT.sub(r"\\sqrt{\1}", text))
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text).replace("\\%", "%")
    return "".join(text.split()).lower().rstrip(_TRAILING_PUNCT)


def _number_values(text: str) -> list[float]:
    """The values a normalised answer may mean: one number, or for a percentage both
    p and p/100 ("50%" matches 50 and 0.5). [] when it is not a plain number."""
    percent = text.endswith("%")
    text = text.removesuffix("%")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")  # thousands separators
    fraction = re.fullmatch(r"\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", text)
    try:
        value = float(Fraction(fraction.group(1)) / Fraction(fraction.group(2))) if fraction else float(text)
    except (ValueError, ZeroDivisionError):
        return []
    if not math.isfinite(value):
        return []
    return [value, value / 100] if percent else [value]


def _plain_equal(predicted: str, answer: str) -> bool:
    """Numeric comparison when both are numbers, else normalised string comparison."""
    a, b = _normalise_math(predicted), _normalise_math(answer)
    if not a:
        return False
    va, vb = _number_values(a), _number_values(b)
    if va and vb:
        return any(math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) for x in va for y in vb)
    return a == b


@functools.cache
def _math_verify() -> tuple[Callable, Callable] | None:
    """math-verify's parse and verify; None, with a warning the first time, when it is missing."""
    try:
        from math_verify import parse, verify
    except ImportError:
        warnings.warn("the math reward is scoring WITHOUT math-verify, a dependency of rollplex (pip install "
                      "math-verify): answers equal only symbolically, such as x+1 and 1+x or \\sqrt{3}/2 and "
                      "\\frac{\\sqrt{3}}{2}, score 0", stacklevel=3)
        return None
    return parse, verify


def _math_verify_equal(predicted: str, answer: str) -> bool:
    """math-verify's verdict; False when it is not installed or parses nothing."""
    if (math_verify := _math_verify()) is None:
        return False
    parse, verify = math_verify
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))


def math_answer(response: str, answer: str) -> float:
    """1.0 when the response's final math answer (see `extract_math_answer`) equals
    `answer`: symbolically by math-verify when it is installed, or numerically (floats,
    fractions such as 1/2 or \\frac{1}{2}, percentages), or as normalised strings."""
    predicted = extract_math_answer(response)
    if not predicted:
        return 0.0
    gold = last_boxed(answer) or answer
    return float(_plain_equal(predicted, gold) or _math_verify_equal(predicted, gold))


# ----------------------------------------------------------------------------- look (multi-turn)

LOOKED_BONUS = 0.1


def look_answer(response: str, answer: str, messages: list[dict] | None = None) -> float:
    """The look task's reward (rollplex.data.tasks, rollplex.agent.look): 1.0 for the right colour
    (`exact_match` of the last turn), else LOOKED_BONUS when the trajectory holds a tool's answer
    (`messages`: the model looked), else 0.0. A policy that never looks scores at most 1/7 (7
    colours); the bonus makes looking pay before a from-scratch model can read the picture, which
    it otherwise would almost never find the call for (1 token of ~120, then the right colour)."""
    if exact_match(response, answer):
        return 1.0
    return LOOKED_BONUS if any(m.get("role") == "tool" for m in messages or ()) else 0.0


# ----------------------------------------------------------------------------- loading

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_answer,
    "format": format_reward,
    "look": look_answer,
}


# The folders of the user files (rewards, tools, environments) loaded in this process, each put on sys.path by
# `_import_beside`.
_REWARD_FOLDERS: set[Path] = set()


def _top_level_home(name: str, module: Any) -> Path | None:
    """The folder in which `import name` found the top level of `module` (a file or a
    package folder); None for a module without a file."""
    file = getattr(module, "__file__", None)
    depth = name.count(".") + hasattr(module, "__path__")  # a package's file is its folder's __init__.py
    parents = Path(file).resolve().parents if file else ()
    return parents[depth] if depth < len(parents) else None


def _import_beside(folder: Path) -> None:
    """Make the modules beside a reward file importable, as a script's folder is for
    `python script.py`, but after the interpreter's own sys.path entries: in a process
    that lives on, a math.py beside the reward (or in a worker, which copies this
    sys.path) must not shadow the standard library's for everything imported later.
    Before the folders of reward files loaded earlier, so that its modules win over theirs."""
    entry = str(folder)
    if entry in sys.path:
        sys.path.remove(entry)  # loaded before: placed again, not twice
    earlier = [i for i, e in enumerate(sys.path) if Path(e) in _REWARD_FOLDERS - {folder}]
    sys.path.insert(earlier[0] if earlier else len(sys.path), entry)
    _forget_other_reward_folders_modules(folder)
    _REWARD_FOLDERS.add(folder)


def _forget_other_reward_folders_modules(folder: Path) -> None:
    """Drop from the module cache the modules that another reward file's folder gave under a
    name `folder` has too, so that a file here imports its own (a file loaded before keeps
    the modules it imported)."""
    names = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
    names.discard("__main__")  # the running script's, whatever folder a reward file also has one in
    others = _REWARD_FOLDERS - {folder}
    for name, module in list(sys.modules.items()):
        if name.partition(".")[0] in names and _top_level_home(name, module) in others:
            del sys.modules[name]


def _load_file(path: Path, spec: str, what: str):
    if not path.is_file():
        raise ImportError(f"{what} {spec!r}: file {path} not found")
    _import_beside(path.resolve().parent)
    # A unique module name per file: two user files both called reward.py must not clash.
    name = f"rollplex_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"{what} {spec!r}: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ImportError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def load_reward(spec: str) -> RewardFn:
    """A reward function by name ("exact_match", "math", "format") or a user function as
    `package.module:function` or `path/to/file.py:function` (`load_user_object`). Without
    `:function`, the module's `compute_score` (verl's default name), else the one public
    function defined in it (`_default_function`)."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    try:
        fn = load_user_object(spec, "reward", _default_function)
    except ImportError as e:
        missing = e.__cause__
        if ":" not in spec and isinstance(missing, ModuleNotFoundError) and missing.name == spec:
            # A mistyped built-in, most likely.
            raise ValueError(f"unknown reward {spec!r}: use a built-in ({', '.join(BUILTIN_REWARDS)}) "
                             f"or a function as 'module:function' / 'path/to/file.py:function'") from None
        raise
    if not callable(fn):
        where, _, func_name = spec.rpartition(":")
        raise TypeError(f"reward {spec!r}: {where}.{func_name} is a {type(fn).__name__}, not a function")
    return fn


def load_user_object(spec: str, what: str, default: Callable[[Any, str], str] | None = None,
                     named: str = "function") -> Any:
    """What a user's `package.module:name` or `path/to/file.py:name` names: a reward function,
    a tool, an environment class (`what` and `named` say which, in the errors). A file's folder
    goes on sys.path, after the standard library and the installed packages, so that the file
    imports the modules beside it. A spec without `:name` takes `default(module, where)`'s name;
    without a `default`, it is an error."""
    where, colon, name = spec.rpartition(":")
    if not colon and default is not None:
        where = spec
    elif not where or not name:
        raise ValueError(f"{what} {spec!r}: expected 'module:name' or 'path/to/file.py:name'")
    module = _load_module(where, spec, what)
    if not colon:
        name = default(module, where)
    found = getattr(module, name, None)
    if found is None:
        raise ImportError(f"{what} {spec!r}: {where} has no {named} {name!r}")
    return found


def _load_module(where: str, spec: str, what: str) -> Any:
    """The module of a user's code: a file (a path, or a name ending in .py) or an importable module."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        return _load_file(Path(where), spec, what)
    try:
        return importlib.import_module(where)
    except Exception as e:
        raise ImportError(f"{what} {spec!r}: cannot import module {where!r}: {type(e).__name__}: {e}") from e


# The function a reward named without one (`file.py`, `pkg.module`) stands for, when the module has it: verl's
# custom_reward_function.name default.
DEFAULT_REWARD_FUNCTION = "compute_score"


def _default_function(module: Any, where: str) -> str:
    """The name of the reward function in `module` when the spec names none: DEFAULT_REWARD_FUNCTION, else the one
    public function defined in the module itself (not imported into it)."""
    if hasattr(module, DEFAULT_REWARD_FUNCTION):
        return DEFAULT_REWARD_FUNCTION
    own = [name for name, value in vars(module).items()
           if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")]
    if len(own) == 1:
        return own[0]
    found = f"its public functions are {', '.join(own)}" if own else "it defines no public function"
    example = own[0] if own else "my_reward"
    raise ImportError(f"reward {where!r}: no function named, and {where} has no {DEFAULT_REWARD_FUNCTION}; {found}. "
                      f"Name the reward function: data.reward {where}:{example}")


# ----------------------------------------------------------------------------- calling conventions

# How a reward function is called (data.reward_kind), each as its framework documents it:
#   rollplex           fn(response, answer) -> float
#   verl               compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict
#   easyr1             compute_score(reward_inputs: list[dict]) -> list[dict]   (EasyR1's reward_type "batch")
#   easyr1_sequential  compute_score(reward_input: dict) -> dict                (EasyR1's reward_type "sequential")
#   trl                f(prompts, completions, completion_ids, **columns) -> list[float]
REWARD_KINDS = ("rollplex", "verl", "easyr1", "easyr1_sequential", "trl")
BATCH_KINDS = ("easyr1", "trl")  # one call scores many responses
# A dict result's score, when data.reward_score_key does not name one: EasyR1's, then verl's.
DEFAULT_SCORE_KEYS = ("overall", "score")
# Names TRL passes itself: a dataset column of the same name does not reach the function as a keyword.
_TRL_OWN_ARGUMENTS = ("prompt", "prompts", "completion", "completions", "completion_ids", "trainer_state")


@dataclass
class RewardSample:
    """What a reward function is told about one response."""

    response: str  # decoded, special tokens skipped
    answer: str  # the row's ground truth, as text
    response_ids: list[int] = field(default_factory=list)  # the response's tokens (empty when not known)
    # The dataset row's columns but its images and videos (data_source, extra_info, ...), and the prompt as the
    # row holds it (text or chat messages) under "prompt"; empty for the synthetic tasks.
    columns: dict[str, Any] = field(default_factory=dict)
    # A multi-turn sample (rollplex.agent): its trajectory after the prompt as chat messages (the policy's turns, the
    # tools' or environment's answers; images as {"type": "image"}), and its environment's reward at each step.
    # `response` is then its last turn.
    messages: list[dict] | None = None
    env_rewards: list[float] | None = None

    def multi_turn_keywords(self, fn: Callable) -> dict[str, Any]:
        """A multi-turn sample's `messages` and `env_rewards`, for the ones `fn` takes by name (or **kwargs)."""
        if self.messages is None:
            return {}
        return {name: value for name, value in (("messages", self.messages), ("env_rewards", self.env_rewards or []))
                if _takes_keyword(fn, name)}


def detect_kind(fn: Callable) -> str:
    """The calling convention of `fn`, from its parameter names: `solution_str` is verl's,
    `reward_inputs` / `reward_input` EasyR1's (batch / sequential), `completions` TRL's;
    anything else is rollplex's `fn(response, answer)`."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: called as rollplex's
        return "rollplex"
    for name, kind in (("solution_str", "verl"), ("reward_inputs", "easyr1"), ("reward_input", "easyr1_sequential"),
                       ("completions", "trl")):
        if name in names:
            return kind
    return "rollplex"


def _takes_keyword(fn: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _verl_ground_truth(sample: RewardSample) -> Any:
    # verl passes reward_model.ground_truth as the row holds it (a list stays a list), not as text.
    reward_model = sample.columns.get("reward_model")
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return sample.answer


def _easyr1_input(sample: RewardSample) -> dict[str, Any]:
    turns = {} if sample.messages is None else {"messages": sample.messages, "env_rewards": sample.env_rewards or []}
    return {**sample.columns, "response": sample.response, "response_length": len(sample.response_ids),
            "ground_truth": sample.answer, **turns}


def _call_trl(fn: Callable, samples: Sequence[RewardSample]) -> Any:
    """As TRL's GRPOTrainer calls it: every other dataset column as a keyword holding one value
    per response, and chat-message completions where the prompt was chat messages (a multi-turn
    sample's: its whole trajectory's messages, tool answers included, as TRL's with tools)."""
    prompts = [s.columns.get("prompt", "") for s in samples]
    completions = [s.messages if s.messages is not None else
                   [{"role": "assistant", "content": s.response}] if isinstance(p, list) else s.response
                   for s, p in zip(samples, prompts)]
    columns = {name: [s.columns.get(name) for s in samples] for name in samples[0].columns
               if name not in _TRL_OWN_ARGUMENTS}
    if samples[0].messages is not None and _takes_keyword(fn, "env_rewards"):
        columns["env_rewards"] = [s.env_rewards or [] for s in samples]
    # trainer_state is TRL's Trainer state: there is none here.
    return fn(**columns, prompts=prompts, completions=completions,
              completion_ids=[s.response_ids for s in samples], trainer_state=None)


_PER_SAMPLE_CALLS: dict[str, Callable[[Callable, RewardSample], Any]] = {
    "rollplex": lambda fn, s: fn(s.response, s.answer, **s.multi_turn_keywords(fn)),
    "verl": lambda fn, s: fn(data_source=s.columns.get("data_source"), solution_str=s.response,
                             ground_truth=_verl_ground_truth(s), extra_info=s.columns.get("extra_info", {}),
                             **s.multi_turn_keywords(fn)),
    "easyr1_sequential": lambda fn, s: fn(_easyr1_input(s)),
}
_BATCH_CALLS: dict[str, Callable[[Callable, Sequence[RewardSample]], Any]] = {
    "easyr1": lambda fn, samples: fn([_easyr1_input(s) for s in samples]),
    "trl": _call_trl,
}


class Reward:
    """A reward function (see `load_reward` for `spec`) with its calling convention:
    `kind` one of REWARD_KINDS, or "auto" to take it from the parameter names
    (`detect_kind`), and `kwargs` added to every call. Calling it on samples returns their raw results, one each (a
    number, or a dict whose score `score_of` finds); a `batched` kind takes many
    samples in one call of the function, the others one call per sample."""

    def __init__(self, spec: str, kind: str = "auto", kwargs: dict[str, Any] | None = None):
        self.spec = spec
        fn = load_reward(spec)
        if kind not in ("auto", *REWARD_KINDS):
            raise ValueError(f"unknown reward kind {kind!r}: use auto or one of {', '.join(REWARD_KINDS)}")
        self.kind = detect_kind(fn) if kind == "auto" else kind
        self.fn = functools.partial(fn, **kwargs) if kwargs else fn  # data.reward_kwargs, on every call
        self.batched = self.kind in BATCH_KINDS

    def __call__(self, samples: Sequence[RewardSample]) -> list[Any]:
        if self.batched:
            results = _BATCH_CALLS[self.kind](self.fn, samples)
            if not isinstance(results, Sequence) or len(results) != len(samples):
                count = len(results) if isinstance(results, Sequence) else type(results).__name__
                raise ValueError(f"{self.kind} reward functions return a list of one result per response: got "
                                 f"{count} for {len(samples)} responses")
            return list(results)
        return [_PER_SAMPLE_CALLS[self.kind](self.fn, s) for s in samples]


class RewardTypeError(TypeError):
    """A reward function returned a score that is not a number (a string, a list, ...): a mistake in the
    function, not in its sample, so it stops the run (rollplex.data.reward_scoring) instead of scoring 0.0."""


def score_of(result: Any, score_key: str = "") -> tuple[float, dict[str, float]]:
    """A raw result's score and its components: a number is the score, with no
    components; a dict's score is its `score_key` entry ("": "overall" or "score",
    whichever it has), and every finite number in it (the score too) is a component.
    A score of the wrong type raises RewardTypeError; None, a missing score or a
    score that is not finite raise other errors (the sample's failure)."""
    components: dict[str, float] = {}
    entry = ""
    if isinstance(result, Mapping):
        components = {str(k): float(v) for k, v in result.items()
                      if isinstance(v, numbers.Real) and math.isfinite(v)}
        keys = (score_key,) if score_key else DEFAULT_SCORE_KEYS
        found = next((k for k in keys if k in result), None)
        if found is None:
            raise KeyError(f"the reward's dict has no {' or '.join(map(repr, keys))} entry (it has "
                           f"{', '.join(map(repr, result))}): set data.reward_score_key to the entry that is the score")
        result, entry = result[found], f"a dict whose {found!r} entry is "
    if result is None:
        raise TypeError("the reward returned None (TRL's 'no reward for this sample'; with one reward function "
                        "there is no other to score it)")
    score = _real_number(result)
    if score is None:
        shown = repr(result) if len(repr(result)) <= 60 else repr(result)[:57] + "..."
        number = (f"float({result!r})" if isinstance(result, str) and _parses_as_float(result) else "a number") + \
            " (a float, an int or a bool)"
        fix = (f"make it {number}" if entry else
               f"return {number}, or a dict with the score under {score_key or DEFAULT_SCORE_KEYS[-1]!r}")
        raise RewardTypeError(f"returned {entry}{type(result).__name__} {shown}, not a number: {fix}")
    if not math.isfinite(score):
        raise ValueError(f"non-finite reward {score}")
    return score, components


def _real_number(value: Any) -> float | None:
    """`value` as a float when it is a real number, else None. Taken as verl takes them: Python's and
    numpy's numbers, bool too (an `a == b` check scores 1.0 or 0.0: bool is an int, and verl's reward
    tensor and TRL's list of rewards take it), and a one-element numpy array or torch tensor. Not a
    string, even one that reads as a number: verl fails on it, and it is most often a parse mistake."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # numpy's and torch's one-element arrays (no import of either here)
    if not callable(item):
        return None
    try:
        inner = item()
    except (ValueError, RuntimeError, TypeError):  # more elements than one, or an item() of another meaning
        return None
    return float(inner) if isinstance(inner, numbers.Real) else None


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
