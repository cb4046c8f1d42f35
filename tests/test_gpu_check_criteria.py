"""The device command's criteria on the fused decode layer, its engine and the sampler (tools/gpu_check.py,
tools/bench_decode_layer.py), each fed input that must fail it: made-up kernel counts, draws moved off
their tokens, and fused kernels broken on purpose. The tests that run the fused kernels need Triton's
interpreter, which TRITON_INTERPRET=1 turns on only when set before triton is imported: they run in a
process of their own (`test_the_fused_kernels_criteria_in_the_interpreter`)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cases import ROOT, fresh_env

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_decode_layer  # noqa: E402
import gpu_check  # noqa: E402
from rollplex.engine.sampler import SamplingParams, sample  # noqa: E402

# ---------------------------------------------------------------------- decode_layer's launch count

CUBLAS_GEMMS = {  # kernel names as torch.profiler gives them on CUDA GPUs
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": 3,
    "nvjet_tst_64x8_64x16_4x1_v_bz_bias_TNT": 2,
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>("
    "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)": 1,
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false, "
    "true, true, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, "
    "cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >"
    "(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched"
    "<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float>, float, float)": 1,
}
OWN = {"rms_norm_kernel": 2, "rotary_store_kernel": 1, "_paged_decode_kernel": 1, "silu_mul_kernel": 1}
SPLIT_K_REDUCTIONS = {
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>("
    "cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, "
    "__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, void*, long, float*, int*)": 2,
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, "
    "__nv_bfloat16, false, true, false>(cublasLt::cublasSplitKParams<float>, float const*)": 1,
    "void cutlass::Kernel<cutlass::reduction::kernel::ReduceSplitK<cutlass::MatrixShape<4, 64>, "
    "cutlass::epilogue::thread::LinearCombination<cutlass::bfloat16_t, 8, float, float>>>(Params)": 1,
}
MERGE = {"_merge_splits_kernel": 1}
ELEMENTWISE_ADD = {"void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<"
                   "c10::BFloat16>, std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<c10::BFloat16>, "
                   "std::array<char*, 2ul>)": 1}
TORCH_MEAN = {"void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, "
              "float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<"
              "float, float, float, float>, unsigned int, float, 4, 4>)": 1}


@pytest.mark.parametrize("case, kernels, launches, limit", [
    ("the_design", CUBLAS_GEMMS | OWN, 12, 12),
    ("cublas_split_k_reductions", CUBLAS_GEMMS | OWN | SPLIT_K_REDUCTIONS, 12, 12),
    ("merge_at_batch_64", CUBLAS_GEMMS | OWN | MERGE | SPLIT_K_REDUCTIONS, 13, 13),
    ("an_extra_elementwise_kernel", CUBLAS_GEMMS | OWN | ELEMENTWISE_ADD, 13, 12),
    ("an_extra_elementwise_kernel_beside_the_merge", CUBLAS_GEMMS | OWN | MERGE | ELEMENTWISE_ADD, 14, 13),
    ("torchs_own_reduction_is_no_split_k_one", CUBLAS_GEMMS | OWN | TORCH_MEAN, 13, 12),
])
def test_the_launch_count_holds_what_the_design_controls(case, kernels, launches, limit):
    counted = bench_decode_layer.layer_launches(kernels)
    assert (counted["launches"], counted["launch_limit"]) == (launches, limit)
    assert counted["within_design"] is (launches <= limit)
    classes = counted["kernel_classes"]
    assert classes["gemm"] == CUBLAS_GEMMS
    assert classes["own"] == {k: v for k, v in (OWN | MERGE).items() if k in kernels}
    assert classes["split_k_reduction"] == {k: v for k, v in SPLIT_K_REDUCTIONS.items() if k in kernels}
    assert counted["split_k_reductions"] == sum(classes["split_k_reduction"].values())
    assert classes["other"] == {k: v for k, v in (ELEMENTWISE_ADD | TORCH_MEAN).items() if k in kernels}


def test_the_cpu_count_classifies_aten_gemms_and_triton_kernels():
    counted = bench_decode_layer.layer_launches({"addmm": 3, "mm": 3, "addmm_": 1, **OWN, "add": 1})
    assert counted["kernel_classes"]["gemm"] == {"addmm": 3, "mm": 3, "addmm_": 1}
    assert counted["kernel_classes"]["other"] == {"add": 1} and not counted["within_design"]


# ---------------------------------------------------------------------- sampler_timing's draws


def draw(weights: list[list[float]], u: list[float], params: SamplingParams):
    """Logits whose exp are `weights` (0: -inf), the uniforms, and the torch path's tokens of them."""
    logits = torch.tensor(weights, dtype=torch.float64).log().float()
    uniforms = torch.tensor(u, dtype=torch.float64)
    truncate = params.top_p < 1 or params.top_k > 0
    reference, _ = sample(logits, params.temperature, params.top_p, params.top_k, uniforms, truncate=truncate,
                          backend="torch")
    return logits, uniforms, reference


