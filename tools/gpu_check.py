"""Every GPU-only check of Rollplex in one run, with a JSON report.

    ROLLPLEX_COMMIT=<sha> python tools/gpu_check.py --out $OUT/gpu_check.json

Checks run most important first: the engine, the kernels' and models' correctness
(the GPU test cases first), the schedule benchmark, then the optional ones (`CHECKS`,
where each one's estimate on one H200 is, compiles included; docs/GPU.md). The
required checks' estimates leave at least SPARE_S of the default budget. Each
returns a dict of figures with an "ok" verdict
that can fail. Consecutive checks of one process key run in one child process,
which pays the imports once (about 16 s on the device machine); a check that
raises ends its process, since a CUDA error can leave the context unusable, and
the checks after it get a fresh one. Each child is started in a session of its
own and killed with its whole process group when its running check passes its
time limit (twice its estimate plus 30 s) or the run's budget (`--budget-s`,
default 540 s). The JSON report is rewritten after every check, so a run cut
short still reports what it did; what the budget does not reach is reported
as not run. An optional check starts only when the budget left covers its
estimate, and skipping it is no failure. `--only NAME ...` runs a subset; an
unknown name is an error. `--device cpu` runs every check at its smallest size
on the CPU, in Triton's interpreter: that tests this script and the checks' own
logic (tests/test_gpu_check.py), not the GPU paths. The exit status is 0 only
when every selected check ran and passed, or was an optional one skipped.

The commit comes from ROLLPLEX_COMMIT (the device machine gets a copy of the
working tree without .git), else from git.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest.mock
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))  # sibling tools (bench_schedules, bench_sampler, bench_logprob_head)

from rollplex.models import build_model, family_named, family_of, from_pretrained, save_pretrained  # noqa: E402
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs  # noqa: E402
from rollplex.models.inputs import Prompt  # noqa: E402
from rollplex.models.packing import pack_sequences  # noqa: E402

if TYPE_CHECKING:
    from rollplex.engine import Engine
    from rollplex.engine.sampler import SamplingParams

ARTIFACTS = Path(".")  # where checks write files beyond the JSON report (set next to --out)
DEADLINE = float("inf")  # time.time() at which the run's budget ends (set in a child from --deadline)


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
    """Token ids with one image and one video, random pixels, as the family's processor lays them out: for
    Qwen3-VL (`rope_spec.split_video_frames`) each frame group after a timestamp, in a start / end of its own."""
    g = torch.Generator().manual_seed(seed)
    row = 3 * args.vision.temporal_patch_size * args.vision.patch_size**2
    merge2 = args.vision.spatial_merge_size**2
    ig = torch.tensor([[1, *image_hw]])
    vg = torch.tensor([video_thw])
    ni, nv = int(ig.prod()) // merge2, int(vg.prod()) // merge2
    vs, ve, img, vid = args.vision_start_token_id, args.vision_end_token_id, args.image_token_id, args.video_token_id
    video = [vid] * nv
    if args.rope_spec.split_video_frames:
        groups = video_thw[0]
        video = [t for j in range(groups) for t in (40 + j, 41, vs, *[vid] * (nv // groups), ve)]
    ids = [1, 2, vs] + [img] * ni + [ve, 3, vs] + video + [ve] + list(range(10, 60))
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


# ---------------------------------------------------------------------- criteria


def verdict_of(criteria: dict[str, bool], text: str) -> dict:
    """A check's verdict: ok when every named criterion holds; the ones that failed are named."""
    return {"ok": all(criteria.values()), "failed": [name for name, held in criteria.items() if not held],
            "criterion": text}


def _tokens(outputs: list) -> list[list[list[int]]]:
    """Each group's samples' token ids, from Engine.generate's groups."""
    return [[list(s.token_ids) for s in group.samples] for group in outputs]


def _equal_share(a: list[list[list[int]]], b: list[list[list[int]]]) -> float:
    """The share of samples whose token ids are the same in `a` and `b` (groups alike)."""
    pairs = [(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb)]
    return sum(x == y for x, y in pairs) / len(pairs)


# How the schedules' training figures compare with serial-prefix's, step by step. With lr 0 every step starts from
# the same weights in every schedule, so every step is held to the same bound. KL is 0 at lr 0 (the reference model
# is the actor), so the denominator has a floor: a KL at rounding level passes, a wrong reference logprob does not.
TRAINING_KEYS = ("actor/grad_norm", "actor/kl_loss", "actor/entropy")
RELATIVE_FLOOR = 1e-3


@dataclass(frozen=True)
class Tolerances:
    """The bounds of a schedule's training figures (relative) and rollout probabilities against serial-prefix's."""

    same_passes: float  # overlap: serial-prefix's passes, moved into the decode window
    other_passes: float  # overlap-stream, deferred prompt work, serial-naive: the same sums, other micro-batches
    rollout_probs: float  # training/rollout_probs_diff_max: the engine's probabilities against the trainer's

    @classmethod
    def on(cls, cuda: bool) -> Tolerances:
        """CUDA: bf16, and atomics reorder sums (the embedding's backward), so 1e-4 for the same passes;
        other micro-batches round differently, 1e-2. CPU: fp32 and deterministic, exact for the same
        passes, 1e-5 for sums in another order."""
        return cls(1e-4, 1e-2, 0.05) if cuda else cls(0.0, 1e-5, 1e-4)


def schedule_rows(schedule: dict) -> list[dict]:
    """A bench_schedules schedule's metrics rows: warm-up, measured steps, then the traced step if any."""
    return [schedule["warmup"], *schedule["steps"], *([schedule["traced"]] if schedule.get("traced") else [])]


def relative_differences(a: dict, b: dict, keys: tuple[str, ...] = TRAINING_KEYS) -> list[float]:
    """Per step both schedules ran, the largest |x - y| / max(|x|, |y|, RELATIVE_FLOOR) over `keys`."""
    return [max(abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k]), RELATIVE_FLOOR) for k in keys)
            for x, y in zip(schedule_rows(a), schedule_rows(b))]


def against_serial_prefix(schedule: dict, prefix: dict, tolerance: float, probs_bound: float) -> dict:
    """How a schedule of bench_schedules compares with serial-prefix over the steps both ran: the same
    sampled token ids at every step (their digests), training figures within `tolerance` (relative),
    and the rollout's probabilities within `probs_bound` of the trainer's at every step."""
    steps = min(len(schedule["sample_digests"]), len(prefix["sample_digests"]))
    per_step = relative_differences(schedule, prefix)
    probs = max(r["training/rollout_probs_diff_max"] for r in schedule_rows(schedule))
    return {"same_samples": schedule["sample_digests"][:steps] == prefix["sample_digests"][:steps],
            "trains_alike": max(per_step) <= tolerance, "rel_diff_per_step": per_step, "tolerance": tolerance,
            "rollout_probs_diff_max": probs, "rollout_probs_ok": probs <= probs_bound}


def comparison_criteria(name: str, comparison: dict) -> dict[str, bool]:
    """An `against_serial_prefix` comparison as criteria of a verdict, named after the schedule."""
    return {f"{name}_same_samples": comparison["same_samples"], f"{name}_trains_alike": comparison["trains_alike"],
            f"{name}_rollout_probs": comparison["rollout_probs_ok"]}


def per_step(schedule: dict, key: str) -> list[float | None]:
    """A metric of a bench_schedules schedule at each step (None where a step has none)."""
    return [r.get(key) for r in schedule_rows(schedule)]


# ---------------------------------------------------------------------- the engine


def _engine(model, **config) -> Engine:
    """An engine on `model` with EngineConfig(**config); CUDA graphs unless enforce_eager (on CPU:
    the runner's stand-in, which replays what it captured as a graph does)."""
    from rollplex.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(progress=False, **config))
    engine.runner.use_cuda_graphs = not config.get("enforce_eager", False)
    return engine


# The engines of engine_throughput_3b, on the same requests: EngineConfig fields besides the shared ones.
DECODE_SETUPS = {"run_ahead": {}, "settled": {"run_ahead": False}, "cascade": {"shared_prefix_decode": True}}


def check_engine_throughput_3b(device: str) -> dict:
    """3B-shaped decode (random weights, CUDA graphs) of 8 prompts of 2048 tokens x 8 samples,
    seeded sampling at temperature 1, by three engines on the same requests: run-ahead (the
    default), settled (run_ahead off: the host reads each step's tokens before it issues the
    next) and run-ahead with group-shared (cascade) attention (shared_prefix_decode). Run-ahead
    moves host work only, so its tokens must equal the settled engine's. The cascade reads the
    same K/V in another order, and bf16 rounding moves a sampled token now and then, so its
    share of equal samples is reported (engine_cuda_graphs holds it to equal tokens in fp32).
    Per engine, per decode step: time and the host syncs sync debug mode reports; each engine
    generates the timed requests once first, so capture (36 layers: its seconds are reported)
    stays out of the timed windows. Eager decode is left out: 53 ms a step at c98158e."""
    from rollplex.engine import Request

    cuda = _cuda(device)
    model = build_model(_3b_args(cuda), dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    model.set_attn_backend("auto")
    prompts, n, prompt_tokens, steps = (8, 8, 2048, 128) if cuda else (2, 2, 16, 8)
    requests = [Request(_text_prompt(100 + 7 * i, 100 + 7 * i + prompt_tokens), n=n, seed=i) for i in range(prompts)]
    result: dict = {"attn_backend": model.attn_backend, "rows": prompts * n, "prompt_tokens": prompt_tokens,
                    "decode_steps": steps, "note": "random weights; timing only"}
    tokens = {}
    for name, setup in DECODE_SETUPS.items():
        engine = _engine(model, max_num_seqs=prompts * n, max_model_len=prompt_tokens + steps + 16, **setup)
        result[name], tokens[name] = _timed_decode(engine, requests, steps, device)
        result[name].update(captures=engine.runner.captures, capture_seconds=engine.runner.capture_seconds)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    run_ahead, settled, cascade = (result[name] for name in DECODE_SETUPS)
    result["run_ahead_speedup"] = settled["decode_step_ms"] / run_ahead["decode_step_ms"]
    result["cascade_speedup"] = run_ahead["decode_step_ms"] / cascade["decode_step_ms"]
    result["cascade_equal_samples_share"] = _equal_share(tokens["cascade"], tokens["run_ahead"])
    criteria = {"run_ahead_tokens_equal_settled": tokens["run_ahead"] == tokens["settled"],
                "no_capture_in_timed_windows": all(result[name]["captures_in_timed_window"] == 0
                                                   for name in DECODE_SETUPS)}
    return {**result, **verdict_of(criteria, "run-ahead sampled the same tokens as settled decode; no graph capture "
                                             "inside a timed window")}


def _timed_decode(engine, requests: list, steps: int, device: str) -> tuple[dict, list]:
    """The engine's time per decode step (a generation of steps + 1 tokens less one of 1 token), the
    host syncs per decode step (CUDA) and the captures inside the timed generations; and the tokens of
    the longer one."""
    from rollplex.engine import SamplingParams

    cuda = _cuda(device)
    timings, syncs, captures_in_window = {}, {}, 0
    for max_tokens in (1, steps + 1):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        engine.generate(requests, params)  # warm-up: any capture happens here
        captures = engine.runner.captures
        _sync(device)
        with _counting_host_syncs(cuda) as counted:
            t0 = time.perf_counter()
            outputs = engine.generate(requests, params)
            _sync(device)
            timings[max_tokens] = time.perf_counter() - t0
        syncs[max_tokens] = sum("synchroniz" in str(w.message) for w in counted)
        captures_in_window += engine.runner.captures - captures
    step = (timings[steps + 1] - timings[1]) / steps
    rows = sum(r.n for r in requests)
    figures = {"decode_step_ms": step * 1e3, "decode_tokens_per_s": rows / step,
               "captures_in_timed_window": captures_in_window}
    if cuda:
        figures["host_syncs_per_decode_step"] = (syncs[steps + 1] - syncs[1]) / steps
    return figures, _tokens(outputs)


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


# engine_cuda_graphs' fp32 comparison of the graphed fused engine with the eager torch one: the same greedy tokens,
# and their logprobs within this. In fp32 the two differ by the order of sums and where the rotary and the residual
# GEMM round (about 1e-6); a wrong kernel moves logprobs by far more than 1e-4.
ENGINE_LOGPROB_TOLERANCE = 1e-4


def check_engine_cuda_graphs(device: str) -> dict:
    """CUDA-graph decode of a small model with the fused layer ops (rollplex.ops.fused_decode_triton,
    the default on CUDA) against eager decode with the torch ops, the trainer's arithmetic (on CPU:
    the runner's graph stand-in, the fused kernels in Triton's interpreter):
    - greedy tokens of a mixed batch (image + video prompt, text prompt) and of a larger one, and
      their logprobs within ENGINE_LOGPROB_TOLERANCE;
    - the mixed batch again after the KV pool moved (released while the old pool is held, so the new
      one lands elsewhere): its graphs must be captured anew, the tokens still alike;
    - group-shared (cascade) attention under graphs: the same greedy tokens and logprobs;
    - each graph's replay against the eager decode of the same static buffers (the same ops), bitwise,
      in the engine's dtype (bf16 on CUDA).
    The token comparisons run in fp32 (weights as build_model(init_std=None) draws them, so every layer
    moves the logits): in bf16 the fused ops round otherwise than the torch ops, and between near-tied
    logits an argmax would move now and then (engine_throughput_3b reports such shares); in fp32 the two
    differ by about 1e-6, which a wrong kernel does not. Reports how many captures ran and how long they
    took, and the largest logprob difference of each comparison."""
    from rollplex.ops.fused_decode_triton import FUSED_OPS

    cuda = _cuda(device)
    args = _tiny_args()
    if not cuda:  # the interpreter runs the fused kernels a program at a time: two layers will do
        args = dataclasses.replace(args, text=dataclasses.replace(args.text, num_hidden_layers=2))
    batches = _graph_batches(args, device)
    config = dict(max_num_seqs=16, max_model_len=1024 if cuda else 128)
    model32 = build_model(args, dtype=torch.float32, device=device, seed=0, init_std=None)
    model32.set_attn_backend("auto")
    reference, graphed = _torch_eager_and_fused_graphs(model32, cuda, **config)
    result: dict = {"attn_backend": model32.attn_backend}
    criteria = {"graphs_fused_reference_torch": graphed.runner.layer_ops is FUSED_OPS
                and reference.runner.layer_ops is None}
    expected = {name: _greedy(reference, requests, cuda) for name, requests in batches.items()}
    comparisons = {name: (graphed, requests, expected[name]) for name, requests in batches.items()}
    criteria.update(_greedy_comparisons(comparisons, result, cuda))
    before, moved_from = graphed.runner.captures, graphed.cache.data  # held: the next pool lands elsewhere
    graphed.release_kv()
    criteria.update(_greedy_comparisons({"moved_pool": (graphed, batches["mixed"], expected["mixed"])}, result, cuda))
    criteria["moved_pool_recaptured"] = graphed.runner.captures > before
    del moved_from
    cascade = _fused_engine(model32, cuda, shared_prefix_decode=True, **config)
    criteria.update(_greedy_comparisons({f"cascade_{name}": (cascade, requests, expected[name])
                                         for name, requests in batches.items()}, result, cuda))
    replayed = graphed
    if cuda:  # the replay in the engine's dtype
        model = build_model(args, dtype=torch.bfloat16, device=device, seed=0)
        model.set_attn_backend("auto")
        replayed = _fused_engine(model, cuda, **config)
        _greedy(replayed, batches["mixed"], cuda)
    result["replay_vs_eager_same_buffers_max_abs"] = _replay_against_eager(replayed)
    criteria["replay_bitwise_equal_eager"] = result["replay_vs_eager_same_buffers_max_abs"] == 0.0
    result.update(captures=graphed.runner.captures, capture_seconds=graphed.runner.capture_seconds)
    return {**result, **verdict_of(criteria, "in fp32, graphs with the fused ops give eager torch ops' greedy tokens "
                                             f"with logprobs within {ENGINE_LOGPROB_TOLERANCE:g}: both batches, "
                                             "after a moved pool (which recaptured), with cascade attention; "
                                             "replay bitwise equal to eager on the same static buffers")}


@contextlib.contextmanager
def _fused_decode_switch(value: str | None):
    """ROLLPLEX_FUSED_DECODE as `value` (None: unset) inside the block, as it was after. The runner
    reads it once, when an engine is built (`fused_decode_enabled`), so an engine built inside keeps
    that setting and none built outside sees it."""
    with unittest.mock.patch.dict(os.environ):
        os.environ.pop("ROLLPLEX_FUSED_DECODE", None)
        if value is not None:
            os.environ["ROLLPLEX_FUSED_DECODE"] = value
        yield


def _torch_eager_and_fused_graphs(model, cuda: bool, **config) -> tuple[Engine, Engine]:
    """engine_cuda_graphs' two engines on `model`: eager decode with the torch ops (ROLLPLEX_FUSED_DECODE=0),
    the reference, and CUDA-graph decode with the fused ops (`_fused_engine`)."""
    with _fused_decode_switch("0"):
        reference = _engine(model, enforce_eager=True, **config)
    return reference, _fused_engine(model, cuda, **config)


def _fused_engine(model, cuda: bool, **config) -> Engine:
    """An engine (`_engine`) with the layer ops the runner picks by default on CUDA, the fused ones;
    on CPU asked for (ROLLPLEX_FUSED_DECODE=1), which runs them in Triton's interpreter."""
    with _fused_decode_switch(None if cuda else "1"):
        return _engine(model, **config)


def _graph_batches(args: ModelArgs, device: str) -> dict[str, list]:
    """Requests of several samples each (groups sharing their prompt's blocks): a mixed batch, a larger one
    (on CPU fewer and shorter: the fused kernels run in the interpreter there, a program at a time)."""
    from rollplex.engine import Request

    if _cuda(device):
        multimodal = Request(_multimodal_prompt(args, device, video_thw=(2, 16, 16)), n=4)
        return {"mixed": [multimodal, Request(_text_prompt(1, 40), n=3)],
                "larger": [multimodal, Request(_text_prompt(1, 200), n=6), Request(_text_prompt(7, 90), n=2)]}
    multimodal = Request(_multimodal_prompt(args, device, image_hw=(4, 4), video_thw=(2, 4, 4)), n=2)
    return {"mixed": [multimodal, Request(_text_prompt(1, 12), n=1)],  # 3 rows: graph bucket 4
            "larger": [multimodal, Request(_text_prompt(1, 30), n=3), Request(_text_prompt(7, 20), n=1)]}  # 8


Greedy = tuple[list[list[list[int]]], list[list[list[float]]]]  # each group's samples' tokens, and their logprobs


def _greedy(engine, requests: list, cuda: bool) -> Greedy:
    """The engine's greedy generation of `requests` (32 tokens; 4 on CPU, in the interpreter)."""
    from rollplex.engine import SamplingParams

    outputs = engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=32 if cuda else 4,
                                                       ignore_eos=True))
    return _tokens(outputs), [[list(s.logprobs) for s in group.samples] for group in outputs]


