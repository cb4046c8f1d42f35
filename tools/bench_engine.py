"""Output tokens/s of the Rollplex engine against transformers' generate, side by side.

    python tools/bench_engine.py                                   # CPU default: batch 32, one image each
    python tools/bench_engine.py --prompts 64 --n 4 --output-len 64 --json bench.json
    python tools/bench_engine.py --prompt-source processor         # real chat-template + image-processor prompts
    python tools/bench_engine.py --device cuda --hidden 1024 --layers 8 --prompts 128
    python tools/bench_engine.py --n 8 --stop-tokens 10 --output-len 128   # RL-shaped: lengths vary per sample
    python tools/bench_engine.py --n 8 --output-len 64 --host-overhead     # host time per decode step (engine only)
    python tools/bench_engine.py --shared-prefix --prompts 16 --n 8 --prompt-len 1024 --images 0 --batch-size 16
                                                                   # group-shared decode against distinct prompts

Both sides generate the same workload from the same random tiny checkpoint
(built into a temp dir with rollplex.tiny.make_tiny_checkpoint, bytes
vocabulary, so 320 embedding rows): `--prompts` prompts of `--prompt-len` text
tokens and `--images` images each, `--n` samples per prompt, exactly
`--output-len` new tokens per sample (EOS ignored), sampled at temperature 1
with no top-k/top-p. The weights are random, so only the timings mean anything.

With `--stop-tokens K` the workload is RL-shaped instead: each response ends at
the first of K stop token ids (byte tokens spread over the byte range, the same
on both sides) or at `--output-len` tokens, so lengths vary per sample. The
engine frees a finished sequence at once; `generate` keeps a finished row in its
batch, padding it, until the batch's longest row ends. Each side then reports its
useful output tokens (each response up to and including its stop token) per
second, and the tokens it computed including that padding.

- Rollplex: `Engine.generate` on all requests at once (continuous batching),
  with at most `--batch-size` x `--n` sequences decoding together and a KV pool
  sized to hold every sequence at full length (so nothing is preempted).
- transformers: the family's `...ForConditionalGeneration.generate`, one call per
  `--batch-size` prompts, left-padded, `num_return_sequences=n`, as a user would.

Each side runs the whole workload once to warm up (not timed), then `--repeats`
timed runs, interleaved (Rollplex, transformers, Rollplex, ...) so that machine
noise hits both alike; the median wall time is reported. Wall time covers the
generate calls only (vision encoding, prefill, decode, sampling), not model
loading, engine construction or input building.

`--host-overhead` measures only the engine (no transformers): its decode step
time on models of `--host-overhead-layers` layers (other sizes the same), and
the least-squares line of step time against layer count. The intercept is the
time per decode step that does not depend on depth: scheduling, the decode
inputs, rotary tables, sampling and its bookkeeping (stop checks, finished
sequences), the embedding, the final norm and the head. Each decode step is
timed on its own (the engine's `between_steps` callback), and each step's time
is its minimum over the repeats, so that other load on a shared machine, which
only adds time, drops out. On CPU the decoder layers are also timed within the
same steps, and the tool reports each model's step time minus its layers' time:
the depth-independent time measured directly, not fitted; and splits it into the
model's time outside its layers (embedding, final norm, output head), the
sampler's, and the rest, the engine's own host work (scheduling, inputs, stop
checks), which on a GPU is what the host must do each step while the device
runs the model and the sampler.

`--shared-prefix` measures only the engine: its decode step time on `--prompts`
groups of `--n` samples with `shared_prefix_decode` on and off, and on
`--prompts` x `--n` distinct prompts of the same length (plain decode), timed as
`--host-overhead` times them. The ratios to the distinct prompts' step say what
reading each group's prompt KV once per step saves.

On CUDA the tool also measures the engine's decode step time, with CUDA graphs
and with `enforce_eager`, against a memory-bandwidth floor (see
`decode_step_report`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.engine import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from rollplex.models import Prompt, VisionLanguageModel, family_of_config, from_pretrained  # noqa: E402
from rollplex.models.loader import read_hf_config  # noqa: E402
from rollplex.tiny import TinySpec, make_tiny_checkpoint  # noqa: E402

RANDOM_WEIGHTS_NOTE = "weights are random: the figures are timings only, the generated text means nothing"
SEED = 0


@dataclass
class Workload:
    prompts: int
    prompt_len: int  # text tokens per prompt (random source) or characters of the question (processor source)
    images: int  # per prompt
    image_patches: int  # image side in 14-px patches (the merger turns 2x2 patches into one token)
    output_len: int
    n: int
    batch_size: int  # prompts per transformers generate call; Rollplex decodes batch_size * n sequences at once
    prompt_source: str  # "random" (token ids + random pixel rows) or "processor" (prepare_prompt output)
    stop_tokens: int = 0  # > 0: responses end at the first of this many stop ids (output_len is then a cap)

    @property
    def stop_ids(self) -> list[int]:
        """Byte tokens spread over the byte range: the model samples them as it samples any other."""
        return [i * 256 // self.stop_tokens for i in range(self.stop_tokens)]


@dataclass
class RunResult:
    wall_s: float  # median over the timed repeats
    output_tokens: int  # useful tokens: each response up to and including its stop token
    tokens_per_s: float
    all_wall_s: list[float]
    computed_tokens: int  # also counting the padding generate adds to rows that finished before their batch


# ------------------------------------------------------------------------------------------------ arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model (random weights)")
    m.add_argument("--hidden", type=int, default=256, help="language model hidden size")
    m.add_argument("--layers", type=int, default=4, help="language model layers")
    m.add_argument("--heads", type=int, default=4, help="attention heads")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    m.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2 x hidden)")
    m.add_argument("--vision-hidden", type=int, default=32)
    m.add_argument("--vision-depth", type=int, default=2)
    m.add_argument("--vision-heads", type=int, default=2)
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", type=int, default=32, help="number of prompts")
    w.add_argument("--prompt-len", type=int, default=32, help="text tokens per prompt (besides image tokens)")
    w.add_argument("--images", type=int, default=1, help="images per prompt")
    w.add_argument("--image-patches", type=int, default=8,
                   help="image side in 14-px patches (even); tokens per image = (patches / 2)^2")
    w.add_argument("--output-len", type=int, default=32,
                   help="new tokens per sample (EOS ignored); with --stop-tokens, the most per sample")
    w.add_argument("--stop-tokens", type=int, default=0,
                   help="RL-shaped workload: responses end at the first of this many stop token ids")
    w.add_argument("--n", type=int, default=1, help="samples per prompt")
    w.add_argument("--batch-size", type=int, default=32, help="prompts per transformers generate call")
    w.add_argument("--prompt-source", choices=["random", "processor"], default="random",
                   help="random: token ids + random pixel rows; processor: chat template + image processor")
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cpu")
    r.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    r.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's)")
    r.add_argument("--repeats", type=int, default=1, help="timed runs per side after the warm-up (median reported)")
    r.add_argument("--block-size", type=int, default=16, help="engine KV block size")
    r.add_argument("--max-model-len", default="engine",
                   help="engine max_model_len: 'engine' (EngineConfig's default, capped by the model's positions), "
                        "'workload' (its longest prompt + output) or a number")
    r.add_argument("--host-overhead", action="store_true",
                   help="instead of the comparison: the engine's depth-independent host time per decode step")
    r.add_argument("--host-overhead-layers", type=int, nargs="+", default=[1, 2, 4],
                   help="layer counts of the models --host-overhead fits its line over")
    r.add_argument("--shared-prefix", action="store_true",
                   help="instead of the comparison: the decode step of the groups with and without shared-prefix "
                        "decode, against as many distinct prompts")
    r.add_argument("--no-run-ahead", action="store_true",
                   help="the engine reads each decode step's tokens back before it issues the next "
                        "(EngineConfig.run_ahead)")
    r.add_argument("--json", type=Path, default=None, help="also write the report here")
    a = p.parse_args(argv)
    for name in ("prompts", "prompt_len", "output_len", "n", "batch_size", "repeats", "image_patches"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.images < 0:
        p.error("--images must be >= 0")
    if not 0 <= a.stop_tokens <= 256:
        p.error("--stop-tokens must be in [0, 256] (they are byte tokens)")
    if a.shared_prefix and (a.host_overhead or a.stop_tokens or a.output_len < 3 or a.n < 2):
        p.error("--shared-prefix times fixed-length decoding of groups: it needs no --host-overhead or "
                "--stop-tokens, --output-len >= 3 and --n >= 2")
    if a.host_overhead and (a.stop_tokens or a.output_len < 3 or len(set(a.host_overhead_layers)) < 2):
        p.error("--host-overhead times fixed-length decoding: it needs no --stop-tokens, --output-len >= 3 "
                "and at least two distinct --host-overhead-layers")
    if a.max_model_len not in ("workload", "engine") and not a.max_model_len.isdigit():
        p.error("--max-model-len must be 'workload', 'engine' or a number")
    if a.image_patches % 2:
        p.error("--image-patches must be even (2x2 patches merge into one token)")
    return a


def workload_of(a: argparse.Namespace) -> Workload:
    return Workload(a.prompts, a.prompt_len, a.images, a.image_patches, a.output_len, a.n, a.batch_size,
                    a.prompt_source, a.stop_tokens)


# ------------------------------------------------------------------------------------------------ model


def build_checkpoint(out_dir: Path, a: argparse.Namespace, layers: int) -> Path:
    side_px = a.image_patches * 14
    spec = TinySpec(hidden_size=a.hidden, num_layers=layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
                    intermediate_size=a.intermediate or 2 * a.hidden, vision_hidden_size=a.vision_hidden,
                    vision_depth=a.vision_depth, vision_num_heads=a.vision_heads,
                    vision_intermediate_size=2 * a.vision_hidden, vocab="bytes",
                    # Let the image processor keep the requested image size as it is.
                    max_pixels=max(TinySpec.max_pixels, side_px * side_px))
    return make_tiny_checkpoint(out_dir, spec, seed=SEED)


def load_transformers(path: Path, dtype: torch.dtype, device: str):
    hf_class = family_of_config(read_hf_config(path), str(path)).transformers_class()
    return hf_class.from_pretrained(path, dtype=dtype).to(device).eval()


# ------------------------------------------------------------------------------------------------ prompts


def random_requests(model: VisionLanguageModel, wl: Workload) -> list[Request]:
    """Prompts as token ids: each image as <vision_start> <image_pad> x tokens <vision_end>,
    then `prompt_len` random byte tokens; pixel rows are random (as tests/test_model.py builds them)."""
    args, g = model.args, torch.Generator().manual_seed(SEED)
    vision = args.vision
    row = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    side = wl.image_patches
    tokens_per_image = side * side // vision.spatial_merge_size ** 2
    requests = []
    for _ in range(wl.prompts):
        ids: list[int] = []
        for _ in range(wl.images):
            ids += [args.vision_start_token_id] + [args.image_token_id] * tokens_per_image + [args.vision_end_token_id]
        ids += torch.randint(0, 256, (wl.prompt_len,), generator=g).tolist()  # byte tokens, no specials
        pixels = grid = None
        if wl.images:
            pixels = torch.randn(wl.images * side * side, row, generator=g)
            grid = torch.tensor([[1, side, side]] * wl.images)
        requests.append(Request(Prompt(torch.tensor(ids), pixel_values=pixels, image_grid_thw=grid), n=wl.n))
    return requests


def processor_requests(path: Path, wl: Workload) -> list[Request]:
    """Real preprocessing: chat template, image processor on random RGB images, tokenizer.
    The question is `prompt_len` random letters (one byte token each); the template adds ~40 tokens."""
    from rollplex.data.processing import prepare_prompt
    from rollplex.data.processor import load_processor

    processor, rng = load_processor(path), np.random.default_rng(SEED)
    side_px = wl.image_patches * 14
    requests = []
    for _ in range(wl.prompts):
        question = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz "), wl.prompt_len))
        images = [rng.integers(0, 256, (side_px, side_px, 3), dtype=np.uint8) for _ in range(wl.images)]
        out = prepare_prompt(processor, "<image>" * wl.images + question, images=images or None)
        requests.append(Request(out, n=wl.n))
    return requests


def hf_batches(requests: list[Request], batch_size: int, model_args, pad_id: int, device: str) -> list[dict]:
    """generate() kwargs per batch: left-padded ids, attention mask, mm_token_type_ids
    (image 1, video 2, else 0, as transformers 5 wants them) and the batch's pixels."""
    batches = []
    for start in range(0, len(requests), batch_size):
        chunk = requests[start:start + batch_size]
        prompts = [r.prompt for r in chunk]
        width = max(len(p.input_ids) for p in prompts)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p.input_ids):] = p.input_ids
            mask[i, width - len(p.input_ids):] = 1
        mm = (ids == model_args.image_token_id).long() + 2 * (ids == model_args.video_token_id).long()
        kw = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm}
        if any(p.pixel_values is not None for p in prompts):
            kw["pixel_values"] = torch.cat([p.pixel_values for p in prompts if p.pixel_values is not None])
            kw["image_grid_thw"] = torch.cat([p.image_grid_thw for p in prompts if p.image_grid_thw is not None])
        batches.append({k: v.to(device) for k, v in kw.items()})
    return batches


