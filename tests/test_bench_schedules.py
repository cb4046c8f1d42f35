"""tools/bench_schedules.py runs the three schedules end to end on a tiny CPU
workload and writes its report, traces and timeline. No timing assertions: the
figures depend on the machine."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_schedules  # noqa: E402

TINY = ["--config", str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"), "--steps", "1",
        "--data.task", "direction", "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4",
        "--algorithm.kl_coef", "0.01", "--rollout.kv_cache_memory", "16e6", "--trainer.num_threads", "1"]


def test_bench_schedules_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    returned = bench_schedules.main(TINY + ["--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["ratios"] == returned["ratios"]
    schedules = report["schedules"]
    assert list(schedules) == ["serial-naive", "serial-prefix", "overlap"]
    for s in schedules.values():
        assert len(s["steps"]) == 1 and s["warmup"] and s["traced"]
        assert s["config"]["data"]["task"] == "direction" and s["config"]["rollout"]["n"] == 2
        assert (out / s["trace"]).stat().st_size > 0
    assert schedules["serial-naive"]["config"]["schedule"]["share_prefix"] is False
    assert schedules["overlap"]["config"]["schedule"]["kind"] == "overlap"

    # The same prompts and samples in every schedule, at every step.
    rows = {n: [s["warmup"], *s["steps"], s["traced"]] for n, s in schedules.items()}
    for key in ("critic/score/mean", "response_length/mean"):
        assert len({tuple(r[key] for r in steps) for steps in rows.values()}) == 1, key
    assert report["same_samples"] is True

    tput = {n: s["mean"]["perf/throughput"] for n, s in schedules.items()}
    r = report["ratios"]
    assert r["throughput_overlap_over_serial_naive"] == pytest.approx(tput["overlap"] / tput["serial-naive"])
    assert r["throughput_overlap_over_serial_prefix"] == pytest.approx(tput["overlap"] / tput["serial-prefix"])
    assert r["throughput_serial_prefix_over_serial_naive"] == pytest.approx(tput["serial-prefix"] / tput["serial-naive"])
    assert all(math.isfinite(v) for v in r.values()) and r["decode_slowdown"] > -1

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
    assert (out / "timeline.png").stat().st_size > 0

    printed = capsys.readouterr().out
    assert "random" in printed and "no overlap gain is expected" in printed
    assert "overlap / serial-naive" in printed and "decode slowdown" in printed