def greedy_alike(got: Greedy, want: Greedy, tolerance: float = ENGINE_LOGPROB_TOLERANCE) -> tuple[bool, float]:
    """Whether two greedy generations gave the same tokens with logprobs within `tolerance`, and their
    largest logprob difference (inf where the tokens differ: the logprobs are of other tokens)."""
    if got[0] != want[0]:
        return False, math.inf
    worst = max((abs(a - b) for ga, gb in zip(got[1], want[1]) for sa, sb in zip(ga, gb) for a, b in zip(sa, sb)),
                default=0.0)
    return worst <= tolerance, worst


def _greedy_comparisons(comparisons: dict[str, tuple], result: dict, cuda: bool) -> dict[str, bool]:
    """Per name, (engine, requests, expected `_greedy`): whether the engine's greedy generation is alike
    (`greedy_alike`); each one's largest logprob difference goes in result["logprob_max_abs_diff"]."""
    criteria = {}
    for name, (engine, requests, expected) in comparisons.items():
        alike, worst = greedy_alike(_greedy(engine, requests, cuda), expected)
        criteria[f"{name}_greedy_alike"] = alike
        result.setdefault("logprob_max_abs_diff", {})[name] = worst
    return criteria


def _replay_against_eager(engine) -> float:
    """Replay each captured bucket, then run the eager decode on the same static buffers."""
    runner = engine.runner
    worst = 0.0
    with torch.no_grad():
        for bucket, graph in runner.graphs.items():
            s = runner.static
            graph.replay()
            replayed = runner.graph_logits[bucket].float().clone()
            eager = runner._decode_eager(*(s[name][:bucket] for name in ("ids", "positions", "slots", "tables", "lens",
                                                                          "state_rows"))).float()
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


# ---------------------------------------------------------------------- the streamed overlap step


@contextlib.contextmanager
def _decode_window_guarded(cuda: bool, calls: dict[str, int]):
    """Inside the block, every decode-window call (PromptWorkScheduler.between_steps, the prompt work's
    slices; GroupStream.between_steps, the finished groups' scoring and passes) runs with host syncs
    made errors (CUDA) and is counted in `calls`, by kind."""
    from rollplex.rl.prompt_work import PromptWorkScheduler
    from rollplex.rl.schedules.overlap_stream import GroupStream

    classes = {"prefix": PromptWorkScheduler, "stream": GroupStream}

    def guard(kind: str, between_steps: Callable) -> Callable:
        def guarded(self, running: int) -> None:
            calls[kind] += 1
            with _host_syncs_are_errors(cuda):
                between_steps(self, running)
        return guarded

    saved = {kind: cls.between_steps for kind, cls in classes.items()}
    for kind, cls in classes.items():
        calls[kind] = 0
        cls.between_steps = guard(kind, saved[kind])
    try:
        yield
    finally:
        for kind, cls in classes.items():
            cls.between_steps = saved[kind]


def check_overlap_stream_step(device: str) -> dict:
    """Three streamed overlap steps (schedule.kind overlap, schedule.stream_groups true) of a small
    model with the 3B's 36 decoder layers (graph capture costs what it costs there), video prompts,
    the reference model on, response limits of 8-48 tokens (so groups finish apart, and after the
    36-layer prompt forwards their passes read): every decode-window call, the prompt-work slices and the
    finished groups' work, runs with host syncs made errors (a sync raises, and the check fails);
    finished groups' reference and update passes must run in the window; the decode stream must
    outrank the side stream; prompt work must be hidden at every step. Reports per step the graph
    captures and their seconds (graphs are captured once per run, so after the first step these
    should be 0) and the decode window's host time."""
    from rollplex.config import load_config
    from rollplex.rl.loop import RLTrainer

    cuda = _cuda(device)
    calls: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as out, _decode_window_guarded(cuda, calls):
        cfg = load_config(["--trainer.output_dir", out, "--trainer.device", device, "--schedule.kind", "overlap",
                           "--schedule.stream_groups", "true", "--model.tiny.num_layers", "36",
                           "--data.task", "direction", "--data.batch_size", "4", "--rollout.n", "4",
                           "--rollout.max_tokens", "48", "--rollout.min_tokens", "8", "--rollout.ignore_eos", "true",
                           "--algorithm.kl_coef", "0.01", "--rollout.kv_cache_memory", "64e6",
                           "--trainer.eval_every", "0", "--logging.no_console"])
        trainer = RLTrainer(cfg)
        source = trainer._batches(0)
        rows = []
        for step in (1, 2, 3):
            trainer.step = step
            rows.append(trainer.train_step(next(source)))
        priorities = _stream_priorities(trainer)
        trainer.logger.close()
    criteria = {"prefix_slices_ran": calls["prefix"] > 0, "stream_calls_ran": calls["stream"] > 0,
                "ref_groups_streamed": sum(r["stream/ref_groups"] for r in rows) > 0,
                "update_groups_streamed": sum(r["stream/update_groups"] for r in rows) > 0,
                "prompt_work_hidden": all(r["timing_s/prefix_hidden"] > 0 for r in rows)}
    if cuda:
        criteria["decode_stream_outranks_side_stream"] = priorities["decode"] < priorities["side"]  # lower: higher
    figures = {key: [r.get(key) for r in rows] for key in (
        "perf/cuda_graph_captures", "timing_s/cuda_graph_capture", "stream/ref_groups", "stream/update_groups",
        "timing_s/prefix_hidden", "timing_s/prefix_exposed", "timing_s/stream_hidden", "timing_s/decode_slowdown",
        "perf/overlap_efficiency")}
    return {"decode_window_calls": calls, "stream_priorities": priorities, "per_step": figures,
            **verdict_of(criteria, "no host sync inside any decode-window call; reference and update passes streamed; "
                                   "decode stream priority above the side stream's; prompt work hidden at every step")}


def _stream_priorities(trainer) -> dict:
    decode = getattr(trainer.engine, "decode_stream", None)
    side = getattr(trainer, "side_stream", None)
    return {"decode": decode.priority if decode is not None else None,
            "side": side.priority if side is not None else None}


# ---------------------------------------------------------------------- the schedule benchmark


@functools.cache
def _bench_work() -> tempfile.TemporaryDirectory:
    """The trainer folder of this process's bench runs: the random checkpoint is built once, out of the artifacts."""
    return tempfile.TemporaryDirectory()


def _bench(device: str, steps: int, out: str, *options: str) -> dict:
    """tools/bench_schedules.py with `options`, its report under ARTIFACTS/`out`: on CUDA
    configs/bench_h200_video.yaml, on the CPU a tiny workload of the same form (video prompts,
    reference model on, one update per batch, response limits spread so groups finish apart);
    `steps` measured steps after the warm-up, no profiler. At lr 0 every step starts from the same
    weights in every schedule, so each must sample the same tokens and train alike at every step
    (the timings do not depend on the learning rate)."""
    import bench_schedules

    if _cuda(device):
        argv = ["--config", str(REPO / "configs/bench_h200_video.yaml")]
    else:
        argv = ["--data.task", "direction", "--data.batch_size", "4",
                "--rollout.n", "2", "--rollout.min_tokens", "1", "--rollout.max_tokens", "16",
                "--algorithm.kl_coef", "0.01", "--algorithm.updates_per_batch", "1",
                "--rollout.kv_cache_memory", "16e6", "--trainer.device", "cpu"]
    return bench_schedules.main(argv + ["--steps", str(steps), "--trainer.lr", "0", "--no-trace",
                                        "--trainer.output_dir", _bench_work().name, "--out", str(ARTIFACTS / out),
                                        *options])


def _bench_report(out: str) -> dict:
    """The report of an earlier bench run of this command (under ARTIFACTS/`out`)."""
    path = ARTIFACTS / out / "report.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: this check compares with bench_schedules' serial-prefix, "
                                "so bench_schedules must run first")
    return json.loads(path.read_text())


def check_bench_schedules(device: str) -> dict:
    """tools/bench_schedules.py: serial-prefix, overlap and overlap-stream on the same workload (see
    `_bench`), 2 measured steps each. Against serial-prefix, at every step: the same sampled token
    ids (their digests), the training figures (grad norm, KL loss, entropy) within the tolerance of
    the passes (Tolerances: 1e-4 relative for overlap's, 1e-2 for overlap-stream's per-group
    micro-batches, on CUDA), the rollout's probabilities within 0.05 of the trainer's (CUDA).
    overlap-stream must stream reference and update passes (stream/ref_groups, stream/update_groups).
    Reports per schedule the step times, the gen phase's GPU time, graph captures per step, the
    decode window's host time (timing_s/decode_slowdown), the stream's hidden work, and the ratios."""
    cuda = _cuda(device)
    report = _bench(device, 2, "bench_schedules", "--schedules", "serial-prefix", "overlap", "overlap-stream")
    schedules, tolerances = report["schedules"], Tolerances.on(cuda)
    prefix, streamed = schedules["serial-prefix"], schedules["overlap-stream"]
    comparisons = {name: against_serial_prefix(schedules[schedule], prefix, tolerance, tolerances.rollout_probs)
                   for name, schedule, tolerance in (("overlap", "overlap", tolerances.same_passes),
                                                     ("overlap_stream", "overlap-stream", tolerances.other_passes))}
    criteria = {"serial_prefix_rollout_probs": max(per_step(prefix, "training/rollout_probs_diff_max"))
                <= tolerances.rollout_probs,
                "overlap_stream_ref_groups": sum(per_step(streamed, "stream/ref_groups")) > 0,
                "overlap_stream_update_groups": sum(per_step(streamed, "stream/update_groups")) > 0}
    for name, comparison in comparisons.items():
        criteria.update(comparison_criteria(name, comparison))
    return {"ratios": report["ratios"], "against_serial_prefix": comparisons,
            "sample_digests": {name: s["sample_digests"] for name, s in schedules.items()},
            **_bench_figures(schedules), "note": "random weights; lr 0; timing only",
            **verdict_of(criteria, "the same sampled tokens as serial-prefix at every step; grad norm, KL loss and "
                                   f"entropy within {tolerances.same_passes} relative (overlap) and "
                                   f"{tolerances.other_passes} (overlap-stream) of serial-prefix's at every step; "
                                   f"rollout_probs_diff_max <= {tolerances.rollout_probs}; overlap-stream streamed "
                                   "reference and update passes")}