# ------------------------------------------------------------------------------------------------ running


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)  # the clock stops when the device is done, not when the last kernel was queued
    return time.perf_counter() - start, out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(model: VisionLanguageModel, requests: list[Request], wl: Workload, a: argparse.Namespace,
                enforce_eager: bool = False, shared_prefix_decode: bool = False) -> Engine:
    # A pool that holds every sequence at full length, without sharing: the benchmark
    # measures throughput, not how the scheduler copes with a tight pool.
    longest = max(len(r.prompt.input_ids) for r in requests) + wl.output_len
    per_seq = -(-longest // a.block_size)
    config = EngineConfig(block_size=a.block_size, num_blocks=len(requests) * wl.n * per_seq,
                          max_num_seqs=wl.batch_size * wl.n, enforce_eager=enforce_eager, progress=False,
                          shared_prefix_decode=shared_prefix_decode, run_ahead=not a.no_run_ahead)
    if a.max_model_len == "workload":
        config.max_model_len = longest
    elif a.max_model_len != "engine":
        config.max_model_len = int(a.max_model_len)
    return Engine(model, config)


def rollplex_generate(engine: Engine, requests: list[Request], max_tokens: int,
                      stop_ids: Iterable[int] = (), between_steps: Callable[[int], None] | None = None) -> int:
    """Output tokens, each sample's stop token included: the engine keeps no padding."""
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens,
                            stop_token_ids=list(stop_ids), ignore_eos=True, seed=SEED)
    outputs = engine.generate(requests, params, between_steps)
    return sum(len(s.token_ids) for o in outputs for s in o.samples)


