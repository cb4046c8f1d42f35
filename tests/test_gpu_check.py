"""tools/device_run.sh and tools/gpu_check.py, end to end on the CPU at their smallest
sizes: the device command a GPU session runs, so that its 15 minutes are not lost
to an error in the script itself; and the checks' criteria, on input that must
fail them. The GPU paths themselves are not tested here."""

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

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
    checks = report["checks"]
    assert list(checks) == list(gpu_check.CHECKS)  # every check, most important first, the optional one too
    assert all(c["ok"] is True for c in checks.values()), {n: c.get("failed") or c.get("error") for n, c in
                                                            checks.items() if c["ok"] is not True}
    assert report["commit"] == "test-commit"
    decode = checks["engine_throughput_3b"]
    assert all(decode[setup]["captures_in_timed_window"] == 0 for setup in gpu_check.DECODE_SETUPS)
    assert checks["overlap_stream_step"]["decode_window_calls"]["stream"] > 0
    # The fused decode layer against the torch ops: every comparison ran, and its launches are the design's.
    assert list(checks["engine_cuda_graphs"]["logprob_max_abs_diff"]) == [
        "mixed", "larger", "moved_pool", "cascade_mixed", "cascade_larger"]
    fused_layer = checks["decode_layer"]["batch_4"]["fused"]
    assert fused_layer["launches"] == 12 and fused_layer["kernel_classes"]["other"] == {}
    bench = checks["bench_schedules"]
    assert bench["against_serial_prefix"]["overlap"]["rel_diff_per_step"] == [0.0, 0.0, 0.0]  # exact on CPU
    digests = bench["sample_digests"]
    assert len(set(map(tuple, digests.values()))) == 1 and len(set(digests["serial-prefix"])) == 3
    assert all(d > 0 for d in checks["bench_small_prefix_budget"]["prefix_deferred_items"]["overlap-small-budget"])
    # Qwen3.5: fla runs on CUDA only, so the CPU compares the torch ops with themselves, and says so.
    qwen3_5 = checks["qwen3_5"]
    assert qwen3_5["fla"]["compared"] == "torch against torch (CPU: fla runs on CUDA only)"
    assert qwen3_5["engine_vs_transformers"]["samples_equal_transformers_greedy_share"] == 1.0
    # MoE, a tiny stand-in for the 35B-A3B shapes: experts with no rows; replay that overrode the live router;
    # graph-replayed decode steps that recorded routes, with no capture in the second generation.
    moe = checks["moe"]
    assert moe["grouped_gemm"]["empty_experts"] > 0
    assert moe["train_step"]["replayed_routes_live_agreed_share"] < 1
    replayed = moe["engine_routes"]["graph_replay"]
    assert replayed["decode_steps"] > 0 and replayed["captures"] == 0
    # Multi-turn episodes: graphed (run ahead) against eager, every sample continued with an observation.
    multi_turn = checks["multi_turn"]
    assert all(n > 0 for n in multi_turn["observation_tokens"]) and multi_turn["trainer_probs_max_abs_diff"] <= 1e-5
    assert list(json.loads((tmp_path / "bench_schedules/report.json").read_text())["schedules"]) == [
        "serial-prefix", "overlap", "overlap-stream"]
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["bench_schedules/report.json", "bench_schedules/timeline.png", "bench_serial_naive/report.json",
                     "bench_small_prefix_budget/report.json", "gpu_check.json",
                     "gpu_check.log"]  # within the 8 files a device call returns
    assert "report written to" in (tmp_path / "gpu_check.log").read_text()


def test_the_required_checks_fit_the_default_budget_with_time_to_spare():
    """The estimates (compiles included) of every required check, with a process start for each run of
    one process, leave SPARE_S of the default budget; the optional ones come after them all, and the GPU
    test cases run before the schedule benchmark, not last."""
    names = list(gpu_check.CHECKS)
    required = [n for n in names if not gpu_check.CHECKS[n].optional]
    assert names[:len(required)] == required
    assert gpu_check.planned_seconds(required) + gpu_check.SPARE_S <= gpu_check.DEFAULT_BUDGET_S
    assert required.index("gpu_tests") < required.index("bench_schedules") == len(required) - 1
    assert all(0 <= c.compile_s < c.estimate_s for c in gpu_check.CHECKS.values())
    # A process start per run of one process key: engine, rest, bench, rest again.
    assert gpu_check.planned_seconds(["engine_cuda_graphs", "gpu_tests", "decode_layer", "bench_schedules",
                                      "logprob_head"]) == 20 + 140 + 20 + 130 + 5 + 4 * gpu_check.PROCESS_START_S