BENCH_FIGURES = {  # figure name: metric, reported per schedule and step
    "step_s": "timing_s/step", "gen_s": "timing_s/gen", "gen_gpu_s": "timing_s/gen_gpu",
    "cuda_graph_captures": "perf/cuda_graph_captures", "cuda_graph_capture_s": "timing_s/cuda_graph_capture",
    "decode_window_host_s": "timing_s/decode_slowdown", "prefix_hidden_s": "timing_s/prefix_hidden",
    "prefix_exposed_s": "timing_s/prefix_exposed", "stream_hidden_s": "timing_s/stream_hidden",
    "stream_exposed_s": "timing_s/stream_exposed", "prefix_deferred_items": "prefix/deferred_items",
    "throughput": "perf/throughput"}


def _bench_figures(schedules: dict) -> dict:
    """Per figure (BENCH_FIGURES), per schedule: its value at each step (warm-up first), where it has one."""
    figures = {}
    for figure, metric in BENCH_FIGURES.items():
        values = {name: per_step(s, metric) for name, s in schedules.items()}
        figures[figure] = {name: v for name, v in values.items() if any(x is not None for x in v)}
    return figures


def check_bench_small_prefix_budget(device: str) -> dict:
    """overlap with a prefix memory budget (schedule.prefix_memory_budget) of half the prompt-state
    bytes serial-prefix admitted in bench_schedules (its prefix/planned_bytes), 1 measured step: the
    actor's prompt forward with its graph, the largest item and admitted after the reference's, no
    longer fits and takes the serial path, so deferred items must be reported at every step, and the
    step must still sample and train as serial-prefix's did (1e-2 relative on CUDA: the deferred work
    runs full per-sample passes). Reports what the deferred work costs the step."""
    cuda = _cuda(device)
    prefix = _bench_report("bench_schedules")["schedules"]["serial-prefix"]
    budget = prefix["mean"]["prefix/planned_bytes"] / 2
    report = _bench(device, 1, "bench_small_prefix_budget", "--schedules", "overlap", "--no-timeline",
                    "--schedule.prefix_memory_budget", f"{budget:.0f}")
    variant, tolerances = report["schedules"]["overlap"], Tolerances.on(cuda)
    comparison = against_serial_prefix(variant, prefix, tolerances.other_passes, tolerances.rollout_probs)
    criteria = {"items_deferred": all(d > 0 for d in per_step(variant, "prefix/deferred_items")),
                **comparison_criteria("small_budget", comparison)}
    return {"prefix_memory_budget": budget, "against_serial_prefix": comparison,
            "throughput_over_serial_prefix": variant["mean"]["perf/throughput"] / prefix["mean"]["perf/throughput"],
            **_bench_figures({"serial-prefix": prefix, "overlap-small-budget": variant}),
            **verdict_of(criteria, "deferred items at every step; the same sampled tokens as serial-prefix; training "
                                   f"figures within {tolerances.other_passes} relative of serial-prefix's")}


def check_bench_serial_naive(device: str) -> dict:
    """serial-naive (no prompt work shared), 1 measured step, against bench_schedules' serial-prefix:
    the same sampled tokens and training figures within 1e-2 relative on CUDA (per-sample passes).
    Optional: its ratio to serial-prefix (5.0 at c98158e) is known, and its steps are the slowest."""
    cuda = _cuda(device)
    prefix = _bench_report("bench_schedules")["schedules"]["serial-prefix"]
    naive = _bench(device, 1, "bench_serial_naive", "--schedules", "serial-naive",
                   "--no-timeline")["schedules"]["serial-naive"]
    tolerances = Tolerances.on(cuda)
    comparison = against_serial_prefix(naive, prefix, tolerances.other_passes, tolerances.rollout_probs)
    return {"against_serial_prefix": comparison,
            "throughput_serial_prefix_over_serial_naive": prefix["mean"]["perf/throughput"] /
            naive["mean"]["perf/throughput"],
            **_bench_figures({"serial-prefix": prefix, "serial-naive": naive}),
            **verdict_of(comparison_criteria("serial_naive", comparison),
                         f"the same sampled tokens as serial-prefix; training figures within {tolerances.other_passes} "
                         "relative of serial-prefix's")}


# ---------------------------------------------------------------------- the rest


def check_model_parity_bf16(device: str) -> dict:
    """Rollplex's Qwen2.5-VL vs transformers', in fp32 and bf16 (`_parity`)."""
    return _parity(_tiny_args(), device)


def check_qwen3_vl(device: str) -> dict:
    """Rollplex's Qwen3-VL (DeepStack, interleaved M-RoPE, frame groups) vs transformers': logits in fp32
    and bf16 (`_parity`), and the engine's greedy tokens (CUDA graphs on CUDA, fp32) against transformers'
    generate for an image + video prompt and a text prompt."""
    from rollplex.engine import Request, SamplingParams

    args = family_named("qwen3_vl").tiny_args()
    result = _parity(args, device)
    model = build_model(args, dtype=torch.float32, device=device, seed=0, init_std=None)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf = family_of(args).transformers_class().from_pretrained(d, dtype=torch.float32).to(device).eval()
    prompts = [_multimodal_prompt(args, device, image_hw=(8, 12), video_thw=(2, 8, 8)), _text_prompt(1, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = _tokens(_engine(model, max_num_seqs=4, max_model_len=512).generate([Request(p) for p in prompts],
                                                                                params))
    theirs = [[_hf_greedy(hf, p, args, params.max_tokens)] for p in prompts]
    result["greedy_tokens_equal_transformers"] = ours == theirs
    result["ok"] = result["ok"] and ours == theirs
    result["criterion"] += "; engine greedy tokens (fp32) equal transformers' generate"
    return result


def _hf_greedy(hf, prompt: Prompt, args: ModelArgs, max_new: int) -> list[int]:
    ids = prompt.input_ids[None]
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=_mm_types(ids, args),
                          do_sample=False, max_new_tokens=max_new, eos_token_id=None, **_vision_inputs(prompt))
    return out[0, ids.shape[1]:].tolist()


def _mm_types(ids: torch.Tensor, args) -> torch.Tensor:
    """transformers' mm_token_type_ids: 1 at image tokens, 2 at video tokens."""
    return (ids == args.image_token_id).long() + 2 * (ids == args.video_token_id).long()


def _vision_inputs(prompt: Prompt) -> dict:
    """The prompt's pixels and grids, as transformers' forward takes them."""
    return {k: getattr(prompt, k) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if getattr(prompt, k) is not None}


# ---------------------------------------------------------------------- Qwen3.5


# fla's kernels against the torch path (rollplex.ops.gated_delta) on the same inputs: bounds on the relative RMS
# error (the RMS of fla - torch over torch's RMS), twice the largest of fla's own tests' bounds against an fp32
# reference in fp16 and bf16 (tests/ops/test_gdn.py: 0.005 to 0.008 for outputs, states and the q, k, v and
# initial-state gradients; 0.02 to 0.035 for g's and beta's). A wrong layout (key heads grouped the other way,
# a state transposed, q unscaled) is off by an RMS of the order of the values themselves.
FLA_RMS_BOUNDS = {"out": 0.016, "final_state": 0.016, "q": 0.016, "k": 0.016, "v": 0.016, "g": 0.07, "beta": 0.07,
                  "initial_state": 0.016}
# The decode step: both paths compute in fp32 from the same inputs and round outputs to v's dtype alike, so they
# differ by the order of sums (and an output rounded the other way now and then).
DELTA_STEP_RMS_BOUND = 1e-3
# DeltaNet heads (key heads, value heads, head dim). fla tunes its chunked kernels per head shape and dtype (Triton's
# autotuning: a few dozen compiles), so qwen3_5 meets few: its kernel comparison takes the 4B's and 9B's heads,
# whose key heads serve two value heads each; its models take the 2B's, whose do not, so transformers (which
# expands key heads to the value heads before it calls fla) hands fla the same shapes as Rollplex.
DELTANET_HEADS_GROUPED = (16, 32, 128)
DELTANET_HEADS_2B = (16, 16, 128)


def check_qwen3_5(device: str) -> dict:
    """Qwen3.5 on the GPU, in three parts (on the CPU each at its smallest, the torch ops on both sides):
    - fla's kernels against the torch ops (`_fla_against_torch`): the chunked rule over packed sequences of
      1 to 2,048 tokens from random initial states, its outputs, final states and the gradients of q, k,
      v, g, beta and the initial states (a loss on outputs and final states); the decode step over four
      steps, fla's captured in a CUDA graph, against eager torch ops;
    - bf16 engine greedy decode under CUDA graphs against transformers' bf16 and fp32 models on a tiny
      Qwen3.5 (`_qwen3_5_engine_against_transformers`): groups of two forking one prefill, prompts of an
      image and a video and of 100 text tokens;
    - the rollout/trainer logprob gap (`_qwen3_5_logprob_gap`) on 4 layers of Qwen3.5-2B's widths,
      random weights: sampled tokens' engine logprobs against the trainer's shared-prefix and
      full-sequence passes, reported, and held to the RL loop's bound on probabilities."""
    fla, fla_criteria = _fla_against_torch(device)
    engine, engine_criteria = _qwen3_5_engine_against_transformers(device)
    gap, gap_criteria = _qwen3_5_logprob_gap(device)
    criteria = {**fla_criteria, **engine_criteria, **gap_criteria}
    text = (f"fla within {FLA_RMS_BOUNDS} (relative RMS) of the torch ops, its graphed decode step within "
            f"{DELTA_STEP_RMS_BOUND:g}; the bf16 engine's logprobs, and its tokens' distance below the best, within "
            "2 x bf16 transformers' logprob error against fp32 transformers' + 1e-2 (CPU fp32: "
            f"{ENGINE_LOGPROB_TOLERANCE:g}); rollout probabilities within the RL loop's bound of the trainer's")
    return {"fla": fla, "engine_vs_transformers": engine, "rollout_trainer_gap": gap, **verdict_of(criteria, text)}


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """The RMS of got - want over want's RMS."""
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30)).item()


def _delta_inputs(tokens: int, states: int, heads: tuple[int, int, int], device: str, seed: int) -> list[torch.Tensor]:
    """q, k, v, g, beta and initial states as a Qwen3.5 layer hands them to the gated delta rule: q and k
    L2-normalised in fp32, v and beta in the activations' dtype (bf16 on CUDA), g = -A softplus(x) in fp32
    with A from 0.01 to 16 across heads (some decay within a token, others barely over thousands)."""
    from rollplex.ops.gated_delta import l2norm

    key_heads, value_heads, dim = heads
    dtype = torch.bfloat16 if _cuda(device) else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k = l2norm(draw(tokens, key_heads, dim)), l2norm(draw(tokens, key_heads, dim))
    v = draw(tokens, value_heads, dim).to(dtype)
    g = -torch.logspace(-2, math.log10(16), value_heads, device=device) * F.softplus(draw(tokens, value_heads) - 2)
    beta = draw(tokens, value_heads).sigmoid().to(dtype)
    return [q, k, v, g, beta, draw(states, value_heads, dim, dim)]


def _fla_against_torch(device: str) -> tuple[dict, dict[str, bool]]:
    """fla's chunked rule (forward and backward) and graphed decode step against the torch ops', as
    relative RMS errors (`check_qwen3_5`). On the CPU fla cannot run: torch against itself, said so."""
    from rollplex.ops.gated_delta import chunk_gated_delta_rule

    cuda = _cuda(device)
    candidate = "fla" if cuda else "torch"
    lengths, heads = ([1, 63, 64, 65, 500, 2048, 1355], DELTANET_HEADS_GROUPED) if cuda else ([5, 70, 1], (2, 4, 16))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    inputs = _delta_inputs(sum(lengths), len(lengths), heads, device, seed=0)
    gen = torch.Generator(device=device).manual_seed(1)
    out_weight = torch.randn(inputs[2].shape, generator=gen, device=device)
    state_weight = torch.randn(inputs[5].shape, generator=gen, device=device)
    results = {}
    for backend in (candidate, "torch"):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out, final = chunk_gated_delta_rule(*leaves[:5], cu_seqlens, leaves[5], backend=backend)
        # A loss on both: the backward carries the state's gradient, as a shared-prefix pass's does.
        grads = torch.autograd.grad((out.float() * out_weight).sum() + (final * state_weight).sum(), leaves)
        results[backend] = {"out": out, "final_state": final,
                            **dict(zip(("q", "k", "v", "g", "beta", "initial_state"), grads))}
    chunk = {name: _relative_rms(results[candidate][name], results["torch"][name]) for name in FLA_RMS_BOUNDS}
    step = _delta_step_against_torch(device, candidate, heads)
    figures = {"compared": f"{candidate} against torch" + ("" if cuda else " (CPU: fla runs on CUDA only)"),
               "heads": heads, "lengths": lengths, "chunk_relative_rms": chunk, "step_relative_rms": step}
    criteria = {f"chunk_{name}": error <= FLA_RMS_BOUNDS[name] for name, error in chunk.items()}
    criteria.update({f"step_{name}": error <= DELTA_STEP_RMS_BOUND for name, error in step.items()})
    return figures, criteria


def _delta_step_against_torch(device: str, candidate: str, heads: tuple[int, int, int]) -> dict[str, float]:
    """Four decode steps of 64 rows (CPU: two of three) from random states with `candidate`'s step, on
    CUDA captured once in a CUDA graph and replayed with each step's inputs copied in, against eager
    torch steps: the relative RMS error of the outputs and the final states."""
    from rollplex.ops.gated_delta import recurrent_gated_delta_step

    cuda = _cuda(device)
    rows, steps = (64, 4) if cuda else (3, 2)
    per_step = [_delta_inputs(rows, rows, heads, device, seed=10 + s) for s in range(steps)]
    initial = per_step[0][5]
    state = initial.clone()
    expected = [recurrent_gated_delta_step(*inputs[:5], state, backend="torch") for inputs in per_step]
    static = [x.clone() for x in per_step[0][:5]]
    candidate_state = initial.clone()

    def step() -> torch.Tensor:
        return recurrent_gated_delta_step(*static, candidate_state, backend=candidate)

    if cuda:  # compiled outside the capture, which records without running: the state is then reset
        step()
        candidate_state.copy_(initial)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_out = step()
    outs = []
    for inputs in per_step:
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        if cuda:
            graph.replay()
            outs.append(graphed_out.clone())
        else:
            outs.append(step())
    return {"out": _relative_rms(torch.stack(outs), torch.stack(expected)),
            "final_state": _relative_rms(candidate_state, state)}