@torch.no_grad()
def transformers_generate(hf, batches: list[dict], wl: Workload) -> tuple[int, int]:
    """(useful, computed) output tokens; computed also counts the padding of rows that finished early."""
    torch.manual_seed(SEED)
    # min = max new tokens is transformers' ignore_eos; otherwise the stop ids replace the model's EOS.
    ending = {"eos_token_id": wl.stop_ids} if wl.stop_tokens else {"min_new_tokens": wl.output_len}
    useful = computed = 0
    for kw in batches:
        # top_k=0 turns off transformers' default top-50.
        out = hf.generate(**kw, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=wl.n,
                          max_new_tokens=wl.output_len, **ending)
        generated = out[:, kw["input_ids"].shape[1]:]
        useful += useful_tokens(generated, wl.stop_ids)
        computed += generated.numel()
    return useful, computed


def useful_tokens(generated: torch.Tensor, stop_ids: list[int]) -> int:
    """Tokens of each row of `generated` (rows x new tokens) up to and including its
    first stop token, or all of the row if it has none; after a row's stop token,
    generate only pads it while the rest of its batch goes on."""
    is_stop = torch.isin(generated, torch.tensor(stop_ids, dtype=generated.dtype, device=generated.device))
    # argmax returns the first maximal index: the first stop token.
    lengths = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1) + 1, generated.shape[1])
    return int(lengths.sum())


