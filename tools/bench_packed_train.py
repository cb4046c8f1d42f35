"""A whole model's training pass over packed GRPO groups, per attention backend, against bf16 peak.

    python tools/bench_packed_train.py            # 3B shapes on CUDA (random weights), a small model on CPU

One pass is what the actor's update runs for a micro-batch: the shared-prefix
forward of text-only groups [prompt | response_1 | ... | response_n]
(rollplex.models.packing.pack_groups), the chunked logprob head over the response
tokens, and the backward. It runs once per attention backend that works on the
device ("torch": one SDPA call per (length, prefix) of the segments; "flex" and
"varlen": one kernel call per layer; "flash" when flash-attn is installed), on the
same weights and batch, so the times are side by side. Each pass's matmul FLOPs
(rollplex.train.flops: three times the forward's) over its time, divided by the
device's dense bf16 peak, is its MFU. CUDA: the median of three passes after one
warm-up pass (which also compiles FlexAttention); CPU: one pass after the warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_train_attention import available_backends
from rollplex.models import build_model
from rollplex.models.inputs import Group, Prompt, Sample
from rollplex.models.packing import pack_groups
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs
from rollplex.train.actor import batch_to
from rollplex.train.flops import forward_flops, peak_flops
from rollplex.train.logprob_head import token_logprobs

def groups_of(num_groups: int, members: int, prompt_len: int, max_response: int, vocab: int) -> list[Group]:
    """Text-only groups: responses of lengths spread over [max_response / 4, max_response], as RL's vary."""
    g = torch.Generator().manual_seed(0)
    groups = []
    for i in range(num_groups):
        prompt = Prompt(torch.randint(10, vocab - 10, (prompt_len,), generator=g))
        lengths = torch.randint(max(1, max_response // 4), max_response + 1, (members,), generator=g).tolist()
        samples = [Sample(torch.randint(10, vocab - 10, (n,), generator=g).tolist(), [0.0] * n, "length")
                   for n in lengths]
        groups.append(Group(prompt, samples))
    return groups


def working_backends(device: torch.device) -> list[str]:
    """The attention backends that train on this device (bench_train_attention.available_backends)."""
    return [name for name, unavailable in available_backends(device).items() if unavailable is None]


def timed_passes(model, groups: list[Group], backends: list[str], repeats: int) -> dict:
    """Per backend: seconds per training pass (median of `repeats`), tokens per second and MFU."""
    device = model.device
    batch = batch_to(pack_groups(model.args, groups, share_prefix=True), device)
    targets, index = batch.target_ids, batch.target_index
    flops = 3 * forward_flops(model.args, batch)
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    tokens = int(batch.packed.input_ids.numel())
    result: dict = {"tokens": tokens, "response_tokens": int(targets.numel()), "pass_tflop": flops / 1e12}

    def one_pass() -> float:
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        hidden = model.forward_packed(batch.packed)[index]
        logprobs, _ = token_logprobs(model, hidden, targets)
        logprobs.sum().backward()
        _sync(device)
        return time.perf_counter() - start

    for name in backends:
        model.set_attn_backend(name)
        one_pass()  # warm-up (and compilation)
        seconds = statistics.median(one_pass() for _ in range(repeats))
        result[name] = {"pass_ms": seconds * 1e3, "tokens_per_s": tokens / seconds,
                        "mfu": flops / seconds / peak if peak else None}
    return result  # the last pass's gradients stay on the model, for the caller to check


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def small_args() -> ModelArgs:
    """A 2-layer stand-in with the 3B model's head layout ratios (CPU runs)."""
    return ModelArgs(vision=VisionArgs(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
                     text=TextArgs(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=1, mrope_section=[2, 3, 3]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model_args = ModelArgs(vision=VisionArgs(), text=TextArgs()) if cuda else small_args()
    model = build_model(model_args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    groups = groups_of(args.groups, args.members, args.prompt, args.max_response, model_args.text.vocab_size)
    result = timed_passes(model, groups, working_backends(device), repeats=3 if cuda else 1)
    print(f"{result['tokens']} tokens ({result['response_tokens']} response), {result['pass_tflop']:.1f} TFLOP a pass")
    for name in working_backends(device):
        if name in result:
            r = result[name]
            mfu = f"  MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            print(f"{name:>8}  {r['pass_ms']:9.1f} ms  {r['tokens_per_s']:9.0f} tokens/s{mfu}")


if __name__ == "__main__":
    main()