def _qwen3_5_tiny_args(cuda: bool):
    """The family's tiny model; on CUDA with Qwen3.5-2B's DeltaNet heads (DELTANET_HEADS_2B)."""
    from rollplex.models.qwen3_5 import tiny_args

    args = tiny_args()
    if not cuda:
        return args
    key_heads, value_heads, dim = DELTANET_HEADS_2B
    text = dataclasses.replace(args.text, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                               linear_key_head_dim=dim, linear_value_head_dim=dim)
    return dataclasses.replace(args, text=text)


def _qwen3_5_engine_against_transformers(device: str) -> tuple[dict, dict[str, bool]]:
    """Greedy decode of the tiny Qwen3.5 in bf16 (CPU: fp32) by the engine (CUDA graphs; on the CPU their
    stand-in), groups of two forking one prefill, against transformers' model loaded from the same weights
    in bf16 and in fp32, each fed every sample's tokens after its prompt (`_hf_token_logprobs`). As
    `_parity` holds the bf16 forward, the engine's logprobs of its tokens must be as close to fp32
    transformers' as bf16 transformers' are, twice their largest difference plus 1e-2 (CPU:
    ENGINE_LOGPROB_TOLERANCE), and each token fp32 transformers' greedy choice or as near it. Random tiny
    weights give flat logits, so this catches a state lost or not forked, not a slight drift: the fla
    kernel comparison and the CPU fp32 engine tests hold the state's arithmetic."""
    from rollplex.engine import Request
    from rollplex.models.qwen3_5 import FAMILY

    cuda = _cuda(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    args = _qwen3_5_tiny_args(cuda)
    model = build_model(args, dtype=dtype, device=device, seed=0, init_std=None, family=FAMILY)
    model.set_attn_backend("auto")
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d, family=FAMILY)
        hf = {t: FAMILY.transformers_class().from_pretrained(d, dtype=t).to(device).eval()
              for t in {dtype, torch.float32}}
    prompts = [_multimodal_prompt(args, device, image_hw=(8, 12), video_thw=(2, 8, 8)),
               _random_text_prompt(100, args.image_token_id, seed=1, device=device)]  # over a chunk of 64
    engine = _engine(model, max_num_seqs=4, max_model_len=512)
    tokens, logprobs = _greedy(engine, [Request(p, n=2) for p in prompts], cuda)
    samples = []
    for prompt, group_tokens, group_logprobs in zip(prompts, tokens, logprobs):
        exact, rounded = (_hf_token_logprobs(hf[t], prompt, args, group_tokens) for t in (torch.float32, dtype))
        samples += [_sample_against_transformers(*sample) for sample in zip(group_tokens, group_logprobs, exact,
                                                                              rounded)]
    errors = {key: max(sample[key] for sample in samples) for key in ("engine", "transformers", "below_best")}
    bound = 2 * errors["transformers"] + (1e-2 if cuda else ENGINE_LOGPROB_TOLERANCE)
    figures = {"dtype": str(dtype), "captures": engine.runner.captures, "bound": bound,
               "logprob_max_abs_diff_vs_fp32_transformers": {k: errors[k] for k in ("engine", "transformers")},
               "max_logprob_below_fp32_transformers_best": errors["below_best"],
               "samples_equal_transformers_greedy_share": sum(sample["equal"] for sample in samples) / len(samples)}
    return figures, {"engine_logprobs_as_close_as_transformers": errors["engine"] <= bound,
                     "engine_tokens_greedy_within_bound": errors["below_best"] <= bound}


def _sample_against_transformers(tokens: list[int], logprobs: list[float], exact: torch.Tensor,
                                 rounded: torch.Tensor) -> dict[str, float]:
    """One greedy sample of the engine against transformers' log-softmax rows before each of its tokens, in
    fp32 (`exact`) and in the engine's dtype (`rounded`): the largest |difference| of the engine's and the
    rounded rows' logprobs of its tokens from fp32's, how far below fp32's best its tokens are, and
    whether every token is the rounded rows' greedy choice (1.0) or not (0.0)."""
    chosen = torch.tensor(tokens, device=exact.device)[:, None]
    want = exact.gather(1, chosen)[:, 0]
    return {"engine": (torch.tensor(logprobs, device=exact.device) - want).abs().max().item(),
            "transformers": (rounded.gather(1, chosen)[:, 0] - want).abs().max().item(),
            "below_best": (exact.max(dim=1).values - want).max().item(),
            "equal": float((rounded.argmax(dim=1) == chosen[:, 0]).all())}


def _random_text_prompt(length: int, below: int, seed: int, device: str = "cpu") -> Prompt:
    """`length` random token ids in [10, `below`): text, clear of the vision and special ids above."""
    return Prompt(torch.randint(10, below, (length,), generator=torch.Generator().manual_seed(seed)).to(device))


def _hf_token_logprobs(hf, prompt: Prompt, args, responses: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-softmax (float32, per step, over the vocabulary) before each token of each response:
    the prompt run once with its cache, each response fed after its own copy of it (generate's path, so
    a generated vision id is a text token, as in the engine)."""
    ids = prompt.input_ids[None]
    hf.model.rope_deltas = None  # transformers keeps the last prompt's M-RoPE offset, and a text prompt sets none
    result = []
    with torch.no_grad():
        out = hf(input_ids=ids, mm_token_type_ids=_mm_types(ids, args), use_cache=True, **_vision_inputs(prompt))
        for response in responses:
            steps = [out.logits[0, -1:]]
            if len(response) > 1:
                cache = deepcopy(out.past_key_values)
                fed = torch.tensor(response[:-1], device=ids.device)[None]
                steps.append(hf(input_ids=fed, past_key_values=cache, use_cache=True).logits[0])
            result.append(torch.log_softmax(torch.cat(steps).float(), dim=-1))
    return result


def _qwen3_5_2b_args(cuda: bool):
    """4 decoder layers (3 DeltaNet, 1 full attention) of Qwen3.5-2B's widths on CUDA; the tiny model on the CPU."""
    from rollplex.models.qwen3_5 import PRESETS

    if not cuda:
        return _qwen3_5_tiny_args(cuda)
    args = PRESETS["qwen3.5-2b"]
    return dataclasses.replace(args, text=dataclasses.replace(args.text, num_hidden_layers=4, layer_types=[]))


def _qwen3_5_logprob_gap(device: str) -> tuple[dict, dict[str, bool]]:
    """8 prompts of 512 random text tokens x 4 samples of 128 tokens at temperature 1 (CPU: 2 x 2 of 16
    and 8) from the engine (CUDA graphs), then the trainer's logprobs of the same tokens (no grad), by
    the shared-prefix pass (the actor's) and by full sequences: `logprob_gap` of each."""
    from rollplex.engine import Request, SamplingParams
    from rollplex.models.packing import pack_groups
    from rollplex.models.qwen3_5 import FAMILY
    from rollplex.train.actor import batch_to
    from rollplex.train.logprob_head import token_logprobs

    cuda = _cuda(device)
    args = _qwen3_5_2b_args(cuda)
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0,
                        init_std=None, family=FAMILY)
    model.set_attn_backend("auto")
    prompts, n, prompt_tokens, max_tokens = (8, 4, 512, 128) if cuda else (2, 2, 16, 8)
    requests = [Request(_random_text_prompt(prompt_tokens, args.image_token_id, seed=i, device=device), n=n, seed=i)
                for i in range(prompts)]
    engine = _engine(model, max_num_seqs=prompts * n, max_model_len=prompt_tokens + max_tokens + 16)
    groups = engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
    del engine
    rollout = torch.tensor([lp for g in groups for s in g.samples for lp in s.logprobs])
    figures: dict = {"layers": args.text.num_hidden_layers, "hidden": args.text.hidden_size,
                     "sampled_tokens": rollout.numel(), "note": "random weights"}
    with torch.no_grad():
        for name, share_prefix in (("shared_prefix", True), ("full_sequences", False)):
            batch = batch_to(pack_groups(args, groups, share_prefix=share_prefix), torch.device(device))
            hidden = model.forward_packed(batch.packed)[batch.target_index]
            trainer, _ = token_logprobs(model, hidden, batch.target_ids)
            figures[name] = logprob_gap(rollout, trainer.cpu())
    bound = Tolerances.on(cuda).rollout_probs
    return figures, {f"{name}_rollout_probs": figures[name]["probs_diff_max"] <= bound
                     for name in ("shared_prefix", "full_sequences")}


def logprob_gap(rollout: torch.Tensor, trainer: torch.Tensor) -> dict:
    """How far the trainer's logprobs of sampled tokens are from the rollout's: the largest and mean
    |difference|, the largest probability difference (the RL loop's training/rollout_probs_diff_max),
    and KL(rollout || trainer) estimated over the samples (k3: r - 1 - log r, r = p_trainer / p_rollout)."""
    diff = (trainer - rollout).double()
    return {"logprob_max_abs_diff": diff.abs().max().item(), "logprob_mean_abs_diff": diff.abs().mean().item(),
            "probs_diff_max": (trainer.exp() - rollout.exp()).abs().max().item(),
            "kl_k3_mean": (diff.exp() - 1 - diff).mean().item()}


def _parity(args, device: str) -> dict:
    """Rollplex vs transformers in bf16, both measured against an fp32 transformers
    reference computed with TF32 off (transformers' Conv3d would use cuDNN TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(build_model(args, seed=0, init_std=None), d)
        hf_class = family_of(args).transformers_class()
        hf32 = hf_class.from_pretrained(d, dtype=torch.float32).to(device).eval()
        hf16 = hf_class.from_pretrained(d, dtype=torch.bfloat16).to(device).eval()
        ours32 = from_pretrained(d, dtype=torch.float32, device=device)
        ours16 = from_pretrained(d, dtype=torch.bfloat16, device=device)
    seq = _multimodal_prompt(args, device, video_thw=(2, 16, 16))
    kw = dict(pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw,
              pixel_values_videos=seq.pixel_values_videos, video_grid_thw=seq.video_grid_thw)
    if not args.rope_spec.split_video_frames:  # Qwen2.5-VL's video positions follow time
        kw["second_per_grid_ts"] = seq.second_per_grid_ts
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
    from rollplex.engine.cascade import CascadeDecodeAttention, PrefixGroups

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


def _packed_train_groups(args: ModelArgs, cuda: bool) -> list:
    """The training checks' workload (tools/bench_packed_train.py groups_of): 2 text-only groups of a 512-token
    prompt and 8 responses of up to 1,024 tokens (12,582 tokens); on the CPU 2 groups of 16 and 2 x up to 8."""
    import bench_packed_train

    return bench_packed_train.groups_of(*((2, 8, 512, 1024) if cuda else (2, 2, 16, 8)), args.text.vocab_size)


def check_packed_train_3b(device: str) -> dict:
    """A training pass (shared-prefix forward, chunked logprob head, backward) of a 3B-shaped model
    (random weights, bf16) over 2 text-only groups of a 512-token prompt and 8 responses of up to
    1,024 tokens, once per attention backend that works here, on the same weights and batch
    (tools/bench_packed_train.py): time per pass, tokens per second and MFU against the dense bf16
    peak side by side. Each backend's pass must give finite logprobs and gradients (the CPU tests
    hold the backends equal)."""
    import bench_packed_train

    cuda = _cuda(device)
    args = _3b_args(cuda)
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    groups = _packed_train_groups(args, cuda)
    backends = bench_packed_train.working_backends(torch.device(device))
    result = bench_packed_train.timed_passes(model, groups, backends, repeats=3 if cuda else 1)
    result["backends"] = backends
    for name in backends[1:]:
        result[f"{name}_over_torch"] = result[name]["pass_ms"] / result["torch"]["pass_ms"]
    grads = [p.grad for p in model.language_model.parameters() if p.grad is not None]
    grads_finite = bool(grads) and all(bool(g.isfinite().all()) for g in grads)
    criteria = {"timed_every_backend": all(result[name]["pass_ms"] > 0 for name in backends),
                "finite_gradients": grads_finite}
    return {**result, **verdict_of(criteria, "every working backend timed; finite gradients")}


# LoRA's peak must be below full fine-tuning's by this share of the fp32 masters, gradients and AdamW moments that
# full fine-tuning's trained weights take and LoRA's frozen base no longer needs (16 bytes a parameter: 50 GiB at
# 3B). The base's own bf16 copy is an eighth of them and, with activation checkpointing, the activations are small
# beside them, so a right implementation saves about 7/8; a base held in fp32, or given bf16 gradients, saves at
# most 3/4 and fails.
LORA_PEAK_SAVED_SHARE = 0.8


def lora_criteria(result: dict, cuda: bool) -> dict[str, bool]:
    """The criteria of a `bench_packed_train.lora_against_full` comparison. Everywhere: no step skipped (a
    non-finite loss or gradient), AdamW trains the adapters and nothing else, every adapter moved, the frozen
    base is held in the compute dtype and bitwise unchanged. On CUDA also: LoRA's peak is below full
    fine-tuning's by at least LORA_PEAK_SAVED_SHARE of the base's training state, and its step is faster (its
    backward computes no weight gradient of the base)."""
    full, lora = result["full"], result["lora"]
    criteria = {"no_step_skipped": full["skipped_steps"] == lora["skipped_steps"] == 0,
                "trains_only_adapters": lora["trained_params"] == lora["adapter_params"] > 0,
                "adapters_moved": lora["adapters_moved"],
                "base_in_compute_dtype": lora["base_dtypes"] == [str(torch.bfloat16 if cuda else torch.float32)],
                "base_unchanged": lora["base_unchanged"]}
    if cuda:
        criteria["peak_saves_base_state"] = (full["peak_gib"] - lora["peak_gib"]
                                             >= LORA_PEAK_SAVED_SHARE * result["base_state_gib"])
        criteria["lora_step_faster"] = lora["step_s"] < full["step_s"]
    return criteria


def check_lora_train_3b(device: str) -> dict:
    """A trainer's optimizer step with LoRA (rank 16 on every Linear of the language model) against full
    fine-tuning, side by side on packed_train_3b's model shapes and groups (tools/bench_packed_train.py
    lora_against_full): each model as the RL loop loads and parallelizes it for one process (full: fp32
    masters; LoRA: the base in bf16, frozen, outside FSDP; activation checkpointing in both), the Actor's
    update over 2 micro-batches, a warm-up step and 2 timed ones (CPU: 1). Reports each one's step time,
    peak and held memory, the parameters AdamW trains and their state's size, the ratios and the adapters'
    parameter count; `lora_criteria` is the verdict. The first GPU run of the frozen base (issue 29): a base
    left trainable, a gradient or an fp32 copy left on it, adapters no step moves, or a step that writes the
    base fails it."""
    import bench_packed_train

    cuda = _cuda(device)
    args = _3b_args(cuda)
    result = bench_packed_train.lora_against_full(args, _packed_train_groups(args, cuda), torch.device(device),
                                                  rank=16, steps=2 if cuda else 1)
    text = ("no step skipped; AdamW trains only the adapters, each of which moved; the frozen base in the compute "
            "dtype, bitwise unchanged; CUDA: LoRA's peak below full's by >= "
            f"{LORA_PEAK_SAVED_SHARE} of the base's fp32 masters, gradients and moments, and a faster step")
    return {**result, **verdict_of(lora_criteria(result, cuda), text)}


def check_train_attention_backends(device: str) -> dict:
    """One shared-prefix attention layer of 4 groups x 8 responses (512-token prompts, responses of
    up to 1,024 tokens, 16/2 heads, head_dim 128, bf16) per training backend that runs here, on the
    same q/k/v (tools/bench_train_attention.py compare_backends): build, forward and forward+backward
    time and peak. Each backend's output and q/k/v gradients must be within 5e-2 (relative to the
    largest) of the torch path's, and its training pass free of host syncs: on a GPU, the only check of
    FlexAttention's backward (torch has none on CPU)."""
    import bench_train_attention

    cuda = _cuda(device)
    shape = {} if cuda else dict(num_groups=2, n=2, prompt_len=16, max_response=16, q_heads=4)
    result = bench_train_attention.compare_backends(device, torch.bfloat16 if cuda else torch.float32, **shape)
    criteria = {}
    for name, row in result["backends"].items():
        criteria[f"{name}_equals_torch"] = all(err <= 5e-2 for err in row["max_err_vs_torch"].values())
        if cuda:
            criteria[f"{name}_host_sync_free"] = bool(row.get("host_sync_free"))
    return {**result, **verdict_of(criteria, "every backend's output and gradients within 5e-2 of torch's; no host "
                                             "sync in a training pass (CUDA)")}


