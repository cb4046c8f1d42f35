"""Training metrics: a per-step logger, phase timers and a GPU utilisation sampler.

One record per logged step goes to ``<output_dir>/metrics.jsonl`` (one JSON
object a line, ``{"step": 12, "critic/score/mean": 0.51, ...}``), to a one-line
console summary and, optionally, to TensorBoard (``<output_dir>/tb``), wandb and
SwanLab (rollplex.trackers). Sample generations go to
``<output_dir>/samples/step_N.jsonl``. The console also shows the step in
progress (rollplex.progress: logging.progress) and, at the end, a summary of
the run (`MetricsLogger.summarize_run`). Only rank 0 writes; every rank may call
the logger. ``start_run_files`` makes those files a run's own before it logs (a
resumed run's cut back to its checkpoint's step, a new run's earlier ones set
aside). ``read_metrics`` reads the metrics file back.

Metric names follow verl where verl has the metric, so runs can be compared with
verl's tooling and dashboards:

    critic/score/mean, /max, /min  sequence-level reward over the step's responses
    critic/rewards/mean, /max, /min   the rewards the advantages were computed from
    critic/advantages/mean, /max, /min   advantages (the mean over response tokens)
    prompt_length/mean, /max, /min  prompt tokens per sample, image and video tokens included
    response_length/mean, /max, /min  response tokens per sample
    response_length/clip_ratio     fraction of responses cut at the length limit
    training/epoch                 the pass over the training files the step's batch starts in (files only)
    timing_s/step                  wall seconds of the whole step
    timing_s/gen                   rollout (generation)
    timing_s/reward                reward computation
    timing_s/old_log_prob          recomputing old log-probs with the trainer
    timing_s/ref                   reference-policy log-probs
    timing_s/update_actor          the optimizer step(s)
    timing_s/update_weights        making updated weights visible to the rollout engine
    perf/throughput                tokens (prompt + response) per second per GPU
    perf/mfu/actor                 model FLOPs utilisation of the actor update
    perf/max_memory_allocated_gb   torch peak allocated memory, GiB
    actor/pg_loss, actor/kl_loss, actor/entropy
    actor/pg_clipfrac              fraction of tokens clipped by the upper ratio bound
    actor/pg_clipfrac_lower        ... by the dual-clip lower bound
    actor/ppo_kl                   approximate KL between the old and current policy
    actor/grad_norm, actor/lr
    training/rollout_probs_diff_mean, _max
                                   |p_rollout - p_trainer| over response tokens

Rollplex's own (no verl equivalent):

    val/score                      mean validation reward; val/score/<data_source> each source's
    data/skipped_total             training rows found unusable (too long, unreadable) since the process started
    reward/errors                  responses whose reward call failed (raised, returned no finite score, or its
                                   worker died); reward/timeouts those not scored within data.reward_timeout_s
    reward/<name>/mean             each number of a dict reward's result (its components)
    timing_s/data                  what the step waited for its batch (prepared a step ahead; in timing_s/step)
    actor/skipped_steps_total      optimizer steps skipped (a non-finite loss, gradient or logprob) since the
                                   process started
    training/nonfinite_logprobs    non-finite token logprobs in the step's reference, old and actor passes,
                                   all ranks (a token counts once per pass); any skips its optimizer step
    weights/bytes_shared           weight bytes the engine reads in place (the trainer's own tensors)
    weights/bytes_viewed           ... reads through a slice/stride view of them
    weights/bytes_rebuilt          ... rebuilds into its own buffer after each optimizer step
    weights/bytes_rebuilt_experts  of those, experts that expert parallelism split (parallel.ep > 1)
    perf/gpu_util_mean             mean NVML GPU utilisation during the step, percent (GpuMonitor)
    perf/gpu_mem_used_gb_max       peak NVML used memory during the step, GiB, all processes (GpuMonitor)
    perf/live_memory_gb            tensor memory held between steps, GiB (CUDA: every step; CPU: steps that save)
    moe/aux_loss                   MoE models: the load-balancing loss over the update's response tokens
                                   (algorithm.moe_aux_loss_coef weighs it into the loss)
    moe/expert_load_max_over_mean  MoE: the busiest expert's token count over the mean, per layer, averaged
    moe/routing_agreement          MoE with algorithm.routing_replay: the share of replayed token-layer top-k
                                   sets that the update's live router picks too

A name ending in _total is a running count, not the step's own: a resumed run counts again from 0.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from rollplex.progress import Progress
from rollplex.trackers import TENSORBOARD_DIR, Tracker, open_trackers, require_trackers

log = logging.getLogger(__name__)

GiB = 1024**3
METRICS_FILE, SAMPLES_DIR, CONFIG_FILE = "metrics.jsonl", "samples", "config.yaml"  # in the output folder
_SAMPLES_FILE = re.compile(r"step_(\d+)\.jsonl")

# (metric, console label, unit suffix) for the console line of a logged step, in print order.
_CONSOLE_KEYS = (
    ("critic/score/mean", "score", ""),
    ("val/score", "val", ""),
    ("response_length/mean", "len", ""),
    ("actor/pg_loss", "pg_loss", ""),
    ("timing_s/step", "step time", "s"),
    ("perf/throughput", "tok/s/gpu", ""),
)


def _clean(value: Any) -> int | float | None:
    """A JSON-safe number: ints stay exact, floats keep 6 significant digits
    (more is noise for a training curve and bloats the file), NaN/inf become None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    value = float(value)  # also takes 0-dim tensors and numpy scalars
    if not math.isfinite(value):
        return None
    return float(f"{value:.6g}")


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


