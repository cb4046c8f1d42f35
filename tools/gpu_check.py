"""Every GPU-only check of Rollplex in one run, with a JSON report.

    python tools/gpu_check.py --out $OUT/gpu_check.json

Each check is a function returning a dict of figures; a check that raises is
recorded as failed with its error and the run goes on. The whole run is sized
to finish in under 8 minutes on one GPU, plus about 2 minutes for the schedule
benchmark (bench_schedules: its report, traces and timeline go to a
bench_schedules/ folder next to the JSON report). Later components add their
checks to CHECKS. The exit status is non-zero when any check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling tools (bench_schedules)

from rollplex.models import ModelArgs, TextArgs, VisionArgs, build_model, from_pretrained, save_pretrained  # noqa: E402
from rollplex.models.packing import SequenceInputs, pack_sequences  # noqa: E402


def _tiny_args() -> ModelArgs:
    return ModelArgs(
        vision=VisionArgs(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                          window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=2),
        text=TextArgs(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, mrope_section=[2, 3, 3], rope_theta=1e6),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        eos_token_id=504, bos_token_id=505)


def _multimodal_prompt(args: ModelArgs, device: str, image_hw=(28, 40), video_thw=(4, 16, 16), seed: int = 0):
    """Token ids with one image and one video, random pixels, as a processor would produce."""
    g = torch.Generator().manual_seed(seed)
    row = 3 * args.vision.temporal_patch_size * args.vision.patch_size**2
    merge2 = args.vision.spatial_merge_size**2
    ig = torch.tensor([[1, *image_hw]])
    vg = torch.tensor([video_thw])
    ni, nv = int(ig.prod()) // merge2, int(vg.prod()) // merge2
    vs, ve, img, vid = args.vision_start_token_id, args.vision_end_token_id, args.image_token_id, args.video_token_id
    ids = [1, 2, vs] + [img] * ni + [ve, 3, vs] + [vid] * nv + [ve] + list(range(10, 60))
    return SequenceInputs(torch.tensor(ids, device=device),
                          pixel_values=torch.randn(int(ig.prod()), row, generator=g).to(device),
                          image_grid_thw=ig.to(device),
                          pixel_values_videos=torch.randn(int(vg.prod()), row, generator=g).to(device),
                          video_grid_thw=vg.to(device), second_per_grid_ts=torch.tensor([0.5], device=device))


def check_model_parity_bf16(device: str) -> dict:
    """Rollplex vs transformers on CUDA in bf16, both measured against an fp32 reference."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    args = _tiny_args()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(build_model(args, seed=0, init_std=None), d)
        hf32 = Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).to(device).eval()
        hf16 = Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
        ours32 = from_pretrained(d, dtype=torch.float32, device=device)
        ours16 = from_pretrained(d, dtype=torch.bfloat16, device=device)
    seq = _multimodal_prompt(args, device, video_thw=(2, 16, 16))
    kw = dict(pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw,
              pixel_values_videos=seq.pixel_values_videos, video_grid_thw=seq.video_grid_thw,
              second_per_grid_ts=seq.second_per_grid_ts)
    ids = seq.input_ids[None]
    positions = pack_sequences(args, [seq]).position_ids[:, None, :]
    mm = (ids == args.image_token_id).long() + 2 * (ids == args.video_token_id).long()
    with torch.no_grad():
        ref = hf32(input_ids=ids, position_ids=positions, mm_token_type_ids=mm, **kw).logits.float()
        hf_bf16 = hf16(input_ids=ids, position_ids=positions, mm_token_type_ids=mm, **kw).logits.float()
        ours_fp32 = ours32.hf_forward(ids, **kw).float()
        ours_bf16 = ours16.hf_forward(ids, **kw).float()
    fp32_err = (ours_fp32 - ref).abs().max().item()
    ours_err = (ours_bf16 - ref).abs().max().item()
    hf_err = (hf_bf16 - ref).abs().max().item()
    ok = fp32_err < 1e-3 and ours_err <= 2 * hf_err + 1e-2
    return {"ok": ok, "fp32_max_abs_diff": fp32_err, "bf16_ours_vs_fp32": ours_err, "bf16_hf_vs_fp32": hf_err}