FLAT = SamplingParams(temperature=1.0)
EIGHT_EQUAL = [[1.0] * 8]  # running sums 1, 2, ..., 8: U = 0.5 sits on the boundary between tokens 3 and 4


@pytest.mark.parametrize("case, weights, u, params, drawn, token, alike", [  # drawn: the torch path's token
    ("the_same_token", EIGHT_EQUAL, [0.55], FLAT, 4, 4, True),
    ("a_far_token", EIGHT_EQUAL, [0.55], FLAT, 4, 0, False),
    ("a_neighbour_with_u_inside_the_interval", EIGHT_EQUAL, [0.55], FLAT, 4, 5, False),
    ("the_neighbour_with_u_on_the_boundary", EIGHT_EQUAL, [0.5], FLAT, 4, 3, True),
    ("two_away_with_u_on_the_boundary", EIGHT_EQUAL, [0.5], FLAT, 4, 5, False),
    # A token of no weight (logit -inf) between: the boundaries on both sides of it are one.
    ("the_neighbour_past_a_token_of_no_weight", [[1, 1, 1, 1, 0, 1, 1, 1]], [4 / 7], FLAT, 5, 3, True),
    ("the_token_of_no_weight", [[1, 1, 1, 1, 0, 1, 1, 1]], [4 / 7], FLAT, 5, 4, False),
    # Truncated, the draw runs in decreasing-logit order: 2, 0, 3, 1 (running sums 4, 7, 9, 10); U x 10 = 7
    # sits between tokens 0 and 3, neighbours there though not in the vocabulary.
    ("the_neighbour_in_logit_order", [[3, 1, 4, 2]], [0.7], SamplingParams(top_k=4), 3, 0, True),
    ("not_a_neighbour_in_logit_order", [[3, 1, 4, 2]], [0.7], SamplingParams(top_k=4), 3, 2, False),
    # top_p 0.5 of four equal weights reaches 2, the running sum at token 1: the cut may move past token 2.
    ("past_a_top_p_cut_on_its_boundary", [[1, 1, 1, 1]], [0.9], SamplingParams(top_p=0.5), 1, 2, True),
    ("past_the_token_after_the_cut", [[1, 1, 1, 1]], [0.9], SamplingParams(top_p=0.5), 1, 3, False),
    ("another_argmax_when_greedy", [[1, 2, 2.001, 1]], [0.5], SamplingParams(temperature=0.0), 2, 1, False),
])
def test_the_sampler_criterion_tolerates_rounding_at_a_boundary_only(case, weights, u, params, drawn, token, alike):
    logits, uniforms, reference = draw(weights, u, params)
    assert reference.tolist() == [drawn]
    ok, differing = gpu_check.sampled_alike(logits, uniforms, params, torch.tensor([token]), reference)
    assert ok is alike and differing == ([] if token == drawn else [0])


def test_the_sampler_criterion_reports_every_differing_row():
    logits, uniforms, reference = draw(EIGHT_EQUAL * 3, [0.5, 0.55, 0.5], FLAT)
    assert reference.tolist() == [4, 4, 4]
    ok, differing = gpu_check.sampled_alike(logits, uniforms, FLAT, torch.tensor([3, 4, 3]), reference)
    assert ok and differing == [0, 2]
    ok, differing = gpu_check.sampled_alike(logits, uniforms, FLAT, torch.tensor([3, 0, 4]), reference)
    assert not ok and differing == [0, 1]


# ---------------------------------------------------------------------- qwen3_5


def delta_outputs(q, k, v, g, beta, state):
    from rollplex.ops.gated_delta import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 40, 110]), state, backend="torch")


