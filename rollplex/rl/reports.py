"""What a run tells its user besides the metrics: the start-up summary, and the
records of the samples files (<output_dir>/samples/step_N.jsonl), one JSON object
per generation:

    {"split": "train" | "val", "index": dataset row or task index, "prompt": rendered prompt,
     "response": decoded response, "answer": reference answer, "score": reward,
     "components": {name: value}   (a reward that returns a dict: its entries),
     "advantage": ..., "finish_reason": "stop" | "length"   (training samples),
     "data_source": the row's data_source column   (validation samples of rows that have one),
     "turns": [{"role": "assistant" | "tool" | "user", "content": ...}, ...]   (multi-turn samples: the
              trajectory turn by turn, the policy's turns and the observations, images as {"type": "image"};
              "response" is then the last turn),
     "turns_taken", "tool_calls", "tool_errors", "env_rewards"   (multi-turn samples)}

and the validation scores made from those records (`validation_metrics`).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from rollplex.config import Config
from rollplex.data.reward_scoring import RewardScores
from rollplex.rl.rollout import Rollout
from rollplex.rl.setup import PromptSource, ResumePoint

DATA_SOURCE = "data_source"  # verl's column naming the dataset a row comes from (its validation metrics split by it)


def _record(split: str, example, response: str, rewards: RewardScores, i: int, sample) -> dict[str, Any]:
    record = {"split": split, "index": example.index, "prompt": example.prompt.text, "response": response,
              "answer": example.answer, "score": rewards.scores[i]}
    if rewards.components and rewards.components[i]:
        record["components"] = rewards.components[i]
    if (episode := sample.episode) is not None:
        record.update(turns=episode.messages, turns_taken=episode.turns, tool_calls=episode.tool_calls,
                      tool_errors=episode.tool_errors)
        if episode.rewards:
            record["env_rewards"] = episode.rewards
    return record


def training_records(rollout: Rollout, rewards: RewardScores, advantages: list[float], count: int) -> list[dict]:
    """`count` of the rollout's samples: the first response to each prompt, then the second, ...
    (different prompts before a group's spread)."""
    n = len(rollout.texts) // len(rollout.examples)
    chosen = sorted(range(len(rollout.texts)), key=lambda i: (i % n, i // n))[:count]
    return [{**_record("train", rollout.examples[i // n], rollout.texts[i], rewards, i, rollout.samples[i]),
             "advantage": advantages[i], "finish_reason": rollout.finish_reasons[i]} for i in chosen]


def validation_records(rollout: Rollout, rewards: RewardScores) -> list[dict]:
    """One record per validation response (trainer.val_n per prompt, prompt by prompt), with
    its row's data_source when the row has one (verl's layout)."""
    per_sample = [e for e, g in zip(rollout.examples, rollout.groups) for _ in g.samples]
    records = [_record("val", e, text, rewards, i, sample)
               for i, (e, text, sample) in enumerate(zip(per_sample, rollout.texts, rollout.samples))]
    for record, e in zip(records, per_sample):
        if DATA_SOURCE in e.columns:
            record[DATA_SOURCE] = e.columns[DATA_SOURCE]
    return records


def validation_metrics(records: list[dict]) -> dict[str, float]:
    """val/score, the mean score of every validation response; where rows have a data_source,
    also val/score/<data_source>, each source's mean (rows without one: "unknown", as verl
    names them), in the records' order."""
    metrics = {"val/score": sum(r["score"] for r in records) / len(records)}
    if not any(DATA_SOURCE in r for r in records):
        return metrics
    by_source: defaultdict[str, list[float]] = defaultdict(list)
    for r in records:
        by_source[str(r.get(DATA_SOURCE, "unknown"))].append(r["score"])
    return metrics | {f"val/score/{source}": sum(scores) / len(scores) for source, scores in sorted(by_source.items())}


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


# Compute dtypes that most CPUs have no fast matmuls for.
_SLOW_ON_CPU = ("bfloat16", "float16")


def slow_cpu_compute_note(dtype: str, device_type: str) -> str | None:
    """The line a run that computes in `dtype` on a `device_type` device prints at start-up when that is slow (bf16 or
    fp16 on a CPU: the defaults are a GPU run's), saying how to change it; None when it is not slow."""
    if device_type != "cpu" or dtype not in _SLOW_ON_CPU:
        return None
    return (f"note: computing in {dtype} on a CPU is slow (most CPUs have no fast {dtype} matmuls): set "
            f"--model.dtype float32, or start from the tiny CPU demo's settings (preset: tiny)")