HBM_BYTES_PER_S = 4.3e12  # read bandwidth measured on the H200 at c98158e (benchmarks/2026-11-30-h200-c98158e)


# decode_layer's agreement: the fused step may differ from the torch step, in the output and in the K/V it wrote,
# by at most DECODE_AGREEMENT_FACTOR times what torch's ops in the same dtype differ from them in float32 (on the
# same inputs), measured the same way (largest difference, and root mean square), plus DECODE_AGREEMENT_FLOOR of the
# float32 result's largest value. Why 4: |fused - torch| <= |fused - fp32| + |torch - fp32|, so two paths that
# round equally well differ by up to twice torch's error, and the worst element may be one where the fused path
# rounded the other way from a value torch rounded well (in the CPU's fp16 run: up to 2.5 times torch's largest
# error, 1.2 times its RMS); 4 leaves room for that, while a wrong rotary (none, or sin's sign flipped) or a dropped
# residual there differs by 250 to 2,900 times torch's error (tests/test_gpu_check_criteria.py): in bf16, whose
# rounding is 8 times fp16's, still 30 times or more. The floor (a fortieth of a bf16 step) only matters where
# torch's error is 0: a float32 run.
DECODE_AGREEMENT_FACTOR = 4.0
DECODE_AGREEMENT_FLOOR = 1e-4


def decode_agreement_criteria(agreement: dict) -> dict[str, bool]:
    """bench_decode_layer.agreement's figures as criteria, per quantity (output, written K/V) and measure (max,
    rms): the fused-vs-torch difference within DECODE_AGREEMENT_FACTOR x torch's own error plus the floor."""
    criteria = {}
    for quantity, figures in agreement.items():
        floor = DECODE_AGREEMENT_FLOOR * figures["fp32_max_abs"]
        for measure in ("max", "rms"):
            bound = DECODE_AGREEMENT_FACTOR * figures["torch_vs_fp32"][measure] + floor
            criteria[f"{quantity}_{measure}"] = figures["fused_vs_torch"][measure] <= bound
    return criteria


def check_decode_layer(device: str) -> dict:
    """A decode step of 4 decoder layers at Qwen2.5-VL 3B's shapes (bf16, weights as the model initialises
    them, hidden states those layers made, contexts of 512 tokens), batch 64 and 256, with the fused layer
    ops (rollplex.ops.fused_decode_triton) and with the torch ops, side by side (tools/bench_decode_layer.py):
    kernel launches per layer (torch.profiler, by kernel name), the step's time as a CUDA graph replay, and
    that time over the HBM floor (the layers' weights and KV read once at HBM_BYTES_PER_S). The fused layer's
    launches, cuBLAS's split-K reductions apart, must stay within the design (`layer_launches`: 12, 13 where
    the paged attention merges split partitions), and its output and written K/V must agree with the torch
    ops' as `decode_agreement_criteria` says. CPU: batch 4, in fp16, in the interpreter."""
    import bench_decode_layer

    cuda = _cuda(device)
    result: dict = {}
    criteria = {}
    for batch in (64, 256) if cuda else (4,):
        figures = bench_decode_layer.bench_decode_layer(batch=batch, layers=4, context=512 if cuda else 32,
                                                        repeats=20 if cuda else 1, device=device)
        floor_ms = _decode_floor_ms(figures, bench_decode_layer.layer_args(torch.device(device)))
        for name in ("fused", "torch"):
            figures[name]["over_floor"] = figures[name]["step_ms"] / floor_ms
        figures["floor_ms"] = floor_ms
        figures["fused_over_torch"] = figures["fused"]["step_ms"] / figures["torch"]["step_ms"]
        result[f"batch_{batch}"] = figures
        criteria[f"batch_{batch}_launches"] = figures["fused"]["within_design"]
        for name, held in decode_agreement_criteria(figures["agreement"]).items():
            criteria[f"batch_{batch}_agree_{name}"] = held
    return {**result, **verdict_of(criteria, "fused layer launches, cuBLAS split-K reductions apart, within the "
                                             "design (12; 13 with the attention's split merge); fused and torch "
                                             "steps' output and written K/V within "
                                             f"{DECODE_AGREEMENT_FACTOR:g} x torch's own error against float32 "
                                             f"(largest and RMS) + {DECODE_AGREEMENT_FLOOR:g} of its largest value")}


def _decode_floor_ms(figures: dict, args) -> float:
    """The step's bytes (the layers' weights, each row's KV context) at HBM_BYTES_PER_S, in ms."""
    t, bytes_per_value = args, 2  # bf16
    attention = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    attention += t.num_attention_heads * t.head_dim * t.hidden_size
    weights = (attention + 3 * t.hidden_size * t.intermediate_size) * bytes_per_value
    kv = figures["batch"] * figures["context"] * 2 * t.num_key_value_heads * t.head_dim * bytes_per_value
    return figures["layers"] * (weights + kv) / HBM_BYTES_PER_S * 1e3


TO_DEVICE_SIZES = (2 << 10, 16 << 10, 128 << 10, 1 << 20)  # bytes of pageable host memory


def check_to_device_latency(device: str) -> dict:
    """rollplex.device.to_device's host time for 2 KB to 1 MB of pageable host memory while the
    stream is busy (about 20 ms of matmuls queued on it), against a blocking `.to()` of the same
    tensor, which waits for the stream. The figures measure what they say only if the stream was
    busy: on CUDA the blocking copy must have waited at least half the busy time. Every copy must
    arrive intact. Whether to_device waited too is reported, not required: the engine and the
    prompt-work slices count on it not waiting, and the driver may stage pageable memory either way."""
    from rollplex.device import to_device

    cuda = _cuda(device)
    busy, busy_ms = _busy_stream(device)
    result: dict = {"busy_ms": busy_ms}
    criteria = {}
    for size in TO_DEVICE_SIZES:
        host = torch.arange(size // 4, dtype=torch.int32)
        times, intact = {}, True
        for name, copy in (("to_device", lambda: to_device(host, device)), ("blocking_to", lambda: host.to(device))):
            busy()
            t0 = time.perf_counter()
            copied = copy()
            times[name] = (time.perf_counter() - t0) * 1e3
            _sync(device)
            intact &= torch.equal(copied.cpu(), host)
        result[f"{size}_bytes"] = {"to_device_ms": times["to_device"], "blocking_to_ms": times["blocking_to"],
                                   "to_device_waited": cuda and times["to_device"] >= busy_ms / 2}
        criteria[f"{size}_bytes_intact"] = intact
        if cuda:
            criteria[f"{size}_bytes_blocking_copy_waited"] = times["blocking_to"] >= busy_ms / 2
    return {**result, **verdict_of(criteria, "every copy intact; on CUDA the blocking copy waited for the busy stream "
                                             "(at least half its busy time)")}


def _busy_stream(device: str) -> tuple[Callable[[], None], float]:
    """A function that queues about 20 ms of matmuls on the current stream and returns at once, and
    their GPU time in ms (on CPU: nothing to queue, 0)."""
    if not _cuda(device):
        return lambda: None, 0.0
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(a, a, out=out)
    end.record()
    end.synchronize()
    count = max(1, round(20 * 10 / start.elapsed_time(end)))

    def busy() -> None:
        for _ in range(count):
            torch.mm(a, a, out=out)

    return busy, start.elapsed_time(end) * count / 10


def check_sampler_timing(device: str) -> dict:
    """rollplex.engine.sampler.sample at a decode step's shape: batch 64 and 256 over the
    151,936-token vocabulary, bf16 logits, without truncation (the engine's call when no request
    uses top-k or top-p) and with top_k 50, top_p 0.9; time per call and peak workspace of each
    backend that runs here, side by side, as tools/bench_sampler.py measures them (CUDA: the median
    of five after a warm-up; the torch path and the one-pass Triton path). Each backend's tokens
    must be in the vocabulary (truncated: among the 50 largest logits), their logprobs those of
    log_softmax within 1e-3, and the tokens the CPU torch path's up to what float32 rounding of the
    weights can move (`sampled_alike`: the rows that differ are reported)."""
    import bench_sampler

    cuda = _cuda(device)
    vocab, batches = (151936, (64, 256)) if cuda else (1000, (4, 8))
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU: what the dry run's model computes in
    samplers = bench_sampler.backends(torch.device(device))
    result: dict = {"vocab": vocab, "logits_dtype": str(dtype), "backends": list(samplers)}
    criteria = {}
    for batch in batches:
        for truncate in (False, True):
            key = f"batch_{batch}_{'truncated' if truncate else 'full'}"
            for name, sample_fn in samplers.items():
                ms, peak_mb = bench_sampler.bench(sample_fn, batch, vocab, torch.device(device), dtype, truncate)
                valid, differing = _samples_validly(sample_fn, batch, vocab, device, dtype, truncate)
                result[f"{key}_{name}"] = {"ms": ms, "peak_mb": peak_mb, "rows_unlike_cpu_torch": differing}
                criteria[f"{key}_{name}_valid"] = valid
            if "triton" in samplers:
                result[f"{key}_triton_over_torch"] = result[f"{key}_triton"]["ms"] / result[f"{key}_torch"]["ms"]
    return {**result, **verdict_of(criteria, "tokens in the vocabulary (truncated: in the top 50); logprobs those of "
                                             "log_softmax within 1e-3; tokens the CPU torch path's or, where they "
                                             "differ, ones the exact draw gives with its running weight sums off by "
                                             f"up to {SAMPLE_BOUNDARY_TOLERANCE:g} of the weight it can reach")}


def _samples_validly(sample_fn: Callable, batch: int, vocab: int, device: str, dtype: torch.dtype,
                     truncate: bool) -> tuple[bool, int]:
    """Whether one sample_fn call on random logits gives valid tokens with log_softmax's logprobs, and
    the tokens of the CPU torch path (the reference of tests/sample_triton_cases.py) up to rounding
    (`sampled_alike`); and how many rows differ from that path's."""
    from rollplex.engine.sampler import SamplingParams, sample, uniforms

    g = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(device, dtype)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50) if truncate else SamplingParams(temperature=1.0)
    u = uniforms(torch.arange(batch), torch.full((batch,), 100)).to(device)
    tokens, logprobs = sample_fn(logits, params.temperature, params.top_p, params.top_k, u, truncate=truncate)
    full = logits.float()
    valid = bool(((tokens >= 0) & (tokens < vocab)).all())
    if truncate:
        valid &= bool((full.gather(-1, tokens[:, None]) >= full.topk(params.top_k).values[:, -1:]).all())
    expected = torch.log_softmax(full, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    reference, _ = sample(logits.cpu(), params.temperature, params.top_p, params.top_k, u.cpu(), truncate=truncate,
                          backend="torch")
    alike, differing = sampled_alike(logits, u, params, tokens, reference)
    return valid and torch.allclose(logprobs.float(), expected, atol=1e-3) and alike, len(differing)


# How far rounding may move a draw. The sampler draws the first token whose running weight sum passes U x the mass
# it draws from (rollplex.engine.sampler). The Triton path's weights exp(x - max) come from tl.exp, on a GPU
# ex2.approx of (x - max) x log2(e), each off by a few 1e-7 of itself; the reference's (the torch path on the
# CPU) from the CPU's exp, off by about 1e-7. So every running sum, and the mass, can be off by a few 1e-7 of the
# mass (the float64 sums themselves round at 1e-16), and U x mass can land on the other side of any running sum
# that close to it: the token drawn can then be any whose running sums in between all lie that close to U x mass
# (a neighbour in the draw order, or one past tokens of next to no weight). With truncation the top-p cut can
# move one token the same way. The tolerance, 1e-5 of the mass, is ten times what rounding can do; a wrong token
# is off by the weight of the tokens between, which the tolerance rejects unless they weigh next to nothing.
SAMPLE_BOUNDARY_TOLERANCE = 1e-5


def sampled_alike(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams, tokens: torch.Tensor,
                  reference: torch.Tensor) -> tuple[bool, list[int]]:
    """Whether a sampler's `tokens` are the `reference` draw's (the CPU torch path's) of the same `logits`
    (B, V) and uniforms `u` (B,) under `params` (a SamplingParams; truncated where it uses top-k or top-p,
    as the engine calls the sampler), up to what float32 rounding of the weights can move; and the rows
    where they differ. A differing row passes when its token is one the draw gives with running sums off
    by at most SAMPLE_BOUNDARY_TOLERANCE of the mass (`_drawable_within_rounding`): the exact draw is
    worked out in float64, so the rule does not depend on which side of a boundary the reference fell.
    A greedy row (temperature 0) takes the argmax, which no rounding moves: any difference fails it."""
    tokens, reference = tokens.cpu(), reference.cpu()
    differing = (tokens != reference).nonzero().flatten().tolist()
    ok = all(_drawable_within_rounding(logits[row].cpu(), float(u[row]), params, int(tokens[row]))
             for row in differing)
    return ok, differing


def _drawable_within_rounding(logits: torch.Tensor, u: float, params: SamplingParams, token: int) -> bool:
    """Whether inverse transform sampling of one row's `logits` at `u` gives `token` when every running
    weight sum may be off by SAMPLE_BOUNDARY_TOLERANCE of the mass the draw can reach (the top-k's with
    truncation, else the row's): `token` is kept under a cut rounding may give, and every running sum
    between it and the exact draw there lies within that distance of U x the kept mass."""
    if params.temperature == 0:
        return False
    x = logits.double()
    truncate = params.top_p < 1 or params.top_k > 0
    # The draw order: decreasing logit, ties by index, when truncating; else the vocabulary's.
    order = torch.sort(x, descending=True, stable=True).indices if truncate else torch.arange(x.numel())
    weights = ((x[order] - x.max()) / params.temperature).exp()
    cdf = weights.cumsum(0)
    top_k = x.numel() if params.top_k <= 0 else min(params.top_k, x.numel())
    slack = SAMPLE_BOUNDARY_TOLERANCE * float(cdf[top_k - 1] if truncate else cdf[-1])
    position = int((order == token).nonzero()[0, 0])
    if weights[position] == 0:  # a logit of -inf: never drawn, whatever the rounding
        return False
    for cut in _cuts_within_rounding(cdf, params.top_p, top_k, slack) if truncate else [x.numel() - 1]:
        point = min(u, 1 - 2**-53) * float(cdf[cut])
        drawn = int(torch.searchsorted(cdf, torch.tensor([point], dtype=cdf.dtype), right=True).clamp(max=cut))
        between = cdf[min(position, drawn):max(position, drawn)]
        if position <= cut and bool(((between - point).abs() <= slack).all()):
            return True
    return False


def _cuts_within_rounding(cdf: torch.Tensor, top_p: float, top_k: int, slack: float) -> list[int]:
    """The last kept positions of a truncated draw (cdf in decreasing-logit order) that running sums off
    by `slack` can give: the exact one (the first whose sum reaches top_p x the top-k's), and its neighbour
    where the sum between them lies within `slack` of that threshold."""
    threshold = top_p * float(cdf[top_k - 1])
    cut = min(int(torch.searchsorted(cdf, torch.tensor([threshold], dtype=cdf.dtype))), top_k - 1)
    cuts = [cut]
    if cut + 1 < top_k and float(cdf[cut]) - threshold <= slack:
        cuts.append(cut + 1)
    if cut > 0 and threshold - float(cdf[cut - 1]) <= slack:
        cuts.append(cut - 1)
    return cuts


def check_logprob_head(device: str) -> dict:
    """The logprob head's forward and backward at one micro-batch's shape, chunked (rollplex.train.logprob_head)
    beside the whole batch's logits at once: 4,096 tokens, hidden 2048, the 151,936-token vocabulary, bf16, as
    tools/bench_logprob_head.py measures them. The chunked head must peak at most an eighth of the whole
    batch's and give its logprobs within 1e-2 (bf16 matmuls of other shapes round otherwise)."""
    import bench_logprob_head

    cuda = _cuda(device)
    tokens, hidden_size, vocab, chunk = (4096, 2048, 151936, None) if cuda else (256, 32, 1000, 14)
    dtype = torch.bfloat16 if cuda else torch.float32
    head, hidden, targets = bench_logprob_head.inputs(tokens, hidden_size, vocab, torch.device(device), dtype)
    whole = bench_logprob_head.run_head(head, hidden, targets, chunked=False)
    chunked = bench_logprob_head.run_head(head, hidden, targets, chunked=True, chunk_tokens=chunk)
    result = {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype),
              **{f"{name}_{k}": v for name, r in (("whole", whole), ("chunked", chunked))
                 for k, v in (("ms", r.seconds * 1e3), ("peak_mb", r.peak_bytes / 2**20))},
              "peak_ratio": chunked.peak_bytes / whole.peak_bytes, "time_ratio": chunked.seconds / whole.seconds}
    criteria = {"peak_under_an_eighth": chunked.peak_bytes <= whole.peak_bytes / 8,
                "same_logprobs": bool((chunked.logprobs - whole.logprobs).abs().max() <= 1e-2)}
    return {**result, **verdict_of(criteria, "chunked peak <= whole / 8; logprobs within 1e-2")}