@pytest.mark.parametrize("broken", ["key_heads_tiled", "q_unscaled", "state_transposed"])
def test_the_fla_bounds_fail_a_wrong_layout(broken):
    """What a wrong layout handed to fla would compute is far outside qwen3_5's bounds on fla's errors."""
    q, k, v, g, beta, state = gpu_check._delta_inputs(110, 2, (2, 4, 16), "cpu", seed=0)
    out, final = delta_outputs(q, k, v, g, beta, state)
    if broken == "key_heads_tiled":  # value head h reading key head h % Hk instead of h // (Hv / Hk)
        q, k = q.repeat(1, 2, 1), k.repeat(1, 2, 1)
    elif broken == "q_unscaled":
        q = q * 16**0.5
    else:
        state = state.transpose(-1, -2)
    wrong_out, wrong_final = delta_outputs(q, k, v, g, beta, state)
    assert gpu_check._relative_rms(wrong_out, out) > 10 * gpu_check.FLA_RMS_BOUNDS["out"]
    if broken != "q_unscaled":  # q does not reach the state
        assert gpu_check._relative_rms(wrong_final, final) > 10 * gpu_check.FLA_RMS_BOUNDS["final_state"]


def test_the_logprob_gap_figures():
    rollout, trainer = torch.tensor([0.5, 0.25]).log(), torch.tensor([0.5, 0.2]).log()
    gap = gpu_check.logprob_gap(rollout, trainer)
    assert gap["logprob_max_abs_diff"] == pytest.approx(math.log(1.25))
    assert gap["logprob_mean_abs_diff"] == pytest.approx(math.log(1.25) / 2)
    assert gap["probs_diff_max"] == pytest.approx(0.05)
    assert gap["kl_k3_mean"] == pytest.approx((0.8 - 1 - math.log(0.8)) / 2)


def test_the_qwen3_5_engine_comparison_fails_a_state_lost_in_decode(monkeypatch):
    """qwen3_5's engine part on the CPU (fp32): it passes, and an engine whose decode steps start each
    token from a zero recurrent state fails it."""
    from rollplex.engine import recurrent_state

    figures, criteria = gpu_check._qwen3_5_engine_against_transformers("cpu")
    assert all(criteria.values()) and figures["samples_equal_transformers_greedy_share"] == 1.0, figures
    step = recurrent_state.recurrent_gated_delta_step
    monkeypatch.setattr(recurrent_state, "recurrent_gated_delta_step",
                        lambda q, k, v, g, beta, state: step(q, k, v, g, beta, state.zero_()))
    figures, criteria = gpu_check._qwen3_5_engine_against_transformers("cpu")
    assert not criteria["engine_logprobs_as_close_as_transformers"], figures


def test_the_qwen3_5_gap_fails_responses_that_forget_their_prompt(monkeypatch):
    """qwen3_5's logprob gap on the CPU: a chunked rule that drops initial states (so the shared-prefix pass's
    responses start from zero, not from their prompt's state) fails it; the full-sequence pass, whose
    sequences all start from zero, passes."""
    from rollplex.ops import gated_delta

    figures, criteria = gpu_check._qwen3_5_logprob_gap("cpu")
    assert all(criteria.values()), figures
    rule = gated_delta._torch_chunk_gated_delta_rule
    monkeypatch.setattr(gated_delta, "_torch_chunk_gated_delta_rule",
                        lambda q, k, v, g, beta, cu_seqlens, initial_state, chunk_size:
                        rule(q, k, v, g, beta, cu_seqlens, None, chunk_size))
    figures, criteria = gpu_check._qwen3_5_logprob_gap("cpu")
    assert criteria == {"shared_prefix_rollout_probs": False, "full_sequences_rollout_probs": True}, figures


# ---------------------------------------------------------------------- the fused kernels, in the interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_the_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in test_the_fused_kernels_criteria_in_the_interpreter's process")


def fused_rotary():
    """The fused rotary with the KV write, as rollplex.ops.fused_decode_triton defines it (the tests below
    replace the engine's reference to it, rollplex.engine.kv_cache.rotary_store)."""
    from rollplex.ops import fused_decode_triton

    return fused_decode_triton.rotary_store