def test_a_check_reports_the_triton_kernels_it_compiled_and_found_in_the_cache(monkeypatch):
    """On the GPU, Triton tells each compile to its listener, found in the cache or not: the check's result
    counts both and the compile seconds (here a check that reports three compiles to it)."""
    from triton import knobs

    def compiling(device):
        times = types.SimpleNamespace(total=2_500_000)  # microseconds
        for hit in (False, True, True):
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=hit)
        return {"ok": True}

    monkeypatch.setitem(gpu_check.CHECKS, "paged_decode_triton", gpu_check.Check(compiling, 5, "rest"))
    result = gpu_check.run_one("paged_decode_triton", "cpu")
    assert result["triton_kernels"] == {"compiled": 1, "from_cache": 2, "compile_s": 2.5}
    assert knobs.compilation.listener is None  # given back


def test_unknown_check_is_an_error(tmp_path):
    res = run_device_command(tmp_path, "--only", "engine_cuda_graph")
    assert res.returncode == 2 and "unknown check(s) engine_cuda_graph" in res.stderr + res.stdout


def test_checks_past_the_budget_are_reported_not_run_and_optional_ones_skipped(tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--budget-s", "0",
                           "--only", "paged_decode_triton"]) == 1
    check = json.loads(out.read_text())["checks"]["paged_decode_triton"]
    assert check == {"ok": False, "error": "not run: the time budget was spent", "estimate_s": 5}
    # An optional check whose estimate the budget does not cover is skipped, which is no failure.
    assert gpu_check.main(["--device", "cpu", "--out", str(out), "--budget-s", "60",
                           "--only", "bench_serial_naive"]) == 0
    check = json.loads(out.read_text())["checks"]["bench_serial_naive"]
    assert check["ok"] is None and "its estimate is 110 s" in check["skipped"]


def test_a_check_that_raises_ends_its_process_and_the_rest_get_a_fresh_one():
    recorded = {}
    left = gpu_check.run_in_child(["forward_timing_3b", "sampler_timing"], "cuda", time.time() + 120,
                                  recorded.__setitem__)  # no CUDA here: the first check raises
    assert list(recorded) == ["forward_timing_3b"] and left == ["sampler_timing"]
    result = recorded["forward_timing_3b"]
    assert result["ok"] is False and "Error" in result["error"] and result["traceback"]


def test_a_check_past_its_limit_is_killed_with_its_process_group():
    recorded = {}
    start = time.time()
    left = gpu_check.run_in_child(["forward_timing_3b", "sampler_timing"], "cpu", time.time() - 1,
                                  recorded.__setitem__)  # the budget is spent: killed during its imports
    assert time.time() - start < 10 and left == ["sampler_timing"]
    assert "killed" in recorded["forward_timing_3b"]["error"]


def test_pytest_past_the_budget_is_killed_with_its_process_group(monkeypatch):
    monkeypatch.setattr(gpu_check, "DEADLINE", time.time() + 11)  # pytest gets 1 s, less than its start-up
    result = gpu_check.check_gpu_tests("cpu")
    assert result["ok"] is False and "process group was killed" in result["timed_out"]


def schedule(digests: list[str], grad_norm: list[float], kl: float = 0.0, probs: float = 1e-5) -> dict:
    """A bench_schedules schedule's results as the criteria read them."""
    rows = [{"actor/grad_norm": g, "actor/kl_loss": kl, "actor/entropy": 11.4,
             "training/rollout_probs_diff_max": probs} for g in grad_norm]
    return {"warmup": rows[0], "steps": rows[1:], "traced": None, "sample_digests": digests}


@pytest.mark.parametrize("case, failed", [
    ("same", []),
    ("kl_at_rounding_level", []),  # KL is 0 at lr 0: the denominator's floor keeps rounding from failing it
    ("other_tokens", ["x_same_samples"]),
    ("grad_norm_off_by_2_percent", ["x_trains_alike"]),
    ("wrong_reference_logprobs", ["x_trains_alike"]),
    ("rollout_probs_far", ["x_rollout_probs"]),
])
def test_the_comparison_with_serial_prefix_fails_on_bad_input(case, failed):
    prefix = schedule(["a", "b", "c"], [0.012, 0.013, 0.011])
    other = {"same": schedule(["a", "b", "c"], [0.012, 0.013 * (1 + 1e-3), 0.011]),
             "kl_at_rounding_level": schedule(["a", "b", "c"], [0.012, 0.013, 0.011], kl=1e-7),
             "other_tokens": schedule(["a", "B", "c"], [0.012, 0.013, 0.011]),
             "grad_norm_off_by_2_percent": schedule(["a", "b", "c"], [0.012, 0.013 * 1.02, 0.011]),
             "wrong_reference_logprobs": schedule(["a", "b", "c"], [0.012, 0.013, 0.011], kl=0.3),
             "rollout_probs_far": schedule(["a", "b", "c"], [0.012, 0.013, 0.011], probs=0.2)}[case]
    tolerances = gpu_check.Tolerances.on(cuda=True)
    comparison = gpu_check.against_serial_prefix(other, prefix, tolerances.other_passes, tolerances.rollout_probs)
    verdict = gpu_check.verdict_of(gpu_check.comparison_criteria("x", comparison), "")
    assert verdict["failed"] == failed and verdict["ok"] is (not failed)