@dataclass
class RunHighlights:
    """What a run's end summary reports of its logged steps: val/score, best and final, and the final
    critic/score/mean, each as (value, step)."""

    best_val: tuple[float, int] | None = None  # the first step of the highest
    final_val: tuple[float, int] | None = None
    final_score: tuple[float, int] | None = None

    def add(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if (val := record.get("val/score")) is not None:
            self.final_val = (val, step)
            if self.best_val is None or val > self.best_val[0]:
                self.best_val = (val, step)
        if (score := record.get("critic/score/mean")) is not None:
            self.final_score = (score, step)

    def lines(self) -> list[str]:
        lines = []
        if self.final_val is not None:
            (val, step), (best, best_step) = self.final_val, self.best_val
            best_text = " (the best)" if best_step == step else f" (best {best:.4g} at step {best_step})"
            lines.append(f"val/score {val:.4g} at step {step}{best_text}")
        if self.final_score is not None:
            lines.append(f"mean reward (critic/score/mean) {self.final_score[0]:.4g} at step {self.final_score[1]}")
        return lines


class MetricsLogger:
    """Writes one record per step to metrics.jsonl, the console and (optionally) trackers, and
    the samples files and console messages the loop asks for.

    Safe to construct and call on every rank: ranks other than 0 do nothing, so
    the caller needs no rank checks. The JSONL file is opened in append mode so
    a resumed run continues it (the trainer first cuts it back to the resumed
    step: ``start_run_files``).
    """

    def __init__(self, output_dir: str | Path, rank: int = 0, console: bool = True, jsonl: bool = True,
                 tensorboard: bool = False, total_steps: int | None = None, wandb: bool = False,
                 swanlab: bool = False, project: str = "rollplex", run_name: str = "",
                 run_config: dict[str, Any] | None = None, resumed_step: int | None = None,
                 progress: str = "off", progress_every_s: float = 30.0):
        """`wandb`, `swanlab`: log to those trackers too (rollplex.trackers), as run `run_name` (empty: the
        output folder's name) of `project`, with `run_config` (the run's config) as the run's config.
        `resumed_step`: the checkpoint's step a resumed run continues from (None: a new run).
        `progress`, `progress_every_s`: how the console shows the step in progress (`self.progress`)."""
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.active = rank == 0
        self.console = console and self.active
        # The trainer, engine and actor report to it; the logger's own lines go through it (above a live line).
        self.progress = Progress(progress if self.console else "off", progress_every_s, total_steps)
        self._start = time.monotonic()
        self._first_logged: tuple[int, float] | None = None  # (step, time) of this session's first log
        self._file = None
        self._samples_step: int | None = None  # the step this logger last wrote samples for
        self._trackers: list[Tracker] = []
        self.highlights = RunHighlights()
        extras = [name for name, on in (("wandb", wandb), ("swanlab", swanlab)) if on]
        require_trackers(["tensorboard"] * tensorboard + extras)  # on every rank, so that all stop alike
        if not self.active:
            return
        if jsonl and resumed_step is not None and (self.output_dir / METRICS_FILE).is_file():
            for record in read_metrics(self.output_dir / METRICS_FILE):  # the steps before the resume
                self.highlights.add(record)
        if jsonl:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            path = self.output_dir / METRICS_FILE
            # A run killed mid-write can leave a line without its newline; start on a fresh line
            # so the first record of the resumed run is not glued onto it.
            self._file = path.open("a", encoding="utf-8")
            if self._file.tell() > 0 and _last_byte(path) != b"\n":
                self._file.write("\n")
        if extras:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        first_step = None if resumed_step is None else resumed_step + 1
        self._trackers = open_trackers(self.output_dir, tensorboard, extras, project, run_name, run_config or {},
                                       first_step)

    @property
    def metrics_path(self) -> Path | None:
        """The metrics.jsonl this logger writes (None: logging.jsonl is off, or not rank 0)."""
        return None if self._file is None else self.output_dir / METRICS_FILE

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self.highlights.add(record)
        if self._file is not None:
            # allow_nan=False: _clean already mapped non-finite values to null, this guards the guarantee.
            self._write_record(json.dumps(record, allow_nan=False) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step" and v is not None}
        for tracker in self._trackers:
            tracker.log(record["step"], scalars)
        if self.console:
            self.progress.write(self._step_line(step, record))

    def _write_record(self, line: str) -> None:
        try:
            self._file.write(line)
            self._file.flush()  # a crash loses at most the step being logged
        except OSError as error:  # a full disk, say: raised naming the file, whose unwritten record is dropped
            self._drop_file()
            path = self.output_dir / METRICS_FILE
            raise OSError(error.errno, error.strerror, str(path)) from error

    def _drop_file(self) -> None:
        """Close the metrics file, giving up what it could not write, so that `close` does not fail on it again."""
        file, self._file = self._file, None
        try:
            file.close()  # flushes the record once more
        except OSError:
            pass  # the caller raises the error that made it give the file up

    def message(self, text: str) -> None:
        """A line for the user on the console (rank 0): the start-up summary, a save, an evaluation."""
        if self.console:
            self.progress.write(text)

    def summarize_run(self, step: int, steps_run: int, checkpoint: Path | None,
                      exported: tuple[str, Path] | None) -> None:
        """The run's end on the console (rank 0): `step` reached, `steps_run` of them in this process, its wall
        time, val/score and mean reward, the last `checkpoint`, `exported` (what, where: trainer.save_hf's
        folder) and the metrics file."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        lines = [f"run complete: step {step}{total} in {self.output_dir} ({steps_run} step(s) in this process, "
                 f"{_hms(time.monotonic() - self._start)})", *self.highlights.lines(),
                 f"last checkpoint: {checkpoint}" if checkpoint else "no checkpoint"]
        if exported is not None:
            lines.append(f"{exported[0]}: {exported[1]}")
        if self.metrics_path is not None:
            lines.append(f"metrics: {self.metrics_path}")
        self.message("\n  ".join(lines))

    def log_samples(self, step: int, records: list[dict[str, Any]]) -> Path | None:
        """Write `records` (prompt, response, answer, score, ...: JSON-serialisable) to
        <output_dir>/samples/step_N.jsonl, one a line: after those already written for `step` by
        this logger, else in place of a file an earlier run left for that step (a resumed run
        redoes it). Returns the file's path (rank 0), None elsewhere or when there are no records."""
        if not self.active or not records:
            return None
        path = self.output_dir / SAMPLES_DIR / f"step_{step:08d}.jsonl"  # named as the checkpoints are
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a" if step == self._samples_step else "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        self._samples_step = step
        return path

    def _step_line(self, step: int, record: dict[str, Any]) -> str:
        now = time.monotonic()
        if self._first_logged is None:
            self._first_logged = (step, now)
        first_step, first_time = self._first_logged
        head = f"step {step}" if self.total_steps is None else f"step {step}/{self.total_steps}"
        parts = [f"{head} | {_hms(now - self._start)} elapsed"]
        if self.total_steps is not None:
            # Time per step from this session's logs only: it excludes startup, and a resumed
            # run's earlier steps, which this process never timed.
            if step > first_step:
                per_step = (now - first_time) / (step - first_step)
            else:
                per_step = record.get("timing_s/step")
            if per_step is not None:
                parts[0] += f", ETA {_hms(max(self.total_steps - step, 0) * per_step)}"
        for key, label, unit in _CONSOLE_KEYS:
            value = record.get(key)
            if value is not None:
                parts.append(f"{label} {value:.4g}{unit}")
        return " | ".join(parts)

    def close(self) -> None:
        self.progress.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (or of the one in a run directory), in step order.

    A resumed run restarts at its last checkpoint, so the records a crashed run
    wrote after that checkpoint are superseded: a record with a step at or
    below the previous one drops the earlier records from that step on (the
    trainer drops them from the file as it resumes; a file appended to by
    loggers alone, or by earlier versions, still holds them). Lines
    that are not valid JSON (a write cut short by a crash) are skipped with a warning.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records: list[dict[str, Any]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{lineno}: skipping a line that is not valid JSON", stacklevel=2)
            continue
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    return records


def start_run_files(output_dir: str | Path, resumed_step: int | None) -> str | None:
    """Make a run's metrics.jsonl and samples files hold its own steps, before its logger opens them (rank 0).

    A run that resumes from the checkpoint of `resumed_step` continues them: the records and samples files of
    later steps (the interrupted run's, after that checkpoint: the resumed run redoes them) are dropped, and so
    are lines a crash cut short and records a later one supersedes (files appended to by earlier versions); lines
    without a step are kept. A new run (`resumed_step` None) starts them anew: an earlier run's metrics.jsonl,
    samples folder, config.yaml and TensorBoard folder are renamed metrics.<time>.jsonl, samples.<time>,
    config.<time>.yaml and tb.<time>. (A resumed run's TensorBoard events are cut by its writer: MetricsLogger.)
    Returns a line for the user saying what changed, None when nothing did."""
    output_dir = Path(output_dir)
    if resumed_step is None:
        return _set_aside(output_dir)
    dropped = _cut_metrics(output_dir / METRICS_FILE, resumed_step)
    later = [p for step, p in _samples_files(output_dir) if step > resumed_step]
    for path in later:  # after the metrics: a crash between the two leaves both to cut again at the next start
        path.unlink()
    if not dropped and not later:
        return None
    return (f"resuming {output_dir} at step {resumed_step}: dropped the steps after it, which the run redoes "
            f"({dropped} line(s) of {METRICS_FILE}, {len(later)} samples file(s))")


def _samples_files(output_dir: Path) -> list[tuple[int, Path]]:
    folder = output_dir / SAMPLES_DIR
    found = [(_SAMPLES_FILE.fullmatch(p.name), p) for p in folder.iterdir()] if folder.is_dir() else []
    return [(int(m.group(1)), p) for m, p in found if m]


def _cut_metrics(path: Path, step: int) -> int:
    """Rewrite `path` with the records up to `step` that no later record supersedes; returns the lines dropped."""
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept, earliest_after = [], math.inf  # the lowest step logged after the line at hand
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a write a crash cut short
        at = record.get("step") if isinstance(record, dict) else None
        if not isinstance(at, int):
            kept.append(line)  # no step: a header, kept where it is
            continue
        if at <= step and at < earliest_after:
            kept.append(line)
        earliest_after = min(earliest_after, at)
    if len(kept) < len(lines):
        _replace_text(path, "".join(line + "\n" for line in reversed(kept)))
    return len(lines) - len(kept)


def _replace_text(path: Path, text: str) -> None:
    """Write `path` anew through a temporary file and a rename: a crash leaves the old file or the new, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _set_aside(output_dir: Path) -> str | None:
    """An earlier run's files (those not empty), renamed with the time."""
    earlier = [output_dir / name for name in (METRICS_FILE, SAMPLES_DIR, CONFIG_FILE, TENSORBOARD_DIR)]
    earlier = [p for p in earlier
               if (p.is_file() and p.stat().st_size) or (p.is_dir() and any(p.iterdir()))]
    if not earlier:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for tag in itertools.chain([stamp], (f"{stamp}-{n}" for n in itertools.count(2))):  # -2: another this second
        stamped = {p: p.with_name(f"{p.stem}.{tag}{p.suffix}") for p in earlier}
        if not any(new.exists() for new in stamped.values()):
            break
    for old, new in stamped.items():
        old.rename(new)
    kept = ", ".join(f"{old.name} as {new.name}" for old, new in stamped.items())
    return f"new run in {output_dir}: kept the earlier run's {kept}"


def _cuda_sync() -> None:
    # is_initialized, not is_available: a CPU run on a GPU machine must not create a CUDA context here.
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Accumulates wall seconds per phase: ``with timer("gen"): ...``.

    On CUDA the device is synchronised before each clock read, so a phase is
    charged for the kernels it queued and not for those queued before it.
    Re-entering a name adds to its total; each step uses a new Timer.
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        _cuda_sync()
        start = time.perf_counter()
        yield
        _cuda_sync()
        self._totals[name] = self._totals.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": seconds for name, seconds in self._totals.items()}


def _open_nvml_device(device: torch.device | int | None) -> Any | None:
    """The NVML handle of the local CUDA device, or None when there is none or NVML fails.

    The device is looked up by UUID because NVML numbers every GPU in the
    machine, whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say.
    """
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
        uuid = str(props.uuid)
        if not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as e:  # pynvml missing, no driver, MIG slice without NVML access, ...
        log.debug("GPU sampling is off: %s", e)
        return None


class GpuMonitor:
    """Samples NVML utilisation and used memory of the local GPU on a background thread.

    ``with sampler: <one step>`` then ``sampler.as_metrics()``. Each ``start()``
    clears the previous samples. Without an NVIDIA GPU, or when NVML cannot be
    initialised, it does nothing and ``as_metrics()`` is empty.
    """

    def __init__(self, interval_s: float = 1.0, device: torch.device | int | None = None):
        self.interval_s = interval_s
        self._handle = _open_nvml_device(device)
        self._util: list[float] = []
        self._mem: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._util, self._mem = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="GpuMonitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        import pynvml

        # Sample at once, so a step shorter than the interval still gets one sample.
        while True:
            try:
                self._util.append(float(pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))
                self._mem.append(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used / GiB)
            except pynvml.NVMLError as e:
                log.debug("GPU sampling stopped: %s", e)
                return
            if self._stop.wait(self.interval_s):
                return

    def as_metrics(self) -> dict[str, float]:
        util, mem = list(self._util), list(self._mem)  # copies: the thread may still be appending
        if not util or not mem:
            return {}
        return {"perf/gpu_util_mean": sum(util) / len(util), "perf/gpu_mem_used_gb_max": max(mem)}

    def close(self) -> None:
        self.stop()
        if self._handle is not None:
            import pynvml

            self._handle = None
            pynvml.nvmlShutdown()

    def __enter__(self) -> GpuMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