def result_of(times: list[float], tokens: int, computed: int) -> RunResult:
    wall = statistics.median(times)
    return RunResult(wall, tokens, tokens / wall, times, computed)


def compare(engine: Engine, requests: list[Request], hf, batches: list[dict], wl: Workload, repeats: int,
            device: torch.device) -> tuple[RunResult, RunResult]:
    """Warm-up each side once, then alternate timed runs so drift in machine load hits both."""
    run_r = functools.partial(rollplex_generate, engine, requests, wl.output_len, wl.stop_ids)
    run_t = functools.partial(transformers_generate, hf, batches, wl)
    run_r()
    run_t()
    times_r, times_t = [], []
    for _ in range(repeats):
        t, tokens_r = timed(run_r, device)
        times_r.append(t)
        t, (tokens_t, computed_t) = timed(run_t, device)
        times_t.append(t)
    return result_of(times_r, tokens_r, tokens_r), result_of(times_t, tokens_t, computed_t)


# ------------------------------------------------------------------------------------------------ CUDA: decode floor


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large copy_: each copy reads and writes nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    return 2 * nbytes * iters / seconds


def decode_weight_bytes(model: VisionLanguageModel) -> int:
    """Bytes of the weights one decode step reads: the language model and its head.
    The vision tower does not run in decode; of the input embedding only a few rows are
    read, unless it is tied to the head, which reads all of it."""
    lm = model.language_model
    total = sum(p.numel() * p.element_size() for p in lm.parameters())
    embed = lm.embed_tokens.weight
    if model.lm_head is not None:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_decode_step(model: VisionLanguageModel, requests: list[Request], wl: Workload, decode_steps: int) -> float:
    """Mean KV bytes the decode attention must read per step: a sample's step that feeds
    its k-th generated token attends to prompt + k tokens (k = 1 .. L-1). Each sample
    reads its group's shared prompt KV for itself."""
    text = model.args.text
    itemsize = model.language_model.embed_tokens.weight.element_size()  # the engine's KV dtype is the model's
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * text.head_dim * itemsize
    L = wl.output_len
    tokens = sum(r.n * ((L - 1) * len(r.prompt.input_ids) + (L - 1) * L // 2) for r in requests)
    return per_token * tokens / max(decode_steps, 1)


def decode_step_report(model: VisionLanguageModel, requests: list[Request], wl: Workload, a: argparse.Namespace,
                       device: torch.device) -> dict:
    """Decode step time of the engine against the memory-bandwidth floor, with and without CUDA graphs.

    Measured: each decode step of generate(max_tokens=L) on its own, its minimum over
    the repeats (see `decode_step_times`). So a "step" is the engine's whole decode
    step: scheduling, input building, the forward, sampling and the host sync that
    reads the tokens back.
    Floor: (decode weight bytes + mean KV bytes read per step) / measured copy bandwidth,
    i.e. the time just to stream those bytes from device memory once.
    """
    if wl.output_len < 3:
        raise ValueError("the decode step measurement needs --output-len >= 3")
    bandwidth = copy_bandwidth(device)
    weights = decode_weight_bytes(model)
    report: dict[str, Any] = {"copy_bandwidth_GBps": bandwidth / 1e9, "decode_weight_bytes": weights}
    for name, eager in (("cuda_graphs", False), ("eager", True)):
        engine = make_engine(model, requests, wl, a, enforce_eager=eager)
        (step,) = decode_step_times([engine], [requests], wl.output_len, a.repeats, device)
        kv = kv_bytes_per_decode_step(model, requests, wl, step["decode_steps"])
        floor_s = (weights + kv) / bandwidth
        report[name] = {**step, "kv_bytes_per_step": kv, "floor_ms": floor_s * 1e3,
                        "step_over_floor": step["decode_step_ms"] / 1e3 / floor_s}
        engine.release_kv()
        del engine
    return report


class StepClock:
    """Times each decode step of a generate() through its `between_steps` callback, which
    the engine calls after it reads a step's tokens back, with the next step already
    issued (run-ahead): each interval holds one step's model run and another's stop
    checks. The first decode interval holds two model runs (the first step is issued
    with none in flight) and the last step has none, so neither is timed. With
    `time_parts` (CPU only, where the host runs the model itself), also each step's time
    in the decoder layers (hooks on the first and last), in the whole model (its
    forward_generated and logits) and in the sampler: the rest is the engine's host work."""

    PARTS = ("layers", "model", "sampler")

    def __init__(self, engine: Engine, time_parts: bool):
        self.engine = engine
        self.layers_start = 0.0
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        self.hooks, self.wrapped = [], []
        if time_parts:
            layers = engine.model.language_model.layers
            self.hooks = [layers[0].register_forward_pre_hook(self._layers_start),
                          layers[-1].register_forward_hook(self._layers_end)]
            self._time(engine.model, "forward_generated", "model")
            self._time(engine.model, "logits", "model")
            self._time(engine, "_sample", "sampler")

    def _layers_start(self, *_) -> None:
        self.layers_start = time.perf_counter()

    def _layers_end(self, *_) -> None:
        self.parts["layers"] += time.perf_counter() - self.layers_start

    def _time(self, owner: object, name: str, part: str) -> None:
        """Add each call of owner.name to `part` (an instance attribute over the method, until `close`)."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.parts[part] += time.perf_counter() - start

        setattr(owner, name, timed)
        self.wrapped.append((owner, name))

    def generate(self, requests: list[Request], max_tokens: int) -> dict[str, list[float]]:
        """One generate(); per decode step it timed: its wall time, its parts' times
        (0 when not timed) and its batch."""
        steps: dict[str, list[float]] = {"step_s": [], "batch": [], **{f"{p}_s": [] for p in self.PARTS}}
        decode_tokens, first = 0, True

        def between_steps(_running: int) -> None:
            nonlocal decode_tokens, last, first
            now = time.perf_counter()
            batch = self.engine.stats["decode_tokens"] - decode_tokens
            if batch and not first:  # a decode step (a prefill step adds no decode tokens), not the first
                steps["step_s"].append(now - last)
                steps["batch"].append(batch)
                for part, seconds in self.parts.items():
                    steps[f"{part}_s"].append(seconds)
            first = first and not batch
            decode_tokens, last = self.engine.stats["decode_tokens"], time.perf_counter()
            self.parts = dict.fromkeys(self.PARTS, 0.0)

        last = time.perf_counter()
        self.parts = dict.fromkeys(self.PARTS, 0.0)
        rollplex_generate(self.engine, requests, max_tokens, between_steps=between_steps)
        return steps

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for owner, name in self.wrapped:
            delattr(owner, name)


def per_step_minimum_ms(runs: list[list[float]]) -> float:
    """The mean over step indices of each step's fastest time over the runs (runs x steps,
    seconds -> ms). Other load on the machine only ever adds time, and it hits a step of
    one run, not the same step of every run; the steps themselves differ (the context
    grows, every block_size-th step allocates blocks), so each is compared with itself."""
    return float(np.min(np.array(runs), axis=0).mean() * 1e3)


def decode_step_times(engines: list[Engine], requests: list[list[Request]], output_len: int, repeats: int,
                      device: torch.device, time_parts: bool = False) -> list[dict]:
    """Each engine's decode step time on its requests, a whole engine step (scheduling, input building,
    the forward, sampling, the host sync that reads the tokens back), timed step by step
    in generate(max_tokens=L) after a warm-up (and graph capture). The timed runs
    alternate between the engines, so drift in machine load hits all of them alike.

    Per engine: `decode_step_ms`, the per-step minimum over repeats (see
    `per_step_minimum_ms`); `all_step_ms`, each repeat's mean step (the spread); with
    `time_parts` (`StepClock`), the same statistic of: `layers_ms`, the decoder layers'
    time; `outside_layers_ms`, each step's time minus its layers'; `model_outside_layers_ms`,
    the model's time outside the layers (embedding, final norm, output head);
    `sampler_ms`; and `host_ms`, each step's time outside the model and the sampler."""
    clocks = [StepClock(engine, time_parts) for engine in engines]
    for engine, engine_requests in zip(engines, requests):
        rollplex_generate(engine, engine_requests, output_len)
    runs: list[list[dict[str, list[float]]]] = [[] for _ in engines]
    for _ in range(repeats):
        for clock, engine_requests, engine_runs in zip(clocks, requests, runs):
            _sync(device)
            engine_runs.append(clock.generate(engine_requests, output_len))
    results = []
    for clock, engine_runs in zip(clocks, runs):
        clock.close()
        step_s = [r["step_s"] for r in engine_runs]
        if not step_s[0]:
            raise ValueError("no decode step was timed: the first and last steps of a generate() are not "
                             "(use a longer output)")
        if len({len(s) for s in step_s}) != 1:
            raise RuntimeError("the repeats ran different numbers of decode steps; the workload must be fixed-length")
        result = {"decode_step_ms": per_step_minimum_ms(step_s),
                  "all_step_ms": [float(np.mean(s) * 1e3) for s in step_s],
                  "timed_steps": len(step_s[0]),
                  "decode_steps": len(step_s[0]) + 2,  # and the first and last ones
                  "mean_decode_batch": float(np.mean(engine_runs[0]["batch"]))}
        if time_parts:
            def part(of) -> float:
                return per_step_minimum_ms([[of(*values) for values in zip(
                    r["step_s"], r["layers_s"], r["model_s"], r["sampler_s"])] for r in engine_runs])
            result.update(layers_ms=part(lambda step, layers, model, sampler: layers),
                          outside_layers_ms=part(lambda step, layers, model, sampler: step - layers),
                          model_outside_layers_ms=part(lambda step, layers, model, sampler: model - layers),
                          sampler_ms=part(lambda step, layers, model, sampler: sampler),
                          host_ms=part(lambda step, layers, model, sampler: step - model - sampler))
        results.append(result)
    return results


