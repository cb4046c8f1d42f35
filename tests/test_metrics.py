"""rollplex.metrics (logger, samples files, trackers, Timer, GpuMonitor, read_metrics) and tools/plot_run.py."""

import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from offline_trackers import swanlab_history, wandb_run
from rollplex import metrics as M
from rollplex.metrics import GpuMonitor, MetricsLogger, Timer, read_metrics
from rollplex.trackers import TrackerMissing

ROOT = Path(__file__).resolve().parent.parent


def lines(run_dir: Path) -> list[dict]:
    """Each line parsed strictly: NaN or Infinity tokens would be invalid JSON."""
    def reject(token):
        raise ValueError(f"invalid JSON constant {token}")

    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line, parse_constant=reject) for line in text.splitlines()]


def test_logger_writes_one_json_line_per_step(tmp_path, capsys):
    with MetricsLogger(tmp_path, total_steps=10) as logger:
        logger.log(1, {"critic/score/mean": 0.5, "timing_s/step": 2.0, "actor/lr": 1e-6})
        logger.log(2, {"critic/score/mean": 0.123456789, "response_length/mean": torch.tensor(17.0),
                       "weights/bytes_shared": 6_123_456_789, "val/score": 0.75})
    first, second = lines(tmp_path)
    assert first == {"step": 1, "critic/score/mean": 0.5, "timing_s/step": 2.0, "actor/lr": 1e-6}
    assert second["critic/score/mean"] == 0.123457  # 6 significant digits
    assert second["response_length/mean"] == 17.0  # tensors are converted
    assert second["weights/bytes_shared"] == 6_123_456_789  # ints stay exact
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2
    assert out[0].startswith("step 1/10 |") and "ETA" in out[0] and "score 0.5" in out[0]
    assert out[1].startswith("step 2/10 |") and "len 17" in out[1] and "val 0.75" in out[1]
    assert "val" not in out[0]  # shown on the steps that evaluate