# ---------------------------------------------------------------------- mixture of experts

# moe's grouped GEMM comparison: torch._grouped_mm against the per-expert loop on the same bf16 inputs, the largest
# |difference| over the loop's largest |value|, for the output and both gradients. Both accumulate in fp32 and round
# once to bf16 (2^-8 relative at most, 0.004), so a right kernel is within one bf16 step of the largest value; a
# wrong offset or layout (rows sent to a neighbouring expert, a transposed weight) is off by O(1).
MOE_GEMM_TOLERANCE = 1e-2
# moe's training step: the replayed step's peak allocated memory against the live step's (the same tokens, the same
# number of token-expert rows, a route tensor of a few kB more).
MOE_REPLAY_PEAK_FACTOR = 1.05


def check_moe(device: str) -> dict:
    """The sparse MoE block (rollplex.models.moe) on the GPU, in three parts, each with a verdict of its own
    (on the CPU each at its smallest: a tiny stand-in for the 35B-A3B shapes):
    - `grouped_gemm` (`_moe_grouped_gemm`): torch._grouped_mm (rollplex.ops.grouped_mm "grouped") against the
      per-expert loop ("loop", the CPU reference) on the same bf16 inputs at Qwen3.5-35B-A3B's expert shapes
      (256 experts, hidden 2048, width 512, top-8 routing of 4,096 tokens, every eighth expert given no row):
      both projections' outputs and input and weight gradients within MOE_GEMM_TOLERANCE, the empty experts'
      weight gradients exactly zero; each backend's forward and forward + backward timed side by side;
    - `train_step` (`_moe_train_step`): forward, backward and an AdamW step of 2 decoder layers of the
      qwen3.5-35b-a3b preset (a Gated DeltaNet and a full-attention layer, 256 experts each, the hub vocabulary,
      a tiny tower) in bf16 over 4,096 tokens: a live step that records its routes, another live step, then one
      that replays the first's routes (Routing with replay): finite losses and gradients, the replayed routes
      exactly the recorded ones where the live router (moved by two steps) chose otherwise, the router's
      gradient alive under replay; reports each step's seconds and peak allocated memory;
    - `engine_routes` (`_moe_engine_routes`): greedy decode of a tiny Qwen3-VL-MoE with record_routes, CUDA
      graphs against eager decode with the same layer ops (on the CPU: the graph stand-in): the same tokens and
      the same recorded prompt and response routes, every fed token recorded; each graph's routes after a
      replay equal an eager decode's on the same static buffers; no host sync inside a graph-replayed decode
      step (CUDA's sync debug mode; none is counted on the CPU).
    A part that raises is reported with its error and the others still run; the check then ends its process,
    as a raising check does (a CUDA error can leave the context unusable)."""
    parts = {"grouped_gemm": _moe_grouped_gemm, "train_step": _moe_train_step, "engine_routes": _moe_engine_routes}
    result: dict = {}
    for name, part in parts.items():
        t0 = time.perf_counter()
        try:
            result[name] = part(device)
        except Exception as e:
            result[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                            "part_traceback": traceback.format_exc()[-3000:]}
        result[name]["seconds"] = round(time.perf_counter() - t0, 2)  # what the check's estimate is judged by
        if _cuda(device):
            with contextlib.suppress(RuntimeError):  # after a CUDA error the next part reports its own
                torch.cuda.empty_cache()
    criteria = {name: result[name]["ok"] is True for name in parts}
    verdict = verdict_of(criteria, "every part's verdict ok (each part's own criteria: its 'failed' and 'criterion')")
    raised = [name for name in parts if "part_traceback" in result[name]]
    if raised:  # run_checks_here ends the process after a result with a traceback
        verdict["traceback"] = "\n".join(f"{name}: {result[name]['part_traceback']}" for name in raised)
    return {**result, **verdict}


def _moe_routing_case(device: str, tokens: int, experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routes of `tokens` tokens over `experts` experts, skewed (the later experts get more rows) and
    with every eighth expert (0, 8, ...) chosen by none; their token-expert pairs sorted by expert, as
    Experts sorts them: each pair's token, and the experts' cumulative row counts (`sort_by_expert`)."""
    from rollplex.models.moe import sort_by_expert

    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, experts, generator=gen, device=device) + torch.linspace(0, 2, experts, device=device)
    logits[:, ::8] = -math.inf
    _, token_of, ends = sort_by_expert(logits.topk(top_k, dim=-1).indices, experts)
    return token_of, ends


def _seconds_per_call(fn: Callable[[], object], reps: int, device: str) -> float:
    """fn's mean wall time over `reps` calls after one warm-up, the device synchronised around them."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _moe_grouped_gemm(device: str) -> dict:
    """`check_moe`'s grouped GEMM part: per projection of an expert's SwiGLU (gate_up: hidden -> 2 x width;
    down: width -> hidden), rows sorted by expert as `_moe_routing_case` routes them, the "grouped" backend's
    output and gradients (of the input and the weights, for a random output gradient) against the "loop"
    backend's on the same bf16 tensors, and both timed."""
    from rollplex.ops.grouped_mm import grouped_mm

    cuda = _cuda(device)
    tokens, experts, top_k, hidden, width, reps = (4096, 256, 8, 2048, 512, 3) if cuda else (64, 16, 4, 64, 32, 1)
    token_of, ends = _moe_routing_case(device, tokens, experts, top_k)
    rows = len(token_of)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    empty = (counts == 0).nonzero().flatten()
    gen = torch.Generator(device=device).manual_seed(1)
    result: dict = {"tokens": tokens, "experts": experts, "top_k": top_k, "rows": rows, "dtype": "torch.bfloat16",
                    "empty_experts": len(empty), "rows_per_used_expert": {
                        "min": int(counts[counts > 0].min()), "max": int(counts.max())}}
    criteria: dict[str, bool] = {"some_experts_empty": len(empty) > 0}
    for name, (n_in, n_out) in {"gate_up": (hidden, 2 * width), "down": (width, hidden)}.items():
        x = torch.randn(rows, n_in, generator=gen, device=device).to(torch.bfloat16)
        w = (torch.randn(experts, n_in, n_out, generator=gen, device=device) * n_in**-0.5).to(torch.bfloat16)
        g = torch.randn(rows, n_out, generator=gen, device=device).to(torch.bfloat16)

        def forward(backend: str) -> torch.Tensor:
            with torch.no_grad():
                return grouped_mm(x, w, ends, backend)

        def forward_backward(backend: str) -> tuple[torch.Tensor, ...]:
            xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
            out = grouped_mm(xl, wl, ends, backend)
            return (out.detach(), *torch.autograd.grad(out, (xl, wl), g))

        got, want = forward_backward("grouped"), forward_backward("loop")
        errors = {key: ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                  for key, a, b in zip(("out", "grad_input", "grad_weight"), got, want)}
        timings = {f"{backend}_{kind}_ms": 1e3 * _seconds_per_call(functools.partial(fn, backend), reps, device)
                   for backend in ("grouped", "loop") for kind, fn in (("forward", forward),
                                                                       ("forward_backward", forward_backward))}
        result[name] = {"in": n_in, "out": n_out, "max_rel_err": errors, **timings,
                        "loop_over_grouped_forward_backward": timings["loop_forward_backward_ms"]
                        / timings["grouped_forward_backward_ms"]}
        criteria.update({f"{name}_{key}_within_bound": error <= MOE_GEMM_TOLERANCE for key, error in errors.items()})
        criteria[f"{name}_empty_experts_zero_grad"] = bool((got[2][empty] == 0).all())
        if cuda:  # on the CPU the loop is the default backend and _grouped_mm a fallback: no race there
            criteria[f"{name}_grouped_faster"] = timings["grouped_forward_backward_ms"] < timings[
                "loop_forward_backward_ms"]
    text = (f"grouped within {MOE_GEMM_TOLERANCE:g} (relative to the largest value) of the loop: each projection's "
            "output, input and weight gradients; empty experts' weight gradients zero; CUDA: grouped forward + "
            "backward faster than the loop")
    return {**result, **verdict_of(criteria, text)}


def _moe_train_args(cuda: bool):
    """2 decoder layers of the qwen3.5-35b-a3b preset, a Gated DeltaNet and a full-attention one (its two layer
    kinds), with a tiny tower (text-only batches never run it); on the CPU the family's tiny model, both kinds."""
    from rollplex.models.qwen3_5.args import FULL_ATTENTION, LINEAR_ATTENTION
    from rollplex.models.qwen3_5_moe import PRESETS, tiny_args

    kinds = [LINEAR_ATTENTION, FULL_ATTENTION]
    tiny = tiny_args(layer_types=tuple(kinds))
    if not cuda:
        return tiny
    args = PRESETS["qwen3.5-35b-a3b"]
    return dataclasses.replace(args, vision=dataclasses.replace(tiny.vision, out_hidden_size=args.text.hidden_size),
                               text=dataclasses.replace(args.text, num_hidden_layers=len(kinds), layer_types=kinds))


def _moe_train_step(device: str) -> dict:
    """`check_moe`'s training part: 4 sequences of 1,024 random text tokens (CPU: 2 of 16) through
    `_moe_train_args`' model (bf16 weights, fused AdamW at lr 1e-3 on them; CPU: fp32), three steps (forward,
    next-token logprob loss by the chunked head plus the routers' auxiliary loss, backward, AdamW step): live
    recording its routes, live, then replaying the first step's routes. Reports each step's seconds (forward +
    backward and the optimizer step; the first pays the compiles and the optimizer state's allocation) and peak
    allocated memory, the weights' and the optimizer state's GiB, and how many replayed routes the live router,
    two steps on, agreed with."""
    from rollplex.models.moe import Routing
    from rollplex.models.qwen3_5_moe import FAMILY
    from rollplex.train.logprob_head import token_logprobs

    cuda = _cuda(device)
    args = _moe_train_args(cuda)
    moe = args.text.moe
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0, family=FAMILY)
    model.set_attn_backend("auto")
    model.train()
    sequences, length = (4, 1024) if cuda else (2, 16)
    below = min(args.image_token_id, args.text.vocab_size)  # text ids, clear of the vision ones
    prompts = [_random_text_prompt(length, below, seed=i, device=device) for i in range(sequences)]
    batch = pack_sequences(args, prompts)
    fed = torch.tensor([i for s in range(sequences) for i in range(s * length, (s + 1) * length - 1)], device=device)
    targets = batch.input_ids[fed + 1]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # the Actor's
    routers = [layer.mlp.gate.weight for layer in model.language_model.layers]

    def step(routing: Routing) -> dict:
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        hidden = model.forward_packed(batch, routing=routing)
        logprobs, _ = token_logprobs(model, hidden[fed], targets)
        aux = routing.aux_loss(moe.num_experts)
        loss = -logprobs.mean() + moe.router_aux_loss_coef * aux
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        grads_finite = all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
        router_grad = min(float(w.grad.abs().sum()) for w in routers)
        t2 = time.perf_counter()
        optimizer.step()
        _sync(device)
        t3 = time.perf_counter()
        return {"seconds": t1 - t0 + t3 - t2, "forward_backward_s": t1 - t0, "optimizer_s": t3 - t2,
                "loss": loss.item(), "aux_loss": aux.item(), "grads_finite": grads_finite,
                "router_grad_abs_sum_min": router_grad,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}

    recording = Routing()
    steps = {"live_recording": step(recording)}
    recorded = recording.routes(args.text.num_hidden_layers)
    steps["live"] = step(Routing())
    replay = Routing(replay=recorded)
    steps["replay"] = step(replay)
    metrics = {k: float(v) for k, v in replay.metrics().items()}
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    result = {"layers": args.text.layer_types, "hidden": args.text.hidden_size, "experts": moe.num_experts,
              "top_k": moe.num_experts_per_tok, "vocab": args.text.vocab_size, "tokens": int(batch.input_ids.numel()),
              "dtype": str(next(model.parameters()).dtype), "attn_backend": model.attn_backend,
              "weights_gib": weights / 2**30, "optimizer_state_gib": state / 2**30, **steps,
              "replay_tokens_per_s": int(batch.input_ids.numel()) / steps["replay"]["seconds"],
              "replayed_routes_live_agreed_share": metrics["agreed"] / metrics["replayed"],
              "note": "random weights; timing only"}
    criteria = {"losses_finite": all(math.isfinite(s["loss"]) for s in steps.values()),
                "gradients_finite": all(s["grads_finite"] for s in steps.values()),
                "replayed_routes_equal_recorded": torch.equal(replay.routes(args.text.num_hidden_layers), recorded),
                "every_token_replayed": metrics["replayed"] == recorded.shape[0] * len(replay.layers),
                # Else the equality above would hold for a replay that routes live.
                "live_router_disagreed_somewhere": metrics["agreed"] < metrics["replayed"],
                "router_gradient_under_replay": steps["replay"]["router_grad_abs_sum_min"] > 0}
    if cuda:
        criteria["replay_peak_within_live"] = (steps["replay"]["peak_gib"]
                                               <= MOE_REPLAY_PEAK_FACTOR * steps["live"]["peak_gib"])
    text = ("finite losses and gradients in every step; the replayed step routed exactly the recorded routes, every "
            "token of every layer, although the live router disagreed with some; the routers' gradient nonzero under "
            f"replay; CUDA: the replayed step's peak within {MOE_REPLAY_PEAK_FACTOR:g} x the live step's")
    return {**result, **verdict_of(criteria, text)}


