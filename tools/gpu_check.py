"""Every GPU-only check of Rollplex in one run, with a JSON report.

    ROLLPLEX_COMMIT=<sha> python tools/gpu_check.py --out $OUT/gpu_check.json

Each check runs in a process of its own (a CUDA fault or a hung kernel cannot
poison the checks after it), returns a dict of figures with an "ok" verdict
that can fail, and the JSON report is rewritten after every check, so a run
cut short still reports what it did. Checks run most important first, within a
time budget (`--budget-s`, default 480 s): what the budget does not reach is
reported as not run. `--only NAME ...` runs a subset; an unknown name is an
error. `--device cpu` runs every check at its smallest size on the CPU: that
tests this script and the checks' own logic (tests/test_gpu_check.py), not the
GPU paths. The exit status is 0 only when every selected check ran and passed.

The commit comes from ROLLPLEX_COMMIT (the device machine gets a copy of the
working tree without .git), else from git.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))  # sibling tools (bench_schedules)

from rollplex.models import ModelArgs, TextArgs, VisionArgs, build_model, from_pretrained, save_pretrained  # noqa: E402
from rollplex.models.inputs import Prompt  # noqa: E402
from rollplex.models.packing import pack_sequences  # noqa: E402


def _tiny_args(vocab_size: int = 512) -> ModelArgs:
    return ModelArgs(
        vision=VisionArgs(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                          window_size=112, fullatt_block_indexes=[1, 3], tokens_per_second=2),
        text=TextArgs(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, mrope_section=[2, 3, 3], rope_theta=1e6),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
        eos_token_id=504, bos_token_id=505)


def _3b_args(cuda: bool) -> ModelArgs:
    """Qwen2.5-VL-3B's shapes on CUDA; a small stand-in on the CPU (dry run)."""
    if not cuda:
        return _tiny_args()
    return ModelArgs(vision=VisionArgs(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                       out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31]),
                     text=TextArgs())


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
    return Prompt(torch.tensor(ids, device=device),
                  pixel_values=torch.randn(int(ig.prod()), row, generator=g).to(device),
                  image_grid_thw=ig.to(device),
                  pixel_values_videos=torch.randn(int(vg.prod()), row, generator=g).to(device),
                  video_grid_thw=vg.to(device), second_per_grid_ts=torch.tensor([0.5], device=device))


def _text_prompt(first: int, end: int) -> Prompt:
    """A text-only prompt of the token ids first..end-1."""
    return Prompt(torch.arange(first, end))


def _cuda(device: str) -> bool:
    return device.startswith("cuda")


def _sync(device: str) -> None:
    if _cuda(device):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------- checks, most important first


def check_model_parity_bf16(device: str) -> dict:
    """Rollplex vs transformers in bf16, both measured against an fp32 transformers
    reference computed with TF32 off (transformers' Conv3d would use cuDNN TF32)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
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
    ok = fp32_err < 1e-4 and ours_err <= 2 * hf_err + 1e-2
    return {"ok": ok, "criterion": "fp32 max abs diff < 1e-4; bf16 error <= 2 x transformers' bf16 error + 1e-2",
            "fp32_max_abs_diff": fp32_err, "bf16_ours_vs_fp32": ours_err, "bf16_hf_vs_fp32": hf_err}


def _paged_case(device: str, batch: int, kv_heads: int, context_blocks: int, seed: int = 0):
    """Random bf16 q, a paged pool and block tables for `batch` sequences of up to
    `context_blocks` blocks of 16 tokens."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16 if _cuda(device) else torch.float32  # the CPU interpreter has no bf16
    heads, dim, block = kv_heads * 8, 128, 16
    blocks = batch * context_blocks + 1
    q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
    k = torch.randn(blocks, block, kv_heads, dim, generator=g).to(device, dtype)
    v = torch.randn(blocks, block, kv_heads, dim, generator=g).to(device, dtype)
    tables = torch.randperm(blocks - 1, generator=g)[: batch * context_blocks].view(batch, context_blocks)
    lens = torch.randint(1, context_blocks * block + 1, (batch,), generator=g)
    return q, k, v, tables.to(device, torch.int32), lens.to(device, torch.int32)