def test_non_finite_values_become_null(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        logger.log(0, {"actor/pg_loss": float("nan"), "actor/grad_norm": float("inf"), "actor/lr": 1e-3})
    (record,) = lines(tmp_path)
    assert record == {"step": 0, "actor/pg_loss": None, "actor/grad_norm": None, "actor/lr": 1e-3}


def test_second_logger_appends_and_read_metrics_drops_superseded_steps(tmp_path):
    with MetricsLogger(tmp_path, console=False) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"critic/score/mean": float(step)})
    # A crash mid-write leaves a line without its newline.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "critic/sc')
    # The run resumes from its step-2 checkpoint, so the old step 3 is superseded.
    with MetricsLogger(tmp_path, console=False) as logger:
        for step in (3, 4):
            logger.log(step, {"critic/score/mean": 10.0 * step})
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(raw) == 6  # nothing overwritten, the torn line kept apart from the new records
    with pytest.warns(UserWarning, match="not valid JSON"):
        records = read_metrics(tmp_path)
    assert [(r["step"], r["critic/score/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    with pytest.warns(UserWarning):
        assert read_metrics(tmp_path / "metrics.jsonl") == records


def test_nonzero_rank_writes_nothing(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    # TensorBoard "installed" (it is checked on every rank), a writer that rank 1 must never make.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=None))
    with MetricsLogger(run_dir, rank=1, tensorboard=True, total_steps=5) as logger:
        logger.log(1, {"critic/score/mean": 1.0})
    assert not run_dir.exists()
    assert capsys.readouterr().out == ""


def test_missing_tensorboard_stops_the_run_before_it_writes_naming_the_extra(tmp_path, monkeypatch):
    # None in sys.modules makes the import fail, whether or not tensorboard is installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TrackerMissing, match=r"logging.tensorboard is on but the tensorboard package is not "
                                             r"installed: pip install 'rollplex\[tensorboard\]'"):
        MetricsLogger(tmp_path, console=False, tensorboard=True)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_resumed_runs_tensorboard_events_start_after_its_checkpoint(tmp_path, monkeypatch):
    """TensorBoard's writer hides the interrupted run's events from the resumed run's first step on (purge_step),
    as metrics.jsonl is cut back to the checkpoint: each step shows once."""
    writers = []

    class RecordingWriter:  # the SummaryWriter interface the tracker uses
        def __init__(self, log_dir, purge_step=None):
            self.log_dir, self.purge_step, self.scalars = log_dir, purge_step, []
            writers.append(self)

        def add_scalar(self, key, value, global_step):
            self.scalars.append((global_step, key, value))

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=RecordingWriter))
    with MetricsLogger(tmp_path, console=False, tensorboard=True, resumed_step=60) as logger:
        logger.log(61, {"actor/lr": 1.0})
    with MetricsLogger(tmp_path / "new", console=False, tensorboard=True):
        pass
    assert [(w.log_dir, w.purge_step) for w in writers] == [(str(tmp_path / "tb"), 61), (str(tmp_path / "new/tb"), None)]
    assert writers[0].scalars == [(61, "actor/lr", 1.0)]


def test_tensorboard_events_read_back_with_tensorboards_own_reader(tmp_path):
    """The [tensorboard] extra for real: the events a run writes are the steps' numbers, in <output_dir>/tb."""
    pytest.importorskip("tensorboard")  # the dev extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, console=False, tensorboard=True) as logger:
        for step in (1, 2):
            logger.log(step, {"critic/score/mean": 0.25 * step, "actor/lr": 1e-6})
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
    assert "actor/lr" in events.Tags()["scalars"]


def test_samples_of_a_step_go_to_its_file_and_a_resumed_run_replaces_it(tmp_path):
    train = {"split": "train", "prompt": "What colour?", "response": "rouge ✓", "answer": "red", "score": 0.0}
    val = {**train, "split": "val", "score": 1.0}
    with MetricsLogger(tmp_path, console=False) as logger:
        path = logger.log_samples(5, [train, train])
        assert logger.log_samples(5, [val]) == path  # the step's evaluation: the same file
        assert logger.log_samples(6, []) is None
    assert path == tmp_path / "samples" / "step_00000005.jsonl"
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [train, train, val]
    with MetricsLogger(tmp_path, console=False) as logger:  # resumed before step 5: its samples are redone
        logger.log_samples(5, [val])
    assert [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] == [val]
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step_00000005.jsonl"]
    with MetricsLogger(tmp_path / "other", rank=1) as logger:
        assert logger.log_samples(5, [train]) is None
    assert not (tmp_path / "other").exists()


def test_messages_go_to_the_console_of_rank_0_only(tmp_path, capsys):
    MetricsLogger(tmp_path, jsonl=False).message("step 10: saved a checkpoint")
    MetricsLogger(tmp_path, jsonl=False, rank=1).message("from rank 1")
    MetricsLogger(tmp_path, jsonl=False, console=False).message("console off")
    assert capsys.readouterr().out == "step 10: saved a checkpoint\n"


STEPS = {1: {"critic/score/mean": 0.25, "actor/pg_loss": float("nan")}, 2: {"critic/score/mean": 0.5, "val/score": 1.0}}
LOGGED = {1: {"critic/score/mean": 0.25}, 2: {"critic/score/mean": 0.5, "val/score": 1.0}}  # no NaN


def _log_steps(run_dir: Path, **tracker) -> None:
    with MetricsLogger(run_dir, console=False, project="tests", run_name="offline", run_config={"rollout": {"n": 4}},
                       **tracker) as logger:
        for step, metrics in STEPS.items():
            logger.log(step, metrics)


def test_wandb_offline_run_holds_each_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: the run stays in <output_dir>/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_steps(tmp_path, wandb=True)
    history, config = wandb_run(tmp_path)
    assert history == LOGGED
    assert config["rollout"] == {"n": 4}
    assert (tmp_path / "metrics.jsonl").is_file()  # beside, not instead of, the JSONL


def test_swanlab_offline_run_holds_each_step(tmp_path, monkeypatch):
    pytest.importorskip("swanlab")
    monkeypatch.setenv("SWANLAB_MODE", "offline")  # no network: the run stays in <output_dir>/swanlog
    _log_steps(tmp_path, swanlab=True)
    assert swanlab_history(tmp_path) == LOGGED


@pytest.mark.parametrize("tracker", ["wandb", "swanlab"])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_missing_tracker_is_an_error_naming_its_extra_on_every_rank(tmp_path, monkeypatch, tracker, rank):
    monkeypatch.setitem(sys.modules, tracker, None)  # hidden, whether installed or not
    with pytest.raises(ImportError, match=rf"pip install 'rollplex\[{tracker}\]'"):
        MetricsLogger(tmp_path, rank=rank, **{tracker: True})
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_timer_accumulates_per_name():
    timer = Timer()
    for _ in range(2):
        with timer("gen"):
            time.sleep(0.01)
    with timer("update_actor"):
        pass
    got = timer.as_metrics()
    assert set(got) == {"timing_s/gen", "timing_s/update_actor"}
    assert 0.02 <= got["timing_s/gen"] < 1.0 and got["timing_s/update_actor"] < got["timing_s/gen"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_monitor_is_a_quiet_no_op_without_a_gpu(recwarn):
    sampler = GpuMonitor(interval_s=0.01)
    with sampler:
        pass
    assert not sampler.enabled and sampler.as_metrics() == {}
    sampler.close()
    assert len(recwarn) == 0


class FakeNvml:
    """Stands in for pynvml: each utilisation query moves on to the next (util %, used GiB) reading,
    and the last reading repeats."""

    NVMLError = RuntimeError

    def __init__(self, readings: list[tuple[int, float]]):
        self.readings, self.i = readings, -1

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.i = min(self.i + 1, len(self.readings) - 1)
        return types.SimpleNamespace(gpu=self.readings[self.i][0])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.readings[self.i][1] * M.GiB)

    def nvmlShutdown(self):
        pass


def test_gpu_monitor_thread_with_a_fake_nvml(monkeypatch):
    """The sampling thread's logic, on CPU."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([(10, 1.0), (30, 3.0), (20, 2.0)]))
    monkeypatch.setattr(M, "_open_nvml_device", lambda device: object())
    sampler = GpuMonitor(interval_s=0.001)
    assert sampler.enabled
    with sampler:
        deadline = time.monotonic() + 5
        while len(sampler._util) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    # The first three readings average 20 and every later one is 20.
    assert sampler.as_metrics() == {"perf/gpu_util_mean": 20.0, "perf/gpu_mem_used_gb_max": 3.0}
    sampler.start()  # a new step starts from no samples, and samples at once
    sampler.stop()
    assert sampler.as_metrics() == {"perf/gpu_util_mean": 20.0, "perf/gpu_mem_used_gb_max": 2.0}
    sampler.close()


def _synthetic_run(run_dir: Path, steps: int = 20) -> None:
    with MetricsLogger(run_dir, console=False) as logger:
        for step in range(1, steps + 1):
            metrics = {"critic/score/mean": step / steps, "critic/score/min": 0.0, "critic/score/max": 1.0,
                       "response_length/mean": 100 + 3 * step, "timing_s/step": 3.0, "timing_s/gen": 2.0,
                       "timing_s/update_actor": 0.8, "actor/pg_loss": math.nan}
            if step % 5 == 0:
                metrics["val/score"] = step / steps
            logger.log(step, metrics)


def _load_plot_tool():
    """tools/plot_run.py as a module, run in this process: a subprocess would spend seconds importing torch."""
    spec = importlib.util.spec_from_file_location("plot_run", ROOT / "tools" / "plot_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plot(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["plot_run.py", *args])
    return _load_plot_tool().main()


def test_plot_run_writes_a_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    _synthetic_run(tmp_path)
    assert _plot(monkeypatch, str(tmp_path)) == 0
    png = tmp_path / "curves.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "elsewhere.png"
    assert _plot(monkeypatch, str(tmp_path), "--out", str(out)) == 0 and out.stat().st_size > 1000


def test_plot_run_without_matplotlib_exits_2(tmp_path, monkeypatch, capsys):
    _synthetic_run(tmp_path, steps=2)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # hidden, whether installed or not
    assert _plot(monkeypatch, str(tmp_path)) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "curves.png").exists()