def rotary_without_rotation(q, k, v, cos, sin, *rest):
    return fused_rotary()(q, k, v, torch.ones_like(cos), torch.zeros_like(sin), *rest)


def rotary_with_sin_flipped(q, k, v, cos, sin, *rest):
    return fused_rotary()(q, k, v, cos, -sin, *rest)


BROKEN_ROTARIES = {"no_rotation": rotary_without_rotation, "sin_flipped": rotary_with_sin_flipped}


def add_rms_norm_without_the_residual(self, x, residual, norm):
    from rollplex.ops import fused_decode_triton

    return fused_decode_triton.rms_norm(x, norm.weight, norm.eps)[0], x


@pytest.fixture(scope="module")
def decode_setup():
    """check_decode_layer's CPU step: 2 layers at batch 4 over 32 tokens of context, fp16."""
    cpu = torch.device("cpu")
    return bench_decode_layer.DecodeSetup(bench_decode_layer.layer_args(cpu), 2, 4, 32, cpu, torch.float16)


@in_the_interpreter
def test_the_decode_layer_criterion_passes_the_fused_ops(decode_setup):
    criteria = gpu_check.decode_agreement_criteria(bench_decode_layer.agreement(decode_setup))
    assert len(criteria) == 4 and all(criteria.values()), criteria


@in_the_interpreter
@pytest.mark.parametrize("broken", ["no_rotation", "sin_flipped", "residual_dropped"])
def test_the_decode_layer_criterion_fails_a_broken_fused_op(decode_setup, broken, monkeypatch):
    from rollplex.engine import kv_cache
    from rollplex.ops.fused_decode_triton import FusedLayerOps

    if broken == "residual_dropped":
        monkeypatch.setattr(FusedLayerOps, "add_rms_norm", add_rms_norm_without_the_residual)
    else:
        monkeypatch.setattr(kv_cache, "rotary_store", BROKEN_ROTARIES[broken])
    criteria = gpu_check.decode_agreement_criteria(bench_decode_layer.agreement(decode_setup))
    assert not criteria["output_max"] and not criteria["output_rms"], criteria


@in_the_interpreter
@pytest.mark.parametrize("broken", ["none", "sin_flipped"])
def test_the_engine_criterion_fails_a_broken_fused_kernel(broken, monkeypatch):
    """engine_cuda_graphs' comparison, on one text prompt: graphs with the fused ops against eager torch ops."""
    import dataclasses

    from rollplex.engine import Request, kv_cache
    from rollplex.models import build_model
    from rollplex.ops.fused_decode_triton import FUSED_OPS

    if broken != "none":
        monkeypatch.setattr(kv_cache, "rotary_store", BROKEN_ROTARIES[broken])
    args = gpu_check._tiny_args()
    args = dataclasses.replace(args, text=dataclasses.replace(args.text, num_hidden_layers=2))
    model = build_model(args, seed=0, init_std=None)
    reference, graphed = gpu_check._torch_eager_and_fused_graphs(model, False, max_num_seqs=4, max_model_len=64)
    assert reference.runner.layer_ops is None and graphed.runner.layer_ops is FUSED_OPS
    assert "ROLLPLEX_FUSED_DECODE" not in os.environ  # the switch stayed with the engines built under it
    requests = [Request(gpu_check._text_prompt(1, 12), n=2)]
    alike, worst = gpu_check.greedy_alike(gpu_check._greedy(graphed, requests, False),
                                          gpu_check._greedy(reference, requests, False))
    assert alike is (broken == "none"), worst
    assert (worst <= 1e-5) if broken == "none" else (worst > 1e-2 or math.isinf(worst))


@pytest.mark.skipif(INTERPRETED, reason="it starts the interpreted tests")
def test_the_fused_kernels_criteria_in_the_interpreter():
    names = ["test_the_decode_layer_criterion_passes_the_fused_ops",
             "test_the_decode_layer_criterion_fails_a_broken_fused_op",
             "test_the_engine_criterion_fails_a_broken_fused_kernel"]
    env = fresh_env(TRITON_INTERPRET="1")
    env.pop("ROLLPLEX_FUSED_DECODE", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(f"{__file__}::{name}" for name in names)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = (res.stdout.strip().splitlines() or [""])[-1]
    assert res.returncode == 0 and summary.startswith("6 passed"), res.stdout[-4000:] + res.stderr[-2000:]