def _paged_reference(q, k, v, tables, lens) -> torch.Tensor:
    import torch.nn.functional as F

    batch, _, dim = q.shape
    kv_heads = k.shape[2]
    kk = k[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2).float()
    vv = v[tables.long()].view(batch, -1, kv_heads, dim).transpose(1, 2).float()
    mask = torch.arange(kk.shape[2], device=q.device)[None] < lens[:, None]
    return F.scaled_dot_product_attention(q[:, :, None].float(), kk, vv, attn_mask=mask[:, None, None],
                                          enable_gqa=True)[:, :, 0]


def check_paged_decode_triton(device: str) -> dict:
    """The Triton paged-decode kernel against an fp32 gather reference, on its split-K
    path (few sequences, long contexts) and its one-pass path at batch x KV heads of at
    least the SM count (where the shape heuristic must choose it), and replayed from a
    CUDA graph with inputs refilled after capture."""
    from rollplex.ops.paged_decode_triton import default_num_splits, paged_decode_attention_triton

    cuda = _cuda(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    kv_heads = 2
    cases = {"split": (2, 256 if cuda else 8, 8 if cuda else 2), "no_split": (sms // kv_heads + 1, 64 if cuda else 4, 1)}
    result: dict = {"sm_count": sms}
    ok = True
    for name, (batch, context_blocks, splits) in cases.items():
        q, k, v, tables, lens = _paged_case(device, batch, kv_heads, context_blocks)
        out = paged_decode_attention_triton(q, k, v, tables, lens, num_splits=splits)
        err = (out.float() - _paged_reference(q, k, v, tables, lens)).abs().max().item()
        result[name] = {"batch": batch, "kv_heads": kv_heads, "num_splits": splits, "max_abs_err": err}
        ok &= err < 2e-2
    heuristic = default_num_splits(cases["no_split"][0], kv_heads, 64 * 16, 16, sms)
    result["no_split"]["heuristic_num_splits"] = heuristic
    ok &= heuristic == 1
    if cuda:
        result["cuda_graph"] = _triton_under_graph(device)
        ok &= result["cuda_graph"]["max_abs_err"] < 2e-2
        result["timing_ms"] = _time_triton_against_gather(device)
    result["ok"] = ok
    result["criterion"] = "max abs error < 2e-2 (bf16) on each path and under graph replay; no split chosen at " \
                          "batch x KV heads >= SMs"
    return result


def _triton_under_graph(device: str) -> dict:
    """Capture the kernel in a CUDA graph, refill its static inputs with a new case, replay."""
    from rollplex.ops.paged_decode_triton import paged_decode_attention_triton

    static = _paged_case(device, 8, 2, 32, seed=1)
    paged_decode_attention_triton(*static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention_triton(*static)
    fresh = _paged_case(device, 8, 2, 32, seed=2)
    for buf, value in zip(static, fresh):
        buf.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    return {"max_abs_err": (out.float() - _paged_reference(*fresh)).abs().max().item()}


def _time_triton_against_gather(device: str) -> dict:
    from rollplex.ops.paged_decode_triton import paged_decode_attention_triton

    case = _paged_case(device, 64, 2, 64)
    return _time_ms({"triton": lambda: paged_decode_attention_triton(*case),
                     "gather_sdpa": lambda: _paged_reference(*case)})


def _cascade_case(device: str, groups: int, members: int, prefix_blocks: int, tail_tokens: int, seed: int = 0):
    """A decode batch of `groups` groups of `members` rows sharing `prefix_blocks` blocks of 16
    tokens, each row with up to `tail_tokens` of its own after them, and two rows in no group:
    the paged inputs and the step's CascadeDecodeAttention (bf16 on CUDA)."""
    from rollplex.ops.attention import CascadeDecodeAttention, PrefixGroups

    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = torch.bfloat16 if _cuda(device) else torch.float32  # the CPU interpreter has no bf16
    kv_heads, heads, dim, block = 2, 16, 128, 16
    tail_blocks = -(-tail_tokens // block)
    batch = groups * members + 2
    rows_blocks = torch.randperm(groups * prefix_blocks + batch * (prefix_blocks + tail_blocks), generator=g)
    prefixes = rows_blocks[:groups * prefix_blocks].view(groups, prefix_blocks)
    own = rows_blocks[groups * prefix_blocks:].view(batch, prefix_blocks + tail_blocks)
    tables = own.clone()
    tables[:groups * members, :prefix_blocks] = prefixes.repeat_interleave(members, 0)
    lens = torch.randint(1, tail_tokens + 1, (batch,), generator=g) + prefix_blocks * block
    sink = int(rows_blocks.max()) + 1
    on_device = torch.Generator(device=device).manual_seed(seed)  # the pool is large: drawn where it lives
    k = torch.randn(sink + 1, block, kv_heads, dim, generator=on_device, device=device).to(dtype)
    v = torch.randn(sink + 1, block, kv_heads, dim, generator=on_device, device=device).to(dtype)
    q = torch.randn(batch, heads, dim, generator=g).to(device, dtype)
    layout = PrefixGroups.build([list(range(i * members, (i + 1) * members)) for i in range(groups)],
                                prefixes.tolist(), batch, sink, block, torch.device(device))
    tables, lens = tables.to(device, torch.int32), lens.to(device, torch.int32)
    return q, k, v, tables, lens, CascadeDecodeAttention(layout, tables, lens, tables.shape[1], block)


def check_cascade_decode_triton(device: str) -> dict:
    """The Triton group-shared (cascade) decode kernel, which CascadeDecodeAttention runs on
    CUDA, against the fp32 gather reference of plain paged decode; on CUDA also its time
    against the plain Triton paged kernel at 256 rows in 32 groups of 8 over 4096-token
    prompts (what the cascade is for: each group's prompt K/V read once, not 8 times)."""
    from rollplex.ops.cascade_decode_triton import cascade_decode_attention_triton
    from rollplex.ops.paged_decode_triton import paged_decode_attention_triton

    cuda = _cuda(device)
    q, k, v, tables, lens, cascade = _cascade_case(device, *((4, 8, 16, 40) if cuda else (2, 4, 3, 5)))
    g = cascade.groups
    out = cascade_decode_attention_triton(q, k, v, g.members, g.prefix_tables, g.prefix_lens, cascade.tail_tables,
                                          cascade.tail_lens)
    err = (out.float() - _paged_reference(q, k, v, tables, lens)).abs().max().item()
    dispatched = not cuda or torch.equal(cascade(q, k, v), out)  # CascadeDecodeAttention runs the kernel on CUDA
    result: dict = {"max_abs_err": err, "dispatched_to_triton": dispatched, "ok": err < 2e-2 and dispatched,
                    "criterion": "max abs error < 2e-2 (bf16) against the fp32 gather reference; "
                                 "CascadeDecodeAttention runs the kernel on CUDA"}
    if cuda:
        q, k, v, tables, lens, cascade = _cascade_case(device, 32, 8, 256, 256, seed=1)
        result["timing_ms_256_rows_4k_prompts"] = timings = _time_ms({
            "cascade": lambda: cascade(q, k, v),
            "plain_triton": lambda: paged_decode_attention_triton(q, k, v, tables, lens)})
        timings["cascade_over_plain"] = timings["cascade"] / timings["plain_triton"]
    return result


def _time_ms(calls: dict) -> dict:
    """Mean CUDA time of each call over 20 runs, after one warm-up run."""
    timings = {}
    for name, fn in calls.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / 20
    return timings


def check_engine_cuda_graphs(device: str) -> dict:
    """CUDA-graph decode against eager decode (on CPU: the runner's graph stand-in):
    - one graph's replay against the eager decode of the same static buffers;
    - greedy tokens of a mixed batch (image + video prompt, text prompt), graphs vs eager;
    - a second generation whose KV pool has another size: it must recapture and stay equal.
    Reports how many captures ran and how long they took."""
    from rollplex.engine import Engine, EngineConfig, Request, SamplingParams

    args = _tiny_args()
    model = build_model(args, dtype=torch.bfloat16 if _cuda(device) else torch.float32, device=device, seed=0)
    model.set_attn_backend("auto")
    multimodal = Request(_multimodal_prompt(args, device, video_thw=(2, 16, 16)), n=4)
    batches = {"mixed": [multimodal, Request(_text_prompt(1, 40), n=3)],
               "larger_pool": [multimodal, Request(_text_prompt(1, 200), n=6), Request(_text_prompt(7, 90), n=2)]}
    params = SamplingParams(temperature=0.0, max_tokens=32 if _cuda(device) else 6, ignore_eos=True)
    config = dict(max_num_seqs=16, max_model_len=1024, progress=False)
    eager = Engine(model, EngineConfig(enforce_eager=True, **config))
    graphed = Engine(model, EngineConfig(**config))
    graphed.runner.use_cuda_graphs = True  # on CPU: the stand-in that replays what it captured
    result: dict = {"attn_backend": model.attn_backend}
    ok = True
    for name, requests in batches.items():
        expected = [[s.token_ids for s in o.samples] for o in eager.generate(requests, params)]
        got = [[s.token_ids for s in o.samples] for o in graphed.generate(requests, params)]
        result[name] = {"tokens_equal": got == expected, "pool_blocks": graphed.cache.num_blocks,
                        "captures_so_far": graphed.runner.captures}
        ok &= got == expected
    ok &= result["larger_pool"]["pool_blocks"] != result["mixed"]["pool_blocks"]
    ok &= result["larger_pool"]["captures_so_far"] > result["mixed"]["captures_so_far"]  # the resize recaptured
    result["replay_vs_eager_same_buffers_max_abs"] = diff = _replay_against_eager(graphed)
    ok &= diff == 0.0
    result.update(ok=ok, capture_seconds=graphed.runner.capture_seconds,
                  criterion="tokens equal; the resized pool recaptured; replay bitwise equal to eager on the "
                            "same static buffers")
    return result


def _replay_against_eager(engine) -> float:
    """Replay each captured bucket, then run the eager decode on the same static buffers."""
    runner = engine.runner
    worst = 0.0
    with torch.no_grad():
        for bucket, graph in runner.graphs.items():
            s = runner.static
            graph.replay()
            replayed = runner.graph_logits[bucket].float().clone()
            eager = runner._decode_eager(s["ids"][:bucket], s["positions"][:bucket], s["slots"][:bucket],
                                         s["tables"][:bucket], s["lens"][:bucket]).float()
            worst = max(worst, (replayed - eager).abs().max().item())
    return worst


@contextlib.contextmanager
def _host_syncs_are_errors(cuda: bool):
    """Any host-device synchronisation raises inside the block (CUDA only)."""
    if not cuda:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_overlap_step(device: str) -> dict:
    """Two overlap steps of a small model (video prompts, reference model on), every
    prefix slice issued with host syncs made errors; the decode stream must outrank
    the side stream, and some prompt work must land inside the decode window."""
    from rollplex.config import load_config
    from rollplex.rl import prefix as prefix_module
    from rollplex.rl.loop import RLTrainer

    between_steps = prefix_module.PrefixScheduler.between_steps
    slices = {"calls": 0}

    def guarded(self, running: int) -> None:
        slices["calls"] += 1
        with _host_syncs_are_errors(_cuda(device)):
            between_steps(self, running)

    prefix_module.PrefixScheduler.between_steps = guarded
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(["--trainer.output_dir", out, "--trainer.device", device, "--schedule.kind", "overlap",
                           "--data.task", "direction", "--data.batch_size", "2", "--rollout.n", "4",
                           "--rollout.max_tokens", "16", "--rollout.min_tokens", "8", "--rollout.ignore_eos", "true",
                           "--algorithm.kl_coef", "0.01", "--rollout.kv_cache_memory", "64e6",
                           "--trainer.eval_every", "0", "--logging.no_console"])
        trainer = RLTrainer(cfg)
        source = trainer._batches(0)
        rows = []
        for step in (1, 2):
            trainer.step = step
            rows.append(trainer.train_step(next(source)))
        priorities = _stream_priorities(trainer)
        trainer.logger.close()
    hidden = rows[-1].get("timing_s/prefix_hidden", 0.0)
    ok = slices["calls"] > 0 and hidden > 0
    if _cuda(device):
        ok &= priorities["decode"] < priorities["side"]  # lower number, higher priority
    return {"ok": ok, "between_steps_calls": slices["calls"], "stream_priorities": priorities,
            "prefix_hidden_s": hidden, "prefix_exposed_s": rows[-1].get("timing_s/prefix_exposed"),
            "overlap_efficiency": rows[-1].get("perf/overlap_efficiency"),
            "criterion": "no host sync inside a slice; decode stream priority above the side stream's; "
                         "some prompt work hidden"}


def _stream_priorities(trainer) -> dict:
    decode = getattr(trainer.engine, "decode_stream", None)
    side = getattr(trainer, "side_stream", None)
    return {"decode": decode.priority if decode is not None else None,
            "side": side.priority if side is not None else None}


def check_bench_schedules(device: str) -> dict:
    """tools/bench_schedules.py: serial-naive, serial-prefix and overlap on the same
    workload (configs/bench_h200_video.yaml on CUDA, a tiny one on the CPU), 3 measured
    steps after a warm-up, no profiler. It must do the same work in every schedule,
    and overlap must train as serial-prefix does: equal grad norm, KL and entropy at
    every step. Exactly on the CPU; on CUDA, atomics reorder sums (the embedding's
    backward), so the warm-up step (same weights, same samples) is held to 1e-4
    relative and the later ones, whose samples may differ in a few tokens after
    weights that differ in their last bits, to 2e-2."""
    import bench_schedules

    cuda = _cuda(device)
    if cuda:
        argv = ["--config", str(REPO / "configs/bench_h200_video.yaml"), "--steps", "3"]
    else:
        argv = ["--config", str(REPO / "configs/tiny.yaml"), "--steps", "1", "--data.task", "direction",
                "--data.batch_size", "2", "--rollout.n", "2", "--rollout.max_tokens", "4",
                "--algorithm.kl_coef", "0.01", "--algorithm.updates_per_batch", "1",
                "--rollout.kv_cache_memory", "16e6", "--trainer.device", "cpu"]
    with tempfile.TemporaryDirectory() as work:  # the random checkpoint stays out of the artifacts
        report = bench_schedules.main(argv + ["--no-trace", "--trainer.output_dir", work,
                                              "--out", str(ARTIFACTS / "bench_schedules")])
    schedules = report["schedules"]
    first_tolerance, later_tolerance = (1e-4, 2e-2) if cuda else (0.0, 0.0)
    per_step = _relative_differences(schedules["overlap"], schedules["serial-prefix"],
                                     ("actor/grad_norm", "actor/kl_loss", "actor/entropy"))
    trains_alike = per_step[0] <= first_tolerance and max(per_step[1:]) <= later_tolerance
    probs_diff_max = max(r["training/rollout_probs_diff_max"] for r in _rows(schedules["overlap"]))
    # One update per batch, so the trainer scores the rollout's own weights: only numerics differ.
    probs_bound = 0.05 if cuda else 1e-4
    prefix = schedules["serial-prefix"]["mean"]
    ok = report["same_samples"] and trains_alike and probs_diff_max <= probs_bound
    return {"ok": ok, **report["ratios"], "same_samples": report["same_samples"],
            "overlap_vs_serial_prefix_rel_diff_per_step": per_step, "rollout_probs_diff_max": probs_diff_max,
            "config": Path(argv[1]).name,
            "step_s": {name: s["mean"]["timing_s/step"] for name, s in schedules.items()},
            "gen_gpu_s": {name: s["mean"].get("timing_s/gen_gpu") for name, s in schedules.items()},
            "cuda_graph_capture_s": {name: s["mean"].get("timing_s/cuda_graph_capture")
                                     for name, s in schedules.items()},
            "throughput": {name: s["mean"]["perf/throughput"] for name, s in schedules.items()},
            "prompt_work_share_of_serial_prefix_step": prefix.get("timing_s/prefix", 0.0) / prefix["timing_s/step"],
            "prefix_deferred_items": schedules["overlap"]["mean"].get("prefix/deferred_items"),
            "overlap_efficiency": schedules["overlap"]["mean"].get("perf/overlap_efficiency"),
            "criterion": f"same samples; overlap = serial-prefix within {first_tolerance} relative at the "
                         f"warm-up step, {later_tolerance} after; rollout_probs_diff_max <= {probs_bound}",
            "note": "random weights; timing only"}


def _rows(schedule: dict) -> list[dict]:
    return [schedule["warmup"], *schedule["steps"]]


def _relative_differences(a: dict, b: dict, keys: tuple[str, ...]) -> list[float]:
    """Per step, the largest |x - y| / max(|x|, |y|, 1e-6) over `keys` (KL is ~0 at the first step)."""
    return [max(abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), 1e-6) for k in keys)
            for x, y in zip(_rows(a), _rows(b))]


def check_engine_throughput(device: str) -> dict:
    """Decode throughput of a 3B-shaped model (random weights) at batch 64: eager, CUDA
    graphs, and CUDA graphs with the host finishing each step before it issues the next
    (run_ahead off), side by side. Warm-up runs the timed requests once, so capture stays
    out of the timed window; the captures it did run are counted. On CUDA also the host
    syncs per decode step that torch's sync debug mode reports (a run-ahead decode step
    should make none: the host waits only on the event of the step before)."""
    from rollplex.engine import Engine, EngineConfig, Request, SamplingParams

    cuda = _cuda(device)
    args = _3b_args(cuda)
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    model.set_attn_backend("auto")
    batch, prompt, steps = (64, 512, 128) if cuda else (4, 16, 8)
    requests = [Request(_text_prompt(100, 100 + prompt)) for _ in range(batch)]
    result = {"attn_backend": model.attn_backend, "batch": batch, "prompt_tokens": prompt,
              "note": "random weights; timing only"}
    for key, eager, run_ahead in (("eager", True, True), ("cuda_graphs", False, True),
                                  ("cuda_graphs_settled", False, False)):
        engine = Engine(model, EngineConfig(enforce_eager=eager, max_num_seqs=batch, max_model_len=1024,
                                            progress=False, run_ahead=run_ahead))
        engine.runner.use_cuda_graphs = not eager  # on CPU: the stand-in (the dry run)
        timings, syncs = {}, {}
        for max_tokens in (1, steps + 1):
            params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
            engine.generate(requests, params)  # warm-up: same pool, so any capture happens here
            captures = engine.runner.captures
            _sync(device)
            with _counting_host_syncs(cuda) as counted:
                t0 = time.perf_counter()
                engine.generate(requests, params)
                _sync(device)
                timings[max_tokens] = time.perf_counter() - t0
            syncs[max_tokens] = sum("synchroniz" in str(w.message) for w in counted)
            result.setdefault("captures_in_timed_window", 0)
            result["captures_in_timed_window"] += engine.runner.captures - captures
        step = (timings[steps + 1] - timings[1]) / steps
        result[f"{key}_decode_step_ms"] = step * 1e3
        result[f"{key}_decode_tokens_per_s"] = batch / step
        if cuda:
            result[f"{key}_host_syncs_per_decode_step"] = (syncs[steps + 1] - syncs[1]) / steps
        if key == "cuda_graphs":
            result.update(captures=engine.runner.captures, capture_seconds=engine.runner.capture_seconds)
    result["run_ahead_speedup"] = result["cuda_graphs_settled_decode_step_ms"] / result["cuda_graphs_decode_step_ms"]
    result["ok"] = result["captures_in_timed_window"] == 0
    result["criterion"] = "no graph capture inside a timed window"
    return result


@contextlib.contextmanager
def _counting_host_syncs(cuda: bool):
    """The host syncs inside the block, as the warnings of torch's CUDA sync debug mode (none on CPU)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")


def check_forward_timing(device: str) -> dict:
    """Packed training-shaped forward of a 3B-shaped model (random weights) in bf16."""
    cuda = _cuda(device)
    args = _3b_args(cuda)
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0, init_std=None)
    model.set_attn_backend("auto")
    video, prompts, iters = ((8, 28, 28), 8, 5) if cuda else ((2, 8, 8), 2, 1)
    seqs = [_multimodal_prompt(args, device, image_hw=video[1:], video_thw=video, seed=i) for i in range(prompts)]
    batch = pack_sequences(args, seqs)
    tokens = int(batch.input_ids.numel())
    with torch.no_grad():
        logits = model.forward_packed(batch)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            model.forward_packed(batch)
        _sync(device)
    dt = (time.perf_counter() - t0) / iters
    return {"ok": bool(torch.isfinite(logits).all()), "criterion": "finite outputs", "attn_backend": model.attn_backend,
            "tokens": tokens, "forward_s": dt, "tokens_per_s": tokens / dt, "note": "random weights; timing only"}


def check_gpu_tests(device: str) -> dict:
    """tests/paged_decode_triton_cases.py and tests/cascade_decode_triton_cases.py, compiled on the GPU, and
    the test files with CUDA cases, which skip them on a CPU: none may be skipped there. The CPU dry run
    runs one case of each kernel file, in the interpreter (tests/test_paged_decode_triton.py runs them all)."""
    files = ["tests/paged_decode_triton_cases.py", "tests/cascade_decode_triton_cases.py"]
    if _cuda(device):
        files += ["tests/test_cuda_graphs.py", "tests/test_sampler.py",
                  "tests/test_nonfinite.py::test_a_weight_gone_bad_under_a_decode_graph_is_caught_and_located"]
    else:
        files = [f"{files[0]}::test_odd_head_dim_and_group", f"{files[1]}::test_a_group_cut_leaves_a_group_of_one"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          *(str(REPO / f) for f in files)], cwd=REPO, env=env, capture_output=True, text=True)
    summary = (res.stdout.strip().splitlines() or [""])[-1]
    ok = res.returncode == 0 and not (_cuda(device) and "skipped" in summary)
    return {"ok": ok, "criterion": "every case passes, none skipped on CUDA", "files": files, "summary": summary,
            "output_tail": (res.stdout + res.stderr)[-1500:] if not ok else ""}


CHECKS = {
    "model_parity_bf16": check_model_parity_bf16,
    "paged_decode_triton": check_paged_decode_triton,
    "cascade_decode_triton": check_cascade_decode_triton,
    "engine_cuda_graphs": check_engine_cuda_graphs,
    "overlap_step": check_overlap_step,
    "engine_throughput_3b": check_engine_throughput,
    "forward_timing_3b": check_forward_timing,
    "gpu_tests": check_gpu_tests,
    "bench_schedules": check_bench_schedules,  # the longest (about 5 minutes on an H200): last
}
INTERPRETED_ON_CPU = ("paged_decode_triton", "cascade_decode_triton", "gpu_tests")  # Triton's interpreter on the CPU
ARTIFACTS = Path(".")  # where checks write files beyond the JSON report (set next to --out)


# ---------------------------------------------------------------------- the driver


def run_one(name: str, device: str, result_file: Path) -> None:
    """In the child process: run one check, write its result as JSON."""
    t0 = time.perf_counter()
    try:
        result = CHECKS[name](device)
    except Exception as e:  # recorded as a failure with its traceback
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result_file.write_text(json.dumps(result, default=str))


def run_in_child(name: str, device: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        result_file = Path(d) / "result.json"
        cmd = [sys.executable, __file__, "--run-one", name, "--device", device, "--result", str(result_file),
               "--artifacts", str(ARTIFACTS)]
        # Triton reads TRITON_INTERPRET once, at its import (torch imports it): set before the process starts.
        env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if name in INTERPRETED_ON_CPU and not _cuda(device)
                                  else {}))
        t0 = time.perf_counter()
        try:
            code = subprocess.run(cmd, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {timeout:.0f} s", "seconds": round(timeout, 2)}
        if result_file.exists():
            return json.loads(result_file.read_text())
        return {"ok": False, "error": f"the check's process exited with status {code} and no result",
                "seconds": round(time.perf_counter() - t0, 2)}


def commit_id() -> str:
    if os.environ.get("ROLLPLEX_COMMIT"):
        return os.environ["ROLLPLEX_COMMIT"]
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
        return res.stdout.strip() if res.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def header(device: str) -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if _cuda(device) else "cpu (dry run of the script)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit_id()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these checks: {', '.join(CHECKS)}")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: the script's own dry run")
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting checks past this time")
    parser.add_argument("--run-one", choices=list(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--artifacts", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    global ARTIFACTS
    if opts.run_one:
        ARTIFACTS = opts.artifacts
        run_one(opts.run_one, opts.device, opts.result)
        return 0
    unknown = sorted(set(opts.only or ()) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; the checks are: {', '.join(CHECKS)}")
    if _cuda(opts.device) and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu for a dry run of the script)", file=sys.stderr)
        return 2
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACTS = out.resolve().parent
    selected = [name for name in CHECKS if not opts.only or name in opts.only]
    report = {**header(opts.device), "budget_s": opts.budget_s, "checks": {}}
    start = time.perf_counter()
    for name in selected:
        left = opts.budget_s - (time.perf_counter() - start)
        if left < 5:
            result = {"ok": False, "error": "not run: the time budget was spent"}
        else:
            result = run_in_child(name, opts.device, left)
        report["checks"][name] = result
        report["seconds"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")  # after every check
        figures = {k: v for k, v in result.items() if k != "traceback"}
        print(f"{name}: {'ok' if result.get('ok') else 'FAILED'} {json.dumps(figures, default=str)[:600]}",
              flush=True)
    print(f"report written to {out}")
    return 0 if all(r.get("ok") for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