def check_forward_timing(device: str) -> dict:
    """Packed training-shaped forward of a 3B-shaped model (random weights) in bf16."""
    args = ModelArgs(vision=VisionArgs(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                       out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31]),
                     text=TextArgs())  # Qwen2.5-VL-3B shapes
    model = build_model(args, dtype=torch.bfloat16, device=device, seed=0, init_std=None)
    model.set_attn_backend("auto")
    seqs = [_multimodal_prompt(args, device, image_hw=(28, 28), video_thw=(8, 28, 28), seed=i) for i in range(8)]
    batch = pack_sequences(args, seqs)
    tokens = int(batch.input_ids.numel())
    with torch.no_grad():
        model.forward_packed(batch)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        iters = 5
        for _ in range(iters):
            model.forward_packed(batch)
        _sync(device)
    dt = (time.perf_counter() - t0) / iters
    return {"ok": True, "attn_backend": model.attn_backend, "tokens": tokens, "forward_s": dt,
            "tokens_per_s": tokens / dt, "note": "random weights; timing only"}


def check_engine_cuda_graphs(device: str) -> dict:
    """Greedy tokens with CUDA-graph decode equal eager decode (tiny model, mixed batch)."""
    from rollplex.engine import Engine, EngineConfig, Request, SamplingParams

    args = _tiny_args()
    model = build_model(args, dtype=torch.bfloat16, device=device, seed=0)
    model.set_attn_backend("auto")
    seq = _multimodal_prompt(args, device, video_thw=(2, 16, 16))
    requests = [Request(seq.input_ids.tolist(), pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw,
                        pixel_values_videos=seq.pixel_values_videos, video_grid_thw=seq.video_grid_thw,
                        second_per_grid_ts=seq.second_per_grid_ts, n=4),
                Request(list(range(1, 40)), n=3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        engine = Engine(model, EngineConfig(enforce_eager=eager, max_num_seqs=16, max_model_len=1024))
        tokens[eager] = [[s.token_ids for s in o.samples] for o in engine.generate(requests, params)]
    return {"ok": tokens[True] == tokens[False], "attn_backend": model.attn_backend}


def check_engine_throughput(device: str) -> dict:
    """Decode throughput of a 3B-shaped model (random weights) at batch 64, graphs vs eager."""
    from rollplex.engine import Engine, EngineConfig, Request, SamplingParams

    args = ModelArgs(vision=VisionArgs(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                       out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31]),
                     text=TextArgs())
    model = build_model(args, dtype=torch.bfloat16, device=device, seed=0)
    model.set_attn_backend("auto")
    requests = [Request(list(range(100, 612)), n=1) for _ in range(64)]
    result = {"ok": True, "attn_backend": model.attn_backend, "batch": 64, "prompt_tokens": 512, "note":
              "random weights; timing only"}
    for eager in (True, False):
        engine = Engine(model, EngineConfig(enforce_eager=eager, max_num_seqs=64, max_model_len=1024))
        timings = {}
        for max_tokens in (1, 129):
            engine.generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
            _sync(device)
            t0 = time.perf_counter()
            engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                                     seed=0))
            _sync(device)
            timings[max_tokens] = time.perf_counter() - t0
        step = (timings[129] - timings[1]) / 128
        key = "eager" if eager else "cuda_graphs"
        result[f"{key}_decode_step_ms"] = step * 1e3
        result[f"{key}_decode_tokens_per_s"] = 64 / step
    return result