def host_overhead_report(a: argparse.Namespace, wl: Workload, device: torch.device, dtype: torch.dtype) -> dict:
    """The engine's decode step time against layer count, over random models that differ
    only in depth, and its least-squares line: the intercept is the time per step that
    does not depend on depth, the slope the time per layer. Fitted on the per-step
    minimum steps, and on each repeat's mean steps for the spread. On CPU also, per
    model, the step's time outside the decoder layers, timed in the same steps: what
    the intercept estimates, measured directly."""
    layers = a.host_overhead_layers
    engines, requests = [], None
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        for n_layers in layers:
            path = build_checkpoint(Path(tmp) / str(n_layers), a, n_layers)
            model = from_pretrained(path, dtype=dtype, device=device)
            # The requests depend on the vision config and token ids only, the same at every depth.
            requests = requests or build_requests(path, model, wl)
            engines.append(make_engine(model, requests, wl, a))
    time_parts = device.type == "cpu"
    steps = decode_step_times(engines, [requests] * len(engines), wl.output_len, a.repeats, device, time_parts)
    slope, intercept = np.polyfit(layers, [s["decode_step_ms"] for s in steps], 1)
    per_repeat = [np.polyfit(layers, [s["all_step_ms"][i] for s in steps], 1) for i in range(a.repeats)]
    report = {"layers": layers, "models": [model_summary(e.model) for e in engines], "steps": steps,
              "slope_ms_per_layer": float(slope), "intercept_ms": float(intercept),
              "all_slope_ms_per_layer": [float(f[0]) for f in per_repeat],
              "all_intercept_ms": [float(f[1]) for f in per_repeat]}
    if time_parts:
        for key in ("outside_layers_ms", "model_outside_layers_ms", "sampler_ms", "host_ms"):
            report[key] = statistics.median(s[key] for s in steps)
    return report