def _moe_engine_routes(device: str) -> dict:
    """`check_moe`'s engine part: a tiny Qwen3-VL-MoE (2 sparse layers, 8 experts, top-2; weights as
    build_model(init_std=None) draws them; bf16 on CUDA, where the grouped GEMM needs it, fp32 on the CPU), an
    image + video prompt and a text prompt, 2 greedy samples each (4 rows: a graph bucket exactly, so the graph's
    GEMMs have the eager ones' shapes), decoded with record_routes by an eager engine and a CUDA-graph one with
    the same layer ops (on CUDA the fused ones). The graphed engine generates twice; the second generation
    captures nothing, and its decode steps, every one a graph replay, are counted for host syncs."""
    from rollplex.engine import Request
    from rollplex.models.moe import UNRECORDED
    from rollplex.models.qwen3_vl_moe import FAMILY, tiny_args

    cuda = _cuda(device)
    args = tiny_args()
    moe, layers = args.text.moe, args.text.num_hidden_layers
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0, init_std=None,
                        family=FAMILY)
    model.set_attn_backend("auto")
    requests = [Request(_multimodal_prompt(args, device, image_hw=(8, 12), video_thw=(2, 8, 8)), n=2),
                Request(_random_text_prompt(40, args.image_token_id, seed=1, device=device), n=2)]
    config = dict(max_num_seqs=4, max_model_len=256, num_blocks=64, record_routes=True)
    eager, graphed = _engine(model, enforce_eager=True, **config), _engine(model, **config)
    want = eager.generate(requests, _greedy_params(cuda))
    got = graphed.generate(requests, _greedy_params(cuda))
    captures = graphed.runner.captures
    syncs = _graph_replay_syncs(graphed, requests, cuda)
    samples = [(a, b) for ga, gb in zip(got, want) for a, b in zip(ga.samples, gb.samples)]
    recorded = [s.routes[:-1] for s, _ in samples] + [s.prompt_routes for s, _ in samples]
    criteria = {"same_layer_ops": graphed.runner.layer_ops is eager.runner.layer_ops,
                "graphs_captured": captures > 0 and syncs["captures"] == 0,
                "tokens_equal_eager": all(a.token_ids == b.token_ids for a, b in samples),
                "prompt_routes_equal_eager": all(torch.equal(a.prompt_routes, b.prompt_routes) for a, b in samples),
                "response_routes_equal_eager": all(torch.equal(a.routes, b.routes) for a, b in samples),
                "every_fed_token_recorded": all(bool(((r >= 0) & (r < moe.num_experts)).all()) for r in recorded),
                "last_token_unrecorded": all(bool((s.routes[-1] == UNRECORDED).all()) for s, _ in samples),
                "graph_routes_equal_eager_same_buffers": _graph_routes_against_eager(graphed, layers),
                "no_host_sync_in_graph_replayed_decode": syncs["host_syncs"] == 0}
    result = {"layers": layers, "experts": moe.num_experts, "top_k": moe.num_experts_per_tok,
              "dtype": str(next(model.parameters()).dtype),
              "layer_ops": "torch" if graphed.runner.layer_ops is None else "fused",
              "rows": sum(r.n for r in requests), "response_tokens": [len(a.token_ids) for a, _ in samples],
              "captures": captures, "capture_seconds": graphed.runner.capture_seconds, "graph_replay": syncs,
              "routes_shape": list(samples[0][0].routes.shape)}
    text = ("graphed decode with record_routes gives eager decode's tokens and prompt and response routes, every fed "
            "token recorded, the last unrecorded; each graph's routes equal eager's on the same static buffers; no "
            "host sync inside a graph-replayed decode step (counted on CUDA)")
    return {**result, **verdict_of(criteria, text)}


class _ScriptedEpisodes:
    """multi_turn's episodes: a turn ends at any token id in `turn_end_ids`; after its first two turns an episode gets
    `observation` (an image and a video); it ends after its third turn."""

    def __init__(self, observation: Prompt, rope_spec, turn_end_ids: frozenset[int]):
        self.observation, self.rope_spec, self.turn_end_ids = observation, rope_spec, turn_end_ids
        self.turns: dict = {}
        self.ready: list = []

    def end_turn(self, key, response: list[int]) -> str | None:
        from rollplex.models.inputs import Observation

        turn = self.turns[key] = self.turns.get(key, 0) + 1
        if turn > 2:
            return "stop"
        self.ready.append((key, Observation.of(self.observation, len(response), self.rope_spec)))
        return None

    def poll(self, wait: bool) -> list:
        ready, self.ready = self.ready, []
        return ready

    def finish(self, key, sample):
        from rollplex.models.inputs import EpisodeLog

        return EpisodeLog(turns=self.turns.get(key, 1))


def check_multi_turn(device: str) -> dict:
    """Multi-turn episodes in the engine (issue 41; rollplex.engine.episodes): a tiny Qwen2.5-VL (bf16 on CUDA), two
    prompts of 2 greedy samples, each turn ending at a token id in a fixed set, each episode given an observation
    with an image and a video after its first two turns. An eager engine that never runs ahead against a CUDA-graph
    one that does (the observations' images encoded on its low-priority vision stream while decode goes on): the
    same tokens, logprobs within ENGINE_LOGPROB_TOLERANCE; every sample continued with an observation; the trainer's logprobs of
    the whole trajectories (pack_groups' shared-prefix layout, the observations' images through the tower) against
    the graphed engine's at the sampled tokens, reported (`trainer_probs_max_abs_diff`); each generation's seconds."""
    from rollplex.engine import Request
    from rollplex.models.packing import pack_groups
    from rollplex.train.actor import response_logprobs

    cuda = _cuda(device)
    args = _tiny_args()
    model = build_model(args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0, init_std=None)
    observation = _multimodal_prompt(args, device, image_hw=(4, 6), video_thw=(2, 4, 4), seed=3)
    observation.input_ids = observation.input_ids[:-40]  # its image and video, and a little text
    vision = {args.image_token_id, args.video_token_id, args.vision_start_token_id, args.vision_end_token_id}
    turn_ends = frozenset(i for i in range(0, args.text.vocab_size, 7) if i not in vision)
    requests = [Request(_multimodal_prompt(args, device, image_hw=(8, 12), video_thw=(2, 8, 8)), n=2, seed=1),
                Request(Prompt(torch.arange(5, 45, device=device)),
                        n=2, seed=2)]
    params = _greedy_params(cuda)
    params = dataclasses.replace(params, max_tokens=160 if cuda else 80)
    config = dict(max_num_seqs=4, max_model_len=512, num_blocks=160)
    runs = {}
    for name, engine in (("eager", _engine(model, enforce_eager=True, run_ahead=False, **config)),
                         ("graphed", _engine(model, **config))):
        _sync(device)
        start = time.perf_counter()
        groups = engine.generate(requests, params, episodes=_ScriptedEpisodes(observation, args.rope_spec, turn_ends))
        _sync(device)
        runs[name] = groups, time.perf_counter() - start, engine
    (want, eager_s, _), (got, graphed_s, graphed) = runs["eager"], runs["graphed"]
    samples = [(a, b) for ga, gb in zip(got, want) for a, b in zip(ga.samples, gb.samples)]
    logprob_diff = max((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max().item() for a, b in samples)
    with torch.no_grad():
        trainer, _ = response_logprobs(model, pack_groups(args, got, share_prefix=True))
    rollout = torch.tensor([lp for g in got for s in g.samples for lp in s.logprobs], device=trainer.device)
    sampled = torch.cat([s.sampled_mask() for g in got for s in g.samples]).to(trainer.device)
    trainer_diff = (trainer.float().exp() - rollout.exp()).abs()[sampled].max().item()
    criteria = {"tokens_equal_eager": all(a.token_ids == b.token_ids for a, b in samples),
                "logprobs_equal_eager": logprob_diff <= ENGINE_LOGPROB_TOLERANCE,
                "observations_appended": all(a.observations for a, _ in samples),
                "graphs_captured": graphed.runner.captures > 0,
                "vision_stream_on_cuda": (graphed.runner.vision_stream is not None) == cuda,
                "trainer_probs_finite": math.isfinite(trainer_diff)}
    result = {"dtype": str(next(model.parameters()).dtype), "rows": sum(r.n for r in requests),
              "response_tokens": [len(a.token_ids) for a, _ in samples],
              "observation_tokens": [sum(len(o) for o in a.observations) for a, _ in samples],
              "prefill_tokens": {name: run[2].stats["prefill_tokens"] for name, run in runs.items()},
              "generate_seconds": {"eager": round(eager_s, 3), "graphed": round(graphed_s, 3)},
              "engine_logprob_max_abs_diff": logprob_diff, "trainer_probs_max_abs_diff": trainer_diff}
    text = ("graphed engine (run ahead, observation images on the vision stream) gives the eager engine's tokens and "
            "logprobs; every sample continued with an observation; the trainer's probabilities are reported")
    return {**result, **verdict_of(criteria, text)}


def _greedy_params(cuda: bool) -> SamplingParams:
    from rollplex.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=16 if cuda else 4, ignore_eos=True)


def _graph_replay_syncs(engine, requests: list, cuda: bool) -> dict:
    """The engine's generation of `requests` again, its graphs captured: the decode steps (runner.decode) and the
    host syncs inside them (CUDA's sync debug mode), and the captures the generation made."""
    runner = engine.runner
    decode, counts = runner.decode, {"decode_steps": 0, "host_syncs": 0}

    def counted(*a, **kw):
        with _counting_host_syncs(cuda) as caught:
            out = decode(*a, **kw)
        counts["decode_steps"] += 1
        counts["host_syncs"] += sum("synchroniz" in str(w.message) for w in caught)
        return out

    before = runner.captures
    runner.decode = counted
    try:
        engine.generate(requests, _greedy_params(cuda))
    finally:
        del runner.decode  # the class's method again
    return {**counts, "captures": runner.captures - before}


def _graph_routes_against_eager(engine, layers: int) -> bool:
    """Per captured bucket: the graph replayed, its routes (the graph's Routing, a static output) against those
    of an eager decode on the same static buffers: whether they are equal for every bucket."""
    from rollplex.models.moe import Routing

    runner = engine.runner
    equal = bool(runner.graphs)
    with torch.no_grad():
        for bucket, graph in runner.graphs.items():
            s = runner.static
            graph.replay()
            replayed = runner.graph_routing[bucket].routes(layers).clone()
            routing = Routing()
            runner._decode_eager(*(s[name][:bucket] for name in ("ids", "positions", "slots", "tables", "lens",
                                                                   "state_rows")), routing=routing)
            equal = equal and torch.equal(replayed, routing.routes(layers))
    return equal