def check_paged_decode_triton(device: str) -> dict:
    """The Triton paged-decode kernel against the gather reference (bf16), and its speed."""
    from rollplex.ops.paged_decode_triton import paged_decode_attention_triton
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    batch, heads, kv_heads, dim, block, blocks = 64, 16, 2, 128, 16, 64 * 64
    q = torch.randn(batch, heads, dim, generator=g).to(device, torch.bfloat16)
    k = torch.randn(blocks, block, kv_heads, dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(blocks, block, kv_heads, dim, generator=g).to(device, torch.bfloat16)
    tables = torch.randperm(blocks, generator=g)[: batch * 64].view(batch, 64).to(device, torch.int32)
    lens = torch.randint(1, 64 * block, (batch,), generator=g).to(device, torch.int32)
    out = paged_decode_attention_triton(q, k, v, tables, lens)
    kk = k[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2)
    vv = v[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2)
    mask = torch.arange(kk.shape[2], device=device)[None] < lens[:, None]
    ref = F.scaled_dot_product_attention(q[:, :, None], kk, vv, attn_mask=mask[:, None, None], enable_gqa=True)[:, :, 0]
    err = (out.float() - ref.float()).abs().max().item()
    timings = {}
    for name, fn in (("triton", lambda: paged_decode_attention_triton(q, k, v, tables, lens)),
                     ("gather", lambda: F.scaled_dot_product_attention(
                         q[:, :, None], k[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2),
                         v[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2),
                         attn_mask=mask[:, None, None], enable_gqa=True))):
        fn()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        _sync(device)
        timings[f"{name}_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    return {"ok": err < 2e-2, "max_abs_err_bf16": err, **timings}


def check_bench_schedules(device: str) -> dict:
    """tools/bench_schedules.py: serial-naive, serial-prefix and overlap on the same
    workload (configs/bench_h200_video.yaml on CUDA; a tiny CPU one for --device cpu).
    Records the throughput ratios, the decode slowdown and each schedule's step time.
    ok: every schedule ran and did the same work (equal response lengths per step)."""
    import bench_schedules

    repo = Path(__file__).resolve().parent.parent
    if device.startswith("cuda"):
        argv = ["--config", str(repo / "configs/bench_h200_video.yaml"), "--steps", "1"]
    else:
        argv = ["--config", str(repo / "configs/tiny.yaml"), "--steps", "1", "--data.task", "direction",
                "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4",
                "--algorithm.kl_coef", "0.01", "--rollout.kv_cache_memory", "16e6"]
    with tempfile.TemporaryDirectory() as work:  # the random checkpoint stays out of the artifacts
        report = bench_schedules.main(argv + ["--trainer.output_dir", work,
                                              "--out", str(ARTIFACTS / "bench_schedules")])
    schedules = report["schedules"]
    lengths = {name: [r["response_length/mean"] for r in [s["warmup"], *s["steps"]]] for name, s in schedules.items()}
    return {"ok": len({tuple(v) for v in lengths.values()}) == 1, **report["ratios"],
            "same_samples": report["same_samples"], "config": Path(argv[1]).name,
            "step_s": {name: s["mean"]["timing_s/step"] for name, s in schedules.items()},
            "throughput": {name: s["mean"]["perf/throughput"] for name, s in schedules.items()},
            "prefix_deferred_items": schedules["overlap"]["mean"].get("prefix/deferred_items"),
            "overlap_efficiency": schedules["overlap"]["mean"].get("perf/overlap_efficiency"),
            "note": "random weights; timing only"}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


CHECKS = {
    "model_parity_bf16": check_model_parity_bf16,
    "forward_timing_3b": check_forward_timing,
    "paged_decode_triton": check_paged_decode_triton,
    "engine_cuda_graphs_equal_eager": check_engine_cuda_graphs,
    "engine_throughput_3b": check_engine_throughput,
    "bench_schedules": check_bench_schedules,
}
ARTIFACTS = Path(".")  # where checks write files beyond the JSON report (main sets it next to --out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--device", default="cuda",
                        help="cuda; 'cpu' only dry-runs the script's own logic (CI does this for cheap checks)")
    opts = parser.parse_args()
    global ARTIFACTS
    ARTIFACTS = Path(opts.out).resolve().parent
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if opts.device.startswith("cuda") else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "commit": commit,
        "checks": {},
    }
    for name, fn in CHECKS.items():
        if opts.only and name not in opts.only:
            continue
        t0 = time.perf_counter()
        try:
            result = fn(opts.device)
        except Exception as e:  # a failed check is recorded, the others still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        report["checks"][name] = result
        print(f"{name}: {'ok' if result.get('ok') else 'FAILED'} {json.dumps(result)[:400]}", flush=True)
        if opts.device.startswith("cuda"):
            torch.cuda.empty_cache()
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"report written to {opts.out}")
    return 0 if all(r.get("ok") for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
