"""tools/device_run.sh and tools/gpu_check.py, end to end on the CPU at their smallest
sizes: the device command a GPU session runs, so that its 15 minutes are not lost
to an error in the script itself. The GPU paths themselves are not tested here."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import gpu_check  # noqa: E402


def run_device_command(out: Path, *options: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), ROLLPLEX_COMMIT="test-commit", PYTHON=sys.executable)
    return subprocess.run(["bash", str(REPO / "tools/device_run.sh"), "--device", "cpu", *options], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)


def test_device_command_runs_every_check_on_cpu(tmp_path):
    res = run_device_command(tmp_path)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["checks"]) == list(gpu_check.CHECKS)  # every check, most important first
    assert all(c["ok"] for c in report["checks"].values())
    assert report["commit"] == "test-commit"
    assert report["checks"]["engine_cuda_graphs"]["larger_pool"]["captures_so_far"] == 2
    assert report["checks"]["engine_throughput_3b"]["captures_in_timed_window"] == 0
    bench = report["checks"]["bench_schedules"]
    assert bench["same_samples"] and bench["overlap_vs_serial_prefix_rel_diff_per_step"] == [0.0, 0.0]
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["bench_schedules/report.json", "bench_schedules/timeline.png", "gpu_check.json",
                     "gpu_check.log"]  # within the 8 files a device call returns
    assert "report written to" in (tmp_path / "gpu_check.log").read_text()


def test_unknown_check_is_an_error(tmp_path):
    res = run_device_command(tmp_path, "--only", "engine_cuda_graph")
    assert res.returncode == 2 and "unknown check(s) engine_cuda_graph" in res.stderr + res.stdout


def test_checks_past_the_budget_are_reported_not_run(tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--budget-s", "0",
                           "--only", "forward_timing_3b"]) == 1
    check = json.loads(out.read_text())["checks"]["forward_timing_3b"]
    assert check == {"ok": False, "error": "not run: the time budget was spent"}


def test_a_check_that_raises_is_recorded_as_failed(tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cuda", "--out", str(out)]) == 2  # no CUDA here: refused up front
    result = gpu_check.run_in_child("forward_timing_3b", "cuda", timeout=120)  # in its own process
    assert result["ok"] is False and "Error" in result["error"] and result["traceback"]