SHARED_PREFIX_CASES = ("groups, shared-prefix decode", "groups, plain decode", "distinct prompts")


def shared_prefix_report(a: argparse.Namespace, wl: Workload, device: torch.device, dtype: torch.dtype) -> dict:
    """The decode step of `wl`'s groups with shared-prefix decode on and off, and of as
    many distinct prompts of the same length (plain decode), on one model; and the
    groups' step over the distinct prompts' step, for each."""
    distinct_wl = replace(wl, prompts=wl.prompts * wl.n, n=1, batch_size=wl.batch_size * wl.n)
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        path = build_checkpoint(Path(tmp), a, a.layers)
        model = from_pretrained(path, dtype=dtype, device=device)
        groups, distinct = build_requests(path, model, wl), build_requests(path, model, distinct_wl)
    cases = ((groups, wl, True), (groups, wl, False), (distinct, distinct_wl, False))
    engines = [make_engine(model, requests, w, a, shared_prefix_decode=on) for requests, w, on in cases]
    steps = decode_step_times(engines, [requests for requests, _, _ in cases], wl.output_len, a.repeats, device)
    distinct_ms = steps[2]["decode_step_ms"]
    return {"model": model_summary(model), "prompt_tokens": len(groups[0].prompt.input_ids),
            "steps": dict(zip(SHARED_PREFIX_CASES, steps)),
            "shared_over_distinct": steps[0]["decode_step_ms"] / distinct_ms,
            "plain_over_distinct": steps[1]["decode_step_ms"] / distinct_ms}


# ------------------------------------------------------------------------------------------------ report


