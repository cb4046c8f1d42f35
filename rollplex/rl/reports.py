"""What a run tells its user besides the metrics: the start-up summary, and the
records of the samples files (<output_dir>/samples/step_N.jsonl), one JSON object
per generation:

    {"split": "train" | "val", "index": dataset row or task index, "prompt": rendered prompt,
     "response": decoded response, "answer": reference answer, "score": reward,
     "components": {name: value}   (a reward that returns a dict: its entries),
     "advantage": ..., "finish_reason": "stop" | "length"   (training samples)}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollplex.config import Config
from rollplex.data.reward_scoring import RewardScores
from rollplex.rl.rollout import Rollout
from rollplex.rl.setup import PromptSource, ResumePoint


def _record(split: str, example, response: str, rewards: RewardScores, i: int) -> dict[str, Any]:
    record = {"split": split, "index": example.index, "prompt": example.prompt.text, "response": response,
              "answer": example.answer, "score": rewards.scores[i]}
    if rewards.components and rewards.components[i]:
        record["components"] = rewards.components[i]
    return record


def training_records(rollout: Rollout, rewards: RewardScores, advantages: list[float], count: int) -> list[dict]:
    """`count` of the rollout's samples: the first response to each prompt, then the second, ...
    (different prompts before a group's spread)."""
    n = len(rollout.texts) // len(rollout.examples)
    chosen = sorted(range(len(rollout.texts)), key=lambda i: (i % n, i // n))[:count]
    return [{**_record("train", rollout.examples[i // n], rollout.texts[i], rewards, i),
             "advantage": advantages[i], "finish_reason": rollout.finish_reasons[i]} for i in chosen]


def validation_records(examples: list, responses: list[str], rewards: RewardScores) -> list[dict]:
    """One record per validation prompt and its greedy response."""
    return [_record("val", e, response, rewards, i) for i, (e, response) in enumerate(zip(examples, responses))]


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def startup_summary(cfg: Config, model_dir: Path, parameters: tuple[int, int], data: PromptSource, total_steps: int,
                    layout: str, start: ResumePoint) -> str:
    """The lines a run prints before its first step: what it trains (`parameters`: all and trained),
    on what, how long, how laid out (`layout`: the trainer's ranks and schedule), where to."""
    run = (f"resuming {cfg.trainer.output_dir} from {start.checkpoint} (step {start.step})" if start.checkpoint
           else f"new run in {cfg.trainer.output_dir}")
    model = cfg.model.path or f"tiny (model.tiny, built in {model_dir})"
    total, trained = parameters
    counts = f"{_count(total)} parameters" + (f", {_count(trained)} trained (LoRA rank {cfg.lora.rank})"
                                              if cfg.lora.rank else "")
    d, r = cfg.data, cfg.rollout
    if data.train_data is not None:
        train = f"{len(data.train_data):,} rows, {len(data.train_data) / d.batch_size:.4g} steps per epoch"
    else:
        train = f"built-in task {d.task!r} (endless)"
    return "\n".join([
        f"rollplex: {run}",
        f"  model   {model}: {counts}, compute {cfg.model.dtype}",
        f"  data    train: {train}; val: {len(data.val_examples)} prompts; reward {d.reward}",
        f"  steps   {total_steps} ({total_steps - start.step} to go); {d.batch_size} prompts x {r.n} responses = "
        f"{d.batch_size * r.n} samples per step, {cfg.algorithm.updates_per_batch} optimizer step(s) each",
        f"  layout  {layout}",
        f"  output  {cfg.trainer.output_dir}: metrics.jsonl, checkpoints/, samples/",
    ])