def check_gpu_tests(device: str) -> dict:
    """The kernel case files (tests/*_triton_cases.py: paged decode, cascade decode, the sampler, the fused
    decode layer) compiled on the GPU, and the test files with CUDA cases, which skip them on a CPU: none
    may be skipped there. The CPU dry run runs one case of each kernel file, in the interpreter (the test
    files that run them, e.g. tests/test_paged_decode_triton.py, run them all).
    pytest runs in a session of its own, killed with its whole process group when this check's time limit
    or the run's budget ends, whichever is first (10 s before, so that this process reports it)."""
    files = ["tests/paged_decode_triton_cases.py", "tests/cascade_decode_triton_cases.py",
             "tests/sample_triton_cases.py", "tests/fused_decode_triton_cases.py"]
    if _cuda(device):
        files += ["tests/test_cuda_graphs.py", "tests/test_sampler.py",
                  "tests/test_nonfinite.py::test_a_weight_gone_bad_under_a_decode_graph_is_caught_and_located"]
    else:
        files = [f"{files[0]}::test_odd_head_dim_and_group", f"{files[1]}::test_a_group_cut_leaves_a_group_of_one",
                 f"{files[2]}::test_empty_batch", f"{files[3]}::test_rotary_store"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    timeout = max(1.0, min(CHECKS["gpu_tests"].limit_s, DEADLINE - time.time()) - 10)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                             *(str(REPO / f) for f in files)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_group(proc)
        output, _ = proc.communicate()
        return {"ok": False, "timed_out": f"pytest ran past {timeout:.0f} s; its process group was killed",
                "files": files, "output_tail": output[-1500:]}
    summary = (output.strip().splitlines() or [""])[-1]
    criteria = {"passed": proc.returncode == 0, "none_skipped": not (_cuda(device) and "skipped" in summary)}
    result = verdict_of(criteria, "every case passes, none skipped on CUDA")
    return {**result, "files": files, "summary": summary, "output_tail": "" if result["ok"] else output[-1500:]}


# ---------------------------------------------------------------------- the checks, in the order they run


@dataclass(frozen=True)
class Check:
    """One check of the device command: its function of the device, and how the driver schedules it."""

    run: Callable[[str], dict]
    estimate_s: float  # on one H200 (docs/GPU.md), compiles included, its process's start-up left out
    process: str  # consecutive checks of one process key share a child process (and its imports)
    optional: bool = False  # started only when the budget left covers the estimate; skipped is no failure
    compile_s: float = 0  # of the estimate, Triton's and inductor's compiles with an empty cache

    @property
    def limit_s(self) -> float:
        """Past this, the check's process group is killed."""
        return 2 * self.estimate_s + 30


PROCESS_START_S = 16  # a child's imports (torch, CUDA, transformers) on the device machine at c98158e
# In the order they run: what each proves per second. The engine's correctness first (graphs against the torch
# ops, then the 3B engine and the streamed step), then the kernels' and the models' correctness (the GPU test
# cases, which compile most of the kernels, early: a cut run must not always lose them), the schedule
# benchmark, and the optional checks, each started only when the budget left covers it: Qwen3.5 (fla's kernels,
# its engine, its logprob gap), MoE (the grouped GEMM, a 35B-A3B layer slice's training step with routing replay,
# route recording under graphs; after qwen3_5, whose fla kernels its DeltaNet layer then finds compiled), the
# attention backends' training passes (FlexAttention's backward), the 3B
# training timings, LoRA's step, the smaller measurements, then the two benches that read bench_schedules'
# report. Estimates include the compiles a check pays for when nothing is in Triton's cache (`compile_s`;
# tools/compile_kernels.py times the hand-written kernels: at most 9 s each, the truncated sampler draw, 2 s a
# decode kernel, on a 2-core x86 machine). qwen3_5's is a guess, not yet run on a GPU: fla autotunes its chunked
# kernels' forward and backward (a few dozen compiles) for each head shape and dtype it meets (three here). moe's
# is a guess too (docs/GPU.md): one of those fla shapes, the tiny MoE engine's fused kernels, ~15 s of work.
CHECKS = {
    "engine_cuda_graphs": Check(check_engine_cuda_graphs, 20, "engine", compile_s=10),
    "engine_throughput_3b": Check(check_engine_throughput_3b, 42, "engine", compile_s=12),
    "overlap_stream_step": Check(check_overlap_stream_step, 28, "engine", compile_s=3),
    "gpu_tests": Check(check_gpu_tests, 140, "rest", compile_s=70),
    "decode_layer": Check(check_decode_layer, 20, "rest", compile_s=5),
    "paged_decode_triton": Check(check_paged_decode_triton, 5, "rest", compile_s=1),
    "cascade_decode_triton": Check(check_cascade_decode_triton, 8, "rest", compile_s=2),
    "sampler_timing": Check(check_sampler_timing, 5, "rest", compile_s=2),
    "model_parity_bf16": Check(check_model_parity_bf16, 10, "rest"),
    "qwen3_vl": Check(check_qwen3_vl, 15, "rest", compile_s=3),
    # A process of their own: the memory plan reads free device memory, which no other check's leftovers may hold.
    "bench_schedules": Check(check_bench_schedules, 130, "bench", compile_s=10),
    "qwen3_5": Check(check_qwen3_5, 50, "rest", optional=True, compile_s=35),
    "moe": Check(check_moe, 60, "rest", optional=True, compile_s=30),
    "multi_turn": Check(check_multi_turn, 15, "rest", optional=True, compile_s=5),
    "train_attention_backends": Check(check_train_attention_backends, 60, "rest", optional=True, compile_s=40),
    "packed_train_3b": Check(check_packed_train_3b, 50, "rest", optional=True, compile_s=10),
    "lora_train_3b": Check(check_lora_train_3b, 10, "rest", optional=True),
    "logprob_head": Check(check_logprob_head, 5, "rest", optional=True),
    "to_device_latency": Check(check_to_device_latency, 3, "rest", optional=True),
    "forward_timing_3b": Check(check_forward_timing, 6, "rest", optional=True),
    "bench_small_prefix_budget": Check(check_bench_small_prefix_budget, 65, "bench", optional=True),
    "bench_serial_naive": Check(check_bench_serial_naive, 110, "serial-naive", optional=True),
}
DEFAULT_BUDGET_S = 540.0
SPARE_S = 60  # what the required checks' estimates leave of the default budget, at least


def planned_seconds(names: list[str]) -> float:
    """The estimates of `names`, run in this order, with a process start for each run of one process key."""
    starts = sum(1 for i, n in enumerate(names) if i == 0 or CHECKS[n].process != CHECKS[names[i - 1]].process)
    return sum(CHECKS[n].estimate_s for n in names) + starts * PROCESS_START_S


# ---------------------------------------------------------------------- the driver


def budget_refusal(name: str, seconds_left: float, start_s: float = 0.0) -> dict | None:
    """The result of a check the budget does not let start (None: it may start): a required one is
    not run (a failure) once under 5 s are left, an optional one is skipped when its estimate and
    `start_s` (a new process's start-up) are more than what is left."""
    check = CHECKS[name]
    if check.optional and seconds_left < check.estimate_s + start_s:
        return {"ok": None, "skipped": f"optional, not started: {seconds_left:.0f} s of the budget left, "
                                       f"its estimate is {check.estimate_s:.0f} s"}
    if seconds_left < 5:
        return {"ok": False, "error": "not run: the time budget was spent"}
    return None


class TritonCompiles:
    """What one check's Triton kernels cost to build: those compiled, with their seconds, and those found
    compiled in Triton's cache (tools/device_run.sh hands it the kernels compiled offline): the figures the
    estimates' compile_s and the shipped cache are judged by. Kernels inductor compiles in worker processes
    are not seen; with TRITON_INTERPRET nothing compiles."""

    def __init__(self):
        self.compiled, self.from_cache, self.compile_s = 0, 0, 0.0

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.from_cache += 1
        else:
            self.compiled += 1
            self.compile_s += times.total / 1e6  # microseconds

    @contextlib.contextmanager
    def listening(self):
        try:
            from triton import knobs
        except ImportError:
            yield
            return
        saved, knobs.compilation.listener = knobs.compilation.listener, self
        try:
            yield
        finally:
            knobs.compilation.listener = saved

    def figures(self) -> dict:
        return {"compiled": self.compiled, "from_cache": self.from_cache, "compile_s": round(self.compile_s, 2)}


def run_one(name: str, device: str) -> dict:
    """Run one check in this process; a check that raises is recorded as failed, with its traceback."""
    t0 = time.perf_counter()
    compiles = TritonCompiles()
    try:
        with compiles.listening():
            result = CHECKS[name].run(device)
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["triton_kernels"] = compiles.figures()
    return result


def run_checks_here(names: list[str], device: str, events: Path) -> int:
    """In a child process: run `names` in order, appending a line to `events` as each starts and
    with each one's result. Stops after a check that raised (status 1): its CUDA context may be
    broken, so the rest are left to a fresh process."""
    def note(event: dict) -> None:
        with events.open("a") as f:
            f.write(json.dumps(event, default=str) + "\n")

    for name in names:
        refusal = budget_refusal(name, DEADLINE - time.time())
        if refusal is not None:
            note({"check": name, "result": refusal})
            continue
        note({"check": name, "started": True})
        result = run_one(name, device)
        note({"check": name, "result": result})
        if "traceback" in result:
            return 1
    return 0


def kill_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it was started in a session of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


STARTUP_LIMIT_S = 120  # a child's imports, before its first check starts


def _follow(proc: subprocess.Popen, events: Path, deadline: float,
            record: Callable[[str, dict], None]) -> tuple[list[str], str | None, float, int | str]:
    """Read the child's events as they come until it ends, or kill its process group when the
    running check passes its time limit (before the first: STARTUP_LIMIT_S) or the budget ends.
    Returns the checks done, the one running at the end (None: between checks), since when, and
    the child's exit status (or why it was killed)."""
    done: list[str] = []
    running, since, read = None, time.time(), 0
    while True:
        status = proc.poll()
        with events.open("rb") as f:
            f.seek(read)
            lines = f.readlines()
        for line in lines:
            if not line.endswith(b"\n"):
                break  # a line still being written: read it next time
            read += len(line)
            event = json.loads(line)
            if event.get("started"):
                running, since = event["check"], time.time()
            else:
                record(event["check"], event["result"])
                done.append(event["check"])
                running, since = None, time.time()
        if status is not None:
            return done, running, since, status
        limit = CHECKS[running].limit_s if running else STARTUP_LIMIT_S
        if time.time() > min(deadline, since + limit):
            kill_process_group(proc)
            return done, running, since, f"killed after {time.time() - since:.0f} s (its limit: {limit:.0f} s, " \
                                         "or the budget)"
        time.sleep(0.2)


def run_in_child(names: list[str], device: str, deadline: float, record: Callable[[str, dict], None]) -> list[str]:
    """Run `names` in one child process, in a session of its own, handing each result to `record`
    as it comes. Its process group is killed when the running check passes its time limit or the
    budget ends. Returns the names it did not reach (after a check that raised, or was killed).
    Each call records at least one result, so that a child that cannot start cannot loop."""
    with tempfile.TemporaryDirectory() as d:
        events = Path(d) / "events.jsonl"
        events.touch()
        cmd = [sys.executable, __file__, "--run-checks", *names, "--device", device, "--events", str(events),
               "--artifacts", str(ARTIFACTS), "--deadline", repr(deadline)]
        # Triton reads TRITON_INTERPRET once, at its import (torch imports it): set before the process starts.
        env = dict(os.environ, **({} if _cuda(device) else {"TRITON_INTERPRET": "1"}))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            done, running, since, status = _follow(proc, events, deadline, record)
        finally:  # this process stopped (SIGTERM, Ctrl-C): its child's session must not outlive it
            if proc.poll() is None:
                kill_process_group(proc)
        left = [n for n in names if n not in done]
        if left and (running is not None or not done):
            # The child died or was killed inside this check (or before its first one).
            at = running or left[0]
            record(at, {"ok": False, "error": f"its process ended ({status}) without a result",
                        "seconds": round(time.time() - since, 2)})
            left.remove(at)
        return left


def run_checks(selected: list[str], device: str, budget_s: float, record: Callable[[str, dict], None]) -> None:
    """Every selected check, in order: consecutive checks of one process key in one child, a fresh
    child after one ended early; what the budget does not let start is recorded as such."""
    deadline = time.time() + budget_s
    pending = list(selected)
    while pending:
        refusal = budget_refusal(pending[0], deadline - time.time(), PROCESS_START_S)
        if refusal is not None:
            record(pending.pop(0), refusal)
            continue
        process = CHECKS[pending[0]].process
        group = list(itertools.takewhile(lambda n: CHECKS[n].process == process, pending))
        left = run_in_child(group, device, deadline, record)
        pending = left + pending[len(group):]


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


def passed(result: dict) -> bool:
    """A check passed, or was an optional one skipped."""
    return result.get("ok") is True or "skipped" in result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON report")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these checks: {', '.join(CHECKS)}")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: the script's own dry run")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="stop starting checks past this time")
    parser.add_argument("--run-checks", nargs="+", choices=list(CHECKS), help=argparse.SUPPRESS)
    parser.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--artifacts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    global ARTIFACTS, DEADLINE
    if opts.run_checks:
        ARTIFACTS, DEADLINE = opts.artifacts, opts.deadline
        return run_checks_here(opts.run_checks, opts.device, opts.events)
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

    def record(name: str, result: dict) -> None:
        report["checks"][name] = {**result, "estimate_s": CHECKS[name].estimate_s}
        report["seconds"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")  # after every check
        verdict = "skipped" if "skipped" in result else "ok" if result.get("ok") else "FAILED"
        figures = {k: v for k, v in result.items() if k != "traceback"}
        print(f"{name}: {verdict} {json.dumps(figures, default=str)[:600]}", flush=True)

    # The device call's own timeout stops this process with SIGTERM: as an exception, so that the child's
    # session is killed on the way out (run_in_child), not left running.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        run_checks(selected, opts.device, opts.budget_s, record)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"report written to {out}")
    return 0 if all(passed(r) for r in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