def format_report(report: dict) -> str:
    """The compact table printed at the end of a run."""
    if "host_overhead" in report:
        return format_host_overhead(report)
    if "shared_prefix" in report:
        return format_shared_prefix(report)
    wl, r, t = report["workload"], report["rollplex"], report["transformers"]
    samples = wl["prompts"] * wl["n"]
    rl = bool(wl["stop_tokens"])
    ending = (f"ending at {wl['stop_tokens']} stop tokens {report['stop_token_ids']} or at {wl['output_len']} tokens"
              if rl else f"{wl['output_len']} new tokens each")
    lines = [
        f"NOTE: {report['note']}",
        f"model: {report['model']['summary']}; {report['device']} {report['dtype']}, {report['threads']} threads",
        f"workload: {wl['prompts']} prompts x n={wl['n']} ({wl['prompt_source']}, mean prompt "
        f"{report['mean_prompt_tokens']:.0f} tokens incl. {report['image_tokens_per_prompt']} image tokens), "
        f"{ending}, batch {wl['batch_size']}, median of {report['repeats']} after warm-up",
        "",
        f"{'':<14}{'wall s':>9}{'out tokens':>12}{'tokens/s':>11}" + (f"{'mean len':>10}{'computed':>10}" if rl else ""),
    ]
    for name, res in (("rollplex", r), ("transformers", t)):
        lines.append(f"{name:<14}{res['wall_s']:>9.3f}{res['output_tokens']:>12d}{res['tokens_per_s']:>11.1f}"
                     + (f"{res['output_tokens'] / samples:>10.1f}{res['computed_tokens']:>10d}" if rl else ""))
    if rl:
        lines.append("(out tokens: useful ones, up to and including each stop token; computed: also the padding "
                     "generate keeps on finished rows)")
    lines.append(f"ratio rollplex / transformers: {report['ratio']:.2f}x")
    s = report["engine_stats"]
    lines.append(f"engine: prefill {s['prefill_tokens']} tokens, decode {s['decode_tokens']} tokens, "
                 f"{s['steps']} steps, {s['preemptions']} preemptions; max_model_len {report['engine_max_model_len']} "
                 f"(--max-model-len {report['max_model_len_option']})")
    if "cuda_decode" in report:
        c = report["cuda_decode"]
        lines += ["", f"decode step vs memory floor (copy bandwidth {c['copy_bandwidth_GBps']:.0f} GB/s, "
                      f"decode weights {c['decode_weight_bytes'] / 1e6:.1f} MB):",
                  "  step = a whole engine decode step, each step's minimum over the repeats, averaged;",
                  "  floor = (decode weight bytes + KV bytes read per step) / copy bandwidth"]
        for name in ("cuda_graphs", "eager"):
            d = c[name]
            lines.append(f"  {name:<12} step {d['decode_step_ms']:.3f} ms, floor {d['floor_ms']:.3f} ms "
                         f"({d['step_over_floor']:.1f}x floor), mean batch {d['mean_decode_batch']:.1f}, "
                         f"KV {d['kv_bytes_per_step'] / 1e6:.2f} MB/step")
    return "\n".join(lines)


def format_host_overhead(report: dict) -> str:
    wl, h = report["workload"], report["host_overhead"]
    timed = "outside_layers_ms" in h
    steps = h["steps"][0]
    lines = [
        f"NOTE: {report['note']}",
        f"models: {'; '.join(m['summary'] for m in h['models'])}",
        f"{report['device']} {report['dtype']}, {report['threads']} threads, "
        f"run-ahead {'on' if report['run_ahead'] else 'off'}",
        f"workload: {wl['prompts']} prompts x n={wl['n']} ({wl['prompt_source']}), {wl['output_len']} new tokens each, "
        f"batch {wl['batch_size']}, {report['repeats']} repeats after warm-up",
        f"step: a whole engine decode step, timed one by one ({steps['timed_steps']} of each generate's "
        f"{steps['decode_steps']}: not the first or the last); each step's minimum over the repeats, averaged over "
        "the steps",
        "",
        f"{'layers':>6}{'step ms':>10}" + (f"{'layers ms':>11}{'outside ms':>12}" if timed else "")
        + f"{'mean batch':>12}  per repeat mean step ms",
    ]
    for layers, step in zip(h["layers"], h["steps"]):
        lines.append(f"{layers:>6}{step['decode_step_ms']:>10.3f}"
                     + (f"{step['layers_ms']:>11.3f}{step['outside_layers_ms']:>12.3f}" if timed else "")
                     + f"{step['mean_decode_batch']:>12.1f}  " + " ".join(f"{x:.3f}" for x in step["all_step_ms"]))
    lines += [f"least squares of step ms over layers: {h['slope_ms_per_layer']:.3f} ms per layer, "
              f"depth-independent {h['intercept_ms']:.3f} ms per step",
              "  per repeat (mean steps): intercept " + " ".join(f"{x:.3f}" for x in h["all_intercept_ms"])
              + " ms; slope " + " ".join(f"{x:.3f}" for x in h["all_slope_ms_per_layer"]) + " ms"]
    if timed:
        lines += [f"outside the decoder layers (step minus the layers' own time in the same step, "
                  f"timed by hooks), median over the models: {h['outside_layers_ms']:.3f} ms per step",
                  "  (the intercept also carries any noise in the deeper models' layer time, "
                  "amplified by the extrapolation to 0 layers; this does not)",
                  f"  of which: the model outside the layers (embedding, final norm, output head) "
                  f"{h['model_outside_layers_ms']:.3f} ms, the sampler {h['sampler_ms']:.3f} ms, "
                  f"and the engine's host work (step minus model and sampler) {h['host_ms']:.3f} ms (medians)"]
    return "\n".join(lines)


