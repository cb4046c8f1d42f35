"""tools/bench_schedules.py runs the four colocated schedules end to end on a tiny
CPU workload and writes its report, traces and timeline; under torchrun with 2
processes, the disaggregated baseline as a fifth; `--schedules` runs some, with
the report rewritten after each. No timing assertions: the figures depend on the
machine."""

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_schedules  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TINY = ["--steps", "1", "--data.task", "direction", "--data.batch_size", "2", "--rollout.n", "2", "--rollout.min_tokens", "1",
        "--rollout.max_tokens", "4",
        "--algorithm.kl_coef", "0.01", "--rollout.kv_cache_memory", "16e6", "--trainer.num_threads", "1"]


def assert_same_samples(report: dict) -> None:
    """Every schedule sampled the same token ids at every step (warm-up, measured, traced), and the tool says so."""
    digests = {n: s["sample_digests"] for n, s in report["schedules"].items()}
    assert all(len(d) == 3 for d in digests.values()), digests
    assert len({tuple(d) for d in digests.values()}) == 1, digests
    assert len(set(next(iter(digests.values())))) == 3  # each step's prompts and seeds are its own
    assert report["same_samples"] is True


def test_bench_schedules_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    returned = bench_schedules.main(TINY + ["--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["ratios"] == returned["ratios"]
    schedules = report["schedules"]
    assert list(schedules) == ["serial-naive", "serial-prefix", "overlap", "overlap-stream"]
    for s in schedules.values():
        assert len(s["steps"]) == 1 and s["warmup"] and s["traced"]
        assert s["config"]["data"]["task"] == "direction" and s["config"]["rollout"]["n"] == 2
        assert (out / s["trace"]).stat().st_size > 0
    assert schedules["serial-naive"]["config"]["schedule"]["share_prefix"] is False
    assert schedules["overlap"]["config"]["schedule"]["kind"] == "overlap"

    assert_same_samples(report)  # the same prompts and samples in every schedule, at every step
    tput = {n: s["mean"]["perf/throughput"] for n, s in schedules.items()}
    r = report["ratios"]
    assert r["throughput_overlap_over_serial_naive"] == pytest.approx(tput["overlap"] / tput["serial-naive"])
    assert r["throughput_overlap_over_serial_prefix"] == pytest.approx(tput["overlap"] / tput["serial-prefix"])
    assert r["throughput_serial_prefix_over_serial_naive"] == pytest.approx(tput["serial-prefix"] / tput["serial-naive"])
    assert all(math.isfinite(v) for v in r.values()) and r["decode_slowdown"] > -1
    assert r["decode_slowdown_overlap_stream"] > -1
    prefix = schedules["serial-prefix"]["mean"]
    assert r["finished_group_work_share_serial_prefix"] == pytest.approx(
        prefix["timing_s/stream_exposed"] / prefix["timing_s/step"])
    assert 0 < r["prompt_work_share_serial_prefix"] + r["finished_group_work_share_serial_prefix"] < 1

    # The timeline shows the schedules apart: serial-prefix runs its prompt work after
    # the gen phase, overlap between engine steps, serial-naive has none.
    timelines = {n: s["timeline"] for n, s in schedules.items()}
    assert not timelines["serial-naive"]["prefix_spans"]
    serial = timelines["serial-prefix"]
    assert all(a >= serial["gen_end"] for kind, a, b in serial["prefix_spans"] if kind != "vision")
    overlap = timelines["overlap"]
    last_engine_step = overlap["engine_steps"][-1][0]
    assert any(kind != "vision" and b <= last_engine_step for kind, a, b in overlap["prefix_spans"])
    assert overlap["scheduler_step_ends"]
    # overlap-stream also works on the groups that finish first, between engine steps.
    streamed = timelines["overlap-stream"]
    assert any(kind.startswith("group") and b <= streamed["engine_steps"][-1][0]
               for kind, a, b in streamed["prefix_spans"])
    assert (out / "timeline.png").stat().st_size > 0

    printed = capsys.readouterr().out
    assert "random" in printed and "no overlap gain is expected" in printed
    assert "overlap / serial-naive" in printed and "decode slowdown" in printed
    assert "finished groups' work share" in printed
    assert "planned gen" in printed and "disagg" not in printed


def test_the_report_is_written_after_every_schedule(tmp_path, monkeypatch):
    """--schedules runs those, in that order, and report.json is rewritten after each one, so a run cut
    short keeps the schedules it finished; a ratio needs both its schedules."""
    run_schedule = bench_schedules.run_schedule

    def cut_short_at_serial_prefix(name, *args):
        if name == "serial-prefix":
            raise RuntimeError("cut short")
        return run_schedule(name, *args)

    monkeypatch.setattr(bench_schedules, "run_schedule", cut_short_at_serial_prefix)
    out = tmp_path / "bench"
    with pytest.raises(RuntimeError, match="cut short"):
        bench_schedules.main(TINY + ["--schedules", "overlap", "serial-prefix", "--no-trace", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert list(report["schedules"]) == ["overlap"]
    assert len(report["schedules"]["overlap"]["sample_digests"]) == 2  # warm-up and the measured step
    assert report["ratios"] == {} and report["same_samples"] is True


def test_unknown_schedule_is_an_error(capsys):
    with pytest.raises(SystemExit):
        bench_schedules.main(TINY + ["--schedules", "overlap", "disagg"])  # disagg needs 2 ranks
    assert "unknown schedule(s) disagg at 1 rank(s)" in capsys.readouterr().err


def test_same_samples_compares_the_digests_of_every_step():
    a, b = {"sample_digests": ["d0", "d1"]}, {"sample_digests": ["d0", "d1"]}
    assert bench_schedules.same_samples({"a": a, "b": b})[0] is True
    ok, lines = bench_schedules.same_samples({"a": a, "b": {"sample_digests": ["d0", "other"]}})
    assert ok is False and lines[0].endswith("match") and lines[1].endswith("MISMATCH")
    tokens = {0: [[5, 6], [5, 7]], 1: [[8]]}
    assert bench_schedules.digest(tokens) == bench_schedules.digest({1: [[8]], 0: [[5, 6], [5, 7]]})  # by index
    assert bench_schedules.digest(tokens) != bench_schedules.digest({0: [[5, 6], [5, 8]], 1: [[8]]})
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bench_schedules_torchrun_two_ranks(tmp_path):
    """torchrun, 2 CPU processes: the colocated three on both ranks, then disagg with
    rank 1 generating and rank 0 training; rank 0 alone reports."""
    out = tmp_path / "bench"
    # 4 prompts: 2 per rank when colocated, so each of the 2 updates per batch has a prompt on every rank.
    argv = TINY + ["--data.batch_size", "4", "--out", str(out)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(REPO / "tools" / "bench_schedules.py"), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Its own session, so that a hang takes the launcher and both workers down together.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun timed out\nstdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-8000:]}")
    assert proc.returncode == 0, f"stdout:\n{stdout[-4000:]}\nstderr:\n{stderr[-8000:]}"

    report = json.loads((out / "report.json").read_text())
    assert report["world_size"] == 2
    schedules = report["schedules"]
    assert list(schedules) == ["serial-naive", "serial-prefix", "overlap", "overlap-stream", "disagg"]
    disagg = schedules["disagg"]
    assert disagg["config"]["schedule"]["kind"] == "disagg" and disagg["config"]["schedule"]["rollout_ranks"] == 1
    for s in schedules.values():
        assert s["world_size"] == 2 and len(s["steps"]) == 1 and s["warmup"] and s["traced"]
        assert s["config"]["data"]["batch_size"] == 4
        if s is not disagg:  # the memory plan models colocated ranks; the loop plans nothing for disagg
            assert s["mean"]["perf/planned_memory_gb/gen"] > 0 and s["mean"]["perf/planned_memory_gb/update_actor"] > 0
        assert (out / s["trace"]).stat().st_size > 0  # rank 0's, for every schedule
    assert "perf/planned_memory_gb/gen" not in disagg["mean"]

    # disagg's metrics come from rank 0, a trainer: its idle times and the rollout ranks'.
    for row in [disagg["warmup"], *disagg["steps"], disagg["traced"]]:
        for key in ("timing_s/rollout_idle", "timing_s/train_idle", "timing_s/gen", "timing_s/step"):
            assert math.isfinite(row[key]) and row[key] >= 0, key
    timeline = disagg["timeline"]
    assert timeline["from_metrics"] and not timeline["engine_steps"] and not timeline["prefix_spans"]
    assert timeline["gen_end"] == disagg["steps"][-1]["timing_s/train_idle"]

    assert_same_samples(report)  # disagg included
    tput = {n: s["mean"]["perf/throughput"] for n, s in schedules.items()}
    r = report["ratios"]
    assert r["throughput_disagg_over_overlap"] == pytest.approx(tput["disagg"] / tput["overlap"])
    assert r["throughput_disagg_over_serial_naive"] == pytest.approx(tput["disagg"] / tput["serial-naive"])
    assert all(math.isfinite(v) for v in r.values())

    # Rank 0 alone writes: the report, one trace per schedule, the timeline (and the tiny model's folder).
    assert {p.name for p in out.iterdir()} == {"report.json", "timeline.png", "trainer",
                                               *(f"trace_{n}.json.gz" for n in schedules)}
    printed = stdout
    assert printed.count("bench_schedules:") == 1  # rank 0 prints
    assert "rollout ranks idle" in printed and "trainer ranks idle" in printed
    assert "disagg / overlap" in printed and "disagg / serial-naive" in printed and "planned gen" in printed


def test_print_memory_cuda(capsys):
    """The CUDA form of the memory lines (measured peaks, the plan, its error), from made-up means:
    disagg's rank 0 has no gen phase and no plan, so only its measured update peak."""
    colocated = {"perf/planned_memory_gb/gen": 40.0, "perf/planned_memory_gb/update_actor": 60.0,
                 "perf/max_memory_allocated_gb/gen": 42.0, "perf/max_memory_allocated_gb/update_actor": 57.0,
                 "perf/memory_plan_error/gen": 0.05, "perf/memory_plan_error/update_actor": -0.05}
    disagg = {"perf/max_memory_allocated_gb/update_actor": 63.0}
    bench_schedules.print_memory({"overlap": {"mean": colocated}, "disagg": {"mean": disagg}}, cuda=True)
    lines = capsys.readouterr().out.splitlines()
    assert "measured" in lines[0] and "error" in lines[0]
    assert lines[1].split() == ["overlap", "planned", "gen", "40", "update_actor", "60", "measured", "gen", "42",
                                "update_actor", "57", "error", "gen", "+5.0%", "update_actor", "-5.0%"]
    assert lines[2].split() == ["disagg", "planned", "-", "measured", "update_actor", "63", "error", "-"]
    assert "disagg" in lines[3] and "no plan" in lines[3]