def test_a_shorter_run_is_compared_over_the_steps_both_ran():
    prefix = schedule(["a", "b", "c"], [0.012, 0.013, 0.011])
    assert gpu_check.against_serial_prefix(schedule(["a", "b"], [0.012, 0.013]), prefix, 0.0, 0.05)["same_samples"]
    assert not gpu_check.against_serial_prefix(schedule(["a", "x"], [0.012, 0.013]), prefix, 0.0, 0.05)[
        "same_samples"]


def test_lora_train_check_on_a_tiny_model():
    """lora_train_3b's CPU run (full fine-tuning, then LoRA, on the same groups) holds every criterion but the
    CUDA ones (memory, time). Full fine-tuning trains every weight the text-only batch reaches (the language
    model's), LoRA its rank-16 adapters on the 7 Linears of each decoder layer, nothing else."""
    from rollplex.models import build_model

    result = gpu_check.check_lora_train_3b("cpu")
    assert result["ok"] is True, result["failed"]
    full, lora = result["full"], result["lora"]
    args = gpu_check._tiny_args()
    params = dict(build_model(args).named_parameters())
    assert full["trained_params"] == sum(p.numel() for name, p in params.items() if not name.startswith("visual."))
    assert lora["base_params"] == sum(p.numel() for p in params.values())
    t = args.text
    kv = t.num_key_value_heads * t.head_dim
    h = t.hidden_size
    per_layer = 16 * (2 * (h + h) + 2 * (h + kv) + 3 * (h + t.intermediate_size))  # q, o; k, v; gate, up, down
    assert result["adapter_params"] == lora["trained_params"] == t.num_hidden_layers * per_layer
    assert result["base_state_gib"] > 0 and full["peak_gib"] is None  # no memory figures on the CPU


def test_lora_train_check_fails_a_base_left_unfrozen(monkeypatch):
    """A parallelization that puts the adapters on but leaves the base unfrozen (FSDP shards it, AdamW trains
    it beside the adapters and moves it), as a defect would: the check must fail it."""
    import rollplex.train.lora

    monkeypatch.setattr(rollplex.train.lora, "freeze_base", lambda model, compute_dtype, train=(): None)
    result = gpu_check.check_lora_train_3b("cpu")
    assert result["ok"] is False and result["failed"] == ["trains_only_adapters", "base_unchanged"]


def lora_result(saved_share: float, lora_step_s: float = 0.5) -> dict:
    """A 3B comparison's figures as lora_criteria reads them: LoRA's peak below full's by `saved_share` of the
    base's 50 GiB of masters, gradients and moments (a right one: 7/8 of it)."""
    return {"base_state_gib": 50.0,
            "full": {"step_s": 0.7, "peak_gib": 80.0, "skipped_steps": 0},
            "lora": {"step_s": lora_step_s, "peak_gib": 80.0 - saved_share * 50.0, "skipped_steps": 0,
                     "trained_params": 30, "adapter_params": 30, "adapters_moved": True,
                     "base_dtypes": ["torch.bfloat16"], "base_unchanged": True}}


@pytest.mark.parametrize("case, result, failed", [
    ("right", lora_result(7 / 8), []),
    ("base_in_fp32_or_with_bf16_gradients", lora_result(3 / 4), ["peak_saves_base_state"]),  # 2 bytes a parameter
    ("slower_than_full", lora_result(7 / 8, lora_step_s=0.8), ["lora_step_faster"]),
])
def test_the_lora_criteria_fail_on_bad_input(case, result, failed):
    verdict = gpu_check.verdict_of(gpu_check.lora_criteria(result, cuda=True), "")
    assert verdict["failed"] == failed


def grouped_mm_rows_to_the_previous_expert(x, weight, ends, backend="loop"):
    """A grouped GEMM whose offsets are one row early: each expert's first row goes through the expert before."""
    from rollplex.ops.grouped_mm import _loop_mm

    early = (ends - 1).clamp_min(0)
    early[-1] = ends[-1]  # every row still goes somewhere
    return _loop_mm(x, weight, early)