def format_shared_prefix(report: dict) -> str:
    wl, s = report["workload"], report["shared_prefix"]
    lines = [
        f"NOTE: {report['note']}",
        f"model: {s['model']['summary']}; {report['device']} {report['dtype']}, {report['threads']} threads",
        f"workload: {wl['prompts']} prompts x n={wl['n']} against {wl['prompts'] * wl['n']} distinct prompts, "
        f"{s['prompt_tokens']} prompt tokens, {wl['output_len']} new tokens each, {report['repeats']} repeats "
        "after warm-up",
        "step: a whole engine decode step, each step's minimum over the repeats, averaged over the steps",
        "",
        f"{'':<32}{'step ms':>10}{'mean batch':>12}  per repeat mean step ms",
    ]
    for name, step in s["steps"].items():
        lines.append(f"{name:<32}{step['decode_step_ms']:>10.3f}{step['mean_decode_batch']:>12.1f}  "
                     + " ".join(f"{x:.3f}" for x in step["all_step_ms"]))
    lines += [f"groups / distinct prompts: shared-prefix decode {s['shared_over_distinct']:.2f}x, "
              f"plain decode {s['plain_over_distinct']:.2f}x"]
    return "\n".join(lines)


def model_summary(model: VisionLanguageModel) -> dict:
    text = model.args.text
    params = sum(p.numel() for p in model.parameters())
    return {"hidden": text.hidden_size, "layers": text.num_hidden_layers, "heads": text.num_attention_heads,
            "kv_heads": text.num_key_value_heads, "vocab": text.vocab_size, "params": params,
            "summary": f"hidden {text.hidden_size}, {text.num_hidden_layers} layers, {text.num_attention_heads}/"
                       f"{text.num_key_value_heads} heads, vocab {text.vocab_size}, {params / 1e6:.2f}M params"}


def side_by_side(model: VisionLanguageModel, hf, requests: list[Request], wl: Workload, a: argparse.Namespace,
                 device: torch.device) -> dict:
    """The throughput comparison: both sides' results, their ratio and the engine's stats."""
    engine = make_engine(model, requests, wl, a)
    batches = hf_batches(requests, wl.batch_size, model.args, hf.generation_config.pad_token_id, a.device)
    rollplex, transformers = compare(engine, requests, hf, batches, wl, a.repeats, device)
    expected = wl.prompts * wl.n * wl.output_len
    if not wl.stop_tokens and (rollplex.output_tokens != expected or transformers.output_tokens != expected):
        raise RuntimeError(f"output tokens differ from the workload's {expected}: rollplex "
                           f"{rollplex.output_tokens}, transformers {transformers.output_tokens}")
    result = {"engine_max_model_len": engine.max_model_len, "max_model_len_option": a.max_model_len,
              "rollplex": asdict(rollplex), "transformers": asdict(transformers),
              "ratio": rollplex.tokens_per_s / transformers.tokens_per_s, "engine_stats": dict(engine.stats)}
    engine.release_kv()  # (on CUDA its graphs go with the engine when this returns)
    return result


def comparison_report(a: argparse.Namespace, wl: Workload, device: torch.device, dtype: torch.dtype) -> dict:
    """The engine against transformers on one model (and, on CUDA, the decode step against its floor)."""
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        path = build_checkpoint(Path(tmp), a, a.layers)
        model = from_pretrained(path, dtype=dtype, device=device)
        hf = load_transformers(path, dtype, a.device)
        requests = build_requests(path, model, wl)
    report: dict[str, Any] = {
        "model": model_summary(model),
        "mean_prompt_tokens": statistics.mean(len(r.prompt.input_ids) for r in requests),
        "image_tokens_per_prompt": int((requests[0].prompt.input_ids == model.args.image_token_id).sum()),
        **side_by_side(model, hf, requests, wl, a, device),
    }
    del hf  # free its memory before the decode measurement
    if device.type == "cuda":
        report["cuda_decode"] = decode_step_report(model, requests, wl, a, device)
    return report


def build_requests(path: Path, model: VisionLanguageModel, wl: Workload) -> list[Request]:
    return processor_requests(path, wl) if wl.prompt_source == "processor" else random_requests(model, wl)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table, write --json; return the report."""
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    wl = workload_of(a)
    report: dict[str, Any] = {
        "note": RANDOM_WEIGHTS_NOTE,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "run_ahead": not a.no_run_ahead, "workload": asdict(wl), "stop_token_ids": wl.stop_ids, "repeats": a.repeats,
    }
    if a.host_overhead:
        report["host_overhead"] = host_overhead_report(a, wl, device, dtype)
    elif a.shared_prefix:
        report["shared_prefix"] = shared_prefix_report(a, wl, device, dtype)
    else:
        report.update(comparison_report(a, wl, device, dtype))
    print(format_report(report))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.json}")
    return report


if __name__ == "__main__":
    main()
