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

    python tools/bench_packed_train.py --lora-rank 16   # a trainer's step, full fine-tuning against LoRA

With --lora-rank, the same groups make one optimizer step of the trainer instead
(`lora_against_full`): the model as rollplex.rl.loop holds it for one process
(fp32 masters; with LoRA, adapters of that rank on every Linear of the language
model and the base frozen in the compute dtype), activation checkpointing, FSDP2 on
a mesh of one, the Actor's update (micro-batches of its default token budget, AdamW), first with full
fine-tuning, then with LoRA: each step's time and peak memory side by side, and
what LoRA must keep (the frozen base's bits) and change (its adapters).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: the repository's rollplex

from bench_train_attention import available_backends  # noqa: E402
from rollplex.config.sections import LoRAConfig  # noqa: E402
from rollplex.dist import ParallelDims, build_mesh, init_distributed, local_tensor  # noqa: E402
from rollplex.models import build_model  # noqa: E402
from rollplex.models.inputs import Group, Prompt, Sample  # noqa: E402
from rollplex.models.packing import pack_groups  # noqa: E402
from rollplex.models.qwen2_5_vl import ModelArgs, TextArgs, VisionArgs  # noqa: E402
from rollplex.train.actor import Actor, ActorConfig, PolicyBatch, batch_to  # noqa: E402
from rollplex.train.flops import forward_flops, peak_flops  # noqa: E402
from rollplex.train.logprob_head import token_logprobs  # noqa: E402
from rollplex.train.lora import LoRALinear, is_adapter  # noqa: E402
from rollplex.train.parallelize import parallelize  # noqa: E402

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


STEP_LR = 1e-3
"""The trainer steps' learning rate. The time and memory of a step do not depend on it; it is large enough
that a step reaching LoRA's frozen bf16 base would change its bits (AdamW's first step moves a weight by
about lr; a bf16 ulp at the weights' std, 0.02, is 1.2e-4)."""


def trainer_steps(args: ModelArgs, groups: list[Group], device: torch.device, lora: LoRAConfig | None,
                  steps: int) -> dict:
    """Optimizer steps of a one-process trainer on `groups` (the process group must exist: init_distributed).

    The model (random weights, seed 0) is loaded as rollplex.rl.loop loads it, in fp32 masters, or with
    `lora` in the compute dtype (bf16 on CUDA), which its frozen base keeps; `parallelize` puts the
    adapters on, activation checkpointing (so that the weights and AdamW's state make the peak, not the
    activations of the larger micro-batch, which would blur the two runs' difference) and FSDP2 over a
    mesh of one; the Actor trains what requires grad with AdamW. A warm-up step (it allocates AdamW's
    moments), then `steps` timed ones. Reports the median step's seconds and, on CUDA, the peak allocated
    during the timed steps and what stays allocated after them (weights and moments), both above what was
    allocated before the model; the parameters AdamW trains and the GiB of their fp32 masters, gradients
    and moments (`state_gib`). With `lora` also: the adapters' parameter count, the base's (every parameter
    but the adapters) size and dtypes, whether it is bitwise the base a fresh build gives (no step, nor the
    parallelization, wrote it) and whether every adapter's B, zero at first, moved."""
    cuda = device.type == "cuda"
    compute = torch.bfloat16 if cuda else torch.float32
    before = torch.cuda.memory_allocated(device) if cuda else 0
    model = build_model(args, dtype=compute if lora else torch.float32, device=device, seed=0)
    model.set_attn_backend("auto")
    parallelize(model, build_mesh(ParallelDims.resolve(1, -1, 1), device.type), activation_checkpointing=True,
                compute_dtype=compute, lora=lora)
    actor = Actor(model, ActorConfig(lr=STEP_LR))
    n = sum(len(g.responses) for g in groups)
    # GRPO's advantages are centred in each group: half the responses up, half down.
    batch = PolicyBatch(groups, [(-1.0) ** i for i in range(n)], actor.logprobs(model, groups))
    actor.update(batch)  # warm-up
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds, metrics = [], {}
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        metrics = actor.update(batch)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    gib = lambda b: b / 2**30  # noqa: E731
    result = {"step_s": statistics.median(seconds), "micro_batches": len(actor.micro_batches(groups)),
              "peak_gib": gib(torch.cuda.max_memory_allocated(device) - before) if cuda else None,
              "held_gib": gib(torch.cuda.memory_allocated(device) - before) if cuda else None,
              **_trained(actor.optimizer), "grad_norm": metrics["actor/grad_norm"],
              "skipped_steps": actor.skipped_steps}
    if lora:
        adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
        base = {name.replace(_CHECKPOINT_PREFIX, ""): local_tensor(p) for name, p in model.named_parameters()
                if not is_adapter(name)}
        built = dict(build_model(args, dtype=compute, device=device, seed=0).named_parameters())
        result.update(adapter_params=sum(m.lora_A.numel() + m.lora_B.numel() for m in adapters),
                      base_params=sum(p.numel() for p in base.values()),
                      base_dtypes=sorted({str(p.dtype) for p in base.values()}),
                      base_unchanged=all(torch.equal(p, built[name]) for name, p in base.items()),
                      adapters_moved=all(bool(local_tensor(m.lora_B).count_nonzero()) for m in adapters))
    return result


def _trained(optimizer: torch.optim.Optimizer) -> dict:
    """The parameters `optimizer` holds state for (those that got gradients) and the GiB of their masters,
    gradients (as large as the masters) and state."""
    def nbytes(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    params = state_bytes = 0
    for p, state in optimizer.state.items():
        params += p.numel()
        state_bytes += 2 * nbytes(p) + sum(nbytes(v) for v in state.values() if torch.is_tensor(v))
    return {"trained_params": params, "state_gib": state_bytes / 2**30}


def lora_against_full(args: ModelArgs, groups: list[Group], device: torch.device, rank: int, steps: int) -> dict:
    """`trainer_steps` with full fine-tuning, then with LoRA of `rank` on every Linear of the language model
    (LoRAConfig's defaults otherwise), one after the other in this process (a group of one is formed unless
    one exists), each model freed before the next is built. Adds LoRA over full of the step time and, on
    CUDA, of the peak, the peak bytes LoRA saved, and `base_state_gib`: the fp32 masters, gradients and
    AdamW moments that full fine-tuning's trained parameters take beyond LoRA's, which the frozen base no
    longer needs."""
    init_distributed(str(device))
    runs = {}
    for name, lora in (("full", None), ("lora", LoRAConfig(rank=rank))):
        runs[name] = trainer_steps(args, groups, device, lora, steps)
        gc.collect()  # FSDP's hooks hold the model in reference cycles: free it before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()  # and give its memory back to the checks that follow
    full, lora = runs["full"], runs["lora"]
    result = {**runs, "rank": rank, "adapter_params": lora["adapter_params"],
              "step_ratio": lora["step_s"] / full["step_s"], "base_state_gib": full["state_gib"] - lora["state_gib"]}
    if full["peak_gib"] is not None:
        result.update(peak_ratio=lora["peak_gib"] / full["peak_gib"],
                      peak_saved_gib=full["peak_gib"] - lora["peak_gib"])
    return result


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
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="time a trainer's step, full fine-tuning against LoRA of this rank (0: the passes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model_args = ModelArgs(vision=VisionArgs(), text=TextArgs()) if cuda else small_args()
    groups = groups_of(args.groups, args.members, args.prompt, args.max_response, model_args.text.vocab_size)
    if args.lora_rank:
        print_lora_against_full(lora_against_full(model_args, groups, device, args.lora_rank, steps=2 if cuda else 1))
        return
    model = build_model(model_args, dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    result = timed_passes(model, groups, working_backends(device), repeats=3 if cuda else 1)
    print(f"{result['tokens']} tokens ({result['response_tokens']} response), {result['pass_tflop']:.1f} TFLOP a pass")
    for name in working_backends(device):
        if name in result:
            r = result[name]
            mfu = f"  MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            print(f"{name:>8}  {r['pass_ms']:9.1f} ms  {r['tokens_per_s']:9.0f} tokens/s{mfu}")


def print_lora_against_full(result: dict) -> None:
    gib = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"{'':>6}  {'step s':>8}  {'peak GiB':>9}  {'held GiB':>9}  {'trained':>13}  {'state GiB':>9}")
    for name in ("full", "lora"):
        r = result[name]
        print(f"{name:>6}  {r['step_s']:8.3f}  {gib(r['peak_gib']):>9}  {gib(r['held_gib']):>9}  "
              f"{r['trained_params']:13,}  {r['state_gib']:9.2f}")
    lora = result["lora"]
    peak = (f", peak {result['peak_ratio']:.2f}x ({result['peak_saved_gib']:.2f} GiB saved)"
            if "peak_ratio" in result else "")
    print(f"LoRA rank {result['rank']}: {result['adapter_params']:,} adapter parameters; step "
          f"{result['step_ratio']:.2f}x full's{peak}; the base's masters, gradients and moments: "
          f"{result['base_state_gib']:.2f} GiB; base unchanged: {lora['base_unchanged']}, adapters moved: "
          f"{lora['adapters_moved']}")


if __name__ == "__main__":
    main()