class GroupedMMLeavingEmptyGradientsUnwritten(torch.autograd.Function):
    """The loop's arithmetic, with the weight gradient of an expert that got no rows left as the memory held (as a
    grouped kernel that skips empty groups would leave an uninitialised output)."""

    @staticmethod
    def forward(ctx, x, weight, ends):
        from rollplex.ops.grouped_mm import _loop_mm

        ctx.save_for_backward(x, weight, ends)
        return _loop_mm(x, weight, ends)

    @staticmethod
    def backward(ctx, grad):
        from rollplex.ops.grouped_mm import _loop_mm

        x, weight, ends = ctx.saved_tensors
        bounds = [0, *ends.tolist()]
        grad_w = torch.full_like(weight, 7.0)
        for e, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if end > start:
                grad_w[e] = x[start:end].t() @ grad[start:end]
        return _loop_mm(grad, weight.transpose(1, 2), ends), grad_w, None


def grouped_mm_leaving_empty_gradients_unwritten(x, weight, ends, backend="loop"):
    return GroupedMMLeavingEmptyGradientsUnwritten.apply(x, weight, ends)


@pytest.mark.parametrize("broken, failed", [
    ("none", []),
    ("rows_to_the_previous_expert", [f"{p}_{k}_within_bound" for p in ("gate_up", "down")
                                     for k in ("out", "grad_input", "grad_weight")]),
    ("empty_gradients_unwritten", [f"{p}_{k}" for p in ("gate_up", "down")
                                   for k in ("grad_weight_within_bound", "empty_experts_zero_grad")]),
])
def test_the_moe_grouped_gemm_criteria_fail_a_wrong_kernel(broken, failed, monkeypatch):
    """moe's grouped GEMM part on the CPU with its "grouped" backend broken: rows sent to the neighbouring expert,
    or the weight gradient of an expert with no rows left unwritten."""
    from rollplex.ops import grouped_mm

    loop = grouped_mm.grouped_mm
    wrong = {"none": loop, "rows_to_the_previous_expert": grouped_mm_rows_to_the_previous_expert,
             "empty_gradients_unwritten": grouped_mm_leaving_empty_gradients_unwritten}[broken]
    monkeypatch.setattr(grouped_mm, "grouped_mm", lambda x, w, ends, backend="loop": (
        wrong(x, w, ends) if backend == "grouped" else loop(x, w, ends, backend)))
    result = gpu_check._moe_grouped_gemm("cpu")
    assert result["failed"] == failed, result


def test_the_moe_train_step_fails_a_replay_that_routes_live(monkeypatch):
    """moe's training part on the CPU passes; with a MoE block that ignores the replayed routes (routes live),
    the replayed step no longer routes the recorded routes, and the live router agrees with every route."""
    from rollplex.models.moe import SparseMoE

    result = gpu_check._moe_train_step("cpu")
    assert result["ok"] is True, result
    monkeypatch.setattr(SparseMoE, "_replayed", lambda self, replay, live: live)
    result = gpu_check._moe_train_step("cpu")
    assert result["failed"] == ["replayed_routes_equal_recorded", "live_router_disagreed_somewhere"], result


def test_the_moe_engine_part_fails_graphs_whose_routes_are_stale(monkeypatch):
    """moe's engine part on the CPU (the graph stand-in) passes; a capture that records the graph with routes
    other than the ones the runner keeps for it (so the kept ones are the warm-up's, never replayed into) fails
    it: its samples' response routes are not the eager engine's, though its tokens are."""
    from rollplex.engine.runner import ModelRunner
    from rollplex.models.moe import Routing

    result = gpu_check._moe_engine_routes("cpu")
    assert result["ok"] is True, result
    record = ModelRunner._record
    monkeypatch.setattr(ModelRunner, "_record", lambda self, args, groups, routing: record(
        self, args, groups, None if routing is None else Routing()))
    result = gpu_check._moe_engine_routes("cpu")
    assert result["failed"] == ["response_routes_equal_eager", "graph_routes_equal_eager_same_buffers"], result


def test_a_moe_part_that_raises_is_reported_and_the_other_parts_still_run(monkeypatch):
    """check_moe on the CPU with its training part raising: that part's error is reported, the grouped GEMM and
    engine parts still run and pass, and the result carries a traceback, so its process ends after it."""
    def raising(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gpu_check, "_moe_train_step", raising)
    result = gpu_check.check_moe("cpu")
    assert result["ok"] is False and result["failed"] == ["train_step"]
    assert "illegal memory access" in result["train_step"]["error"] and "RuntimeError" in result["traceback"]
    assert result["grouped_gemm"]["ok"] is True and result["engine_routes"]["ok"] is True
    assert all(result[part]["seconds"] >= 0 for part in ("grouped_gemm", "train_step", "engine_routes"))
