"""Step time of the RL schedules on one workload, side by side.

    python tools/bench_schedules.py --config configs/bench_h200_video.yaml --steps 3 --no-trace  # one H200
    python tools/bench_schedules.py --steps 8 --data.task direction --data.num_frames 16 --data.image_size 112 \\
        --data.batch_size 4 --rollout.n 4 --rollout.min_tokens 8 --rollout.max_tokens 16 --rollout.ignore_eos true \\
        --algorithm.kl_coef 0.01 --rollout.kv_cache_memory 64e6                               # CPU, ~1 min
    torchrun --nproc-per-node 8 tools/bench_schedules.py --config configs/bench_h200_video.yaml --steps 3  # + disagg

Any other `--section.field value` goes to every schedule's config (see
`python train.py --help`). Each schedule gets a fresh trainer (build_trainer) from the same
config and seeds, in this process, so it sees the same prompts and samples:

    serial-naive   --schedule.kind serial --schedule.share_prefix false
    serial-prefix  --schedule.kind serial --schedule.share_prefix true
    overlap        --schedule.kind overlap
    overlap-stream --schedule.kind overlap --schedule.stream_groups true
    disagg         --schedule.kind disagg --schedule.rollout_ranks N//2     (only under torchrun, N >= 2 ranks)

`--schedules NAME ...` runs those, in that order (default: all of them). A
ratio is reported where both its schedules ran.

Under torchrun every rank runs the same schedules, each trainer built
collectively: the colocated three on all N ranks (dp_shard = N unless
--parallel.* says otherwise), disagg with its last N//2 ranks generating and the
first N - N//2 training (rollplex/rl/disagg.py). perf/throughput is tokens per
second per rank (GPU) in every schedule, disagg included (its idle rollout
ranks count), so the ratios compare equal GPU counts. Rank 0, always a trainer,
prints and writes every file; the other ranks write nothing.

Per schedule: 1 warm-up step (not counted), `--steps` measured steps, then one
more step under torch.profiler (not counted either: the profiler slows it)
whose Chrome trace (rank 0's) is written. `--out` gets report.json (rewritten
after every schedule, so a run cut short keeps the schedules it finished),
trace_<schedule>.json.gz and timeline.png (engine steps and prompt-work slices of
the last measured step; disagg's rank 0 runs no engine, so its panel shows only
the rollout ranks' gen phase, taken from the step's metrics; `--no-timeline`
skips it). Before each step
the CUDA cache is emptied, so the prefix budget (read from free device memory)
is the same in every step. On CPU give --rollout.kv_cache_memory in bytes: the
default fraction of free RAM makes every rollout zero-fill gigabytes of KV pool.

Beside each schedule's measured peaks (CUDA) the memory plan the loop logs is
printed (perf/planned_memory_gb/<phase>, perf/memory_plan_error/<phase>).

Every step's sampled token ids, over all ranks, are hashed (`sample_digests` per
schedule in report.json), and the tool reports whether every schedule sampled
the same tokens at every step (`same_samples`). Sampling is seeded, so they
must wherever the weights are the same: on the CPU at every step; on CUDA at the
warm-up step, and at every step with --trainer.lr 0 (after an update the
weights differ in their last bits, the embedding's backward summing with
atomics, and a sampled token can move).

On CUDA each step also gets `timing_s/gen_gpu`, the gen phase's GPU time from
events, and the ratios add `decode_slowdown_gpu` (overlap's against
serial-prefix's, and `_overlap_stream` for overlap-stream's: the contention the
side stream costs decode). A run with serial-prefix
reports the shares of its step that the decode window can take:
`prompt_work_share_serial_prefix`, its prompt work after rollout (what overlap
hides), and `finished_group_work_share_serial_prefix`, its finished groups'
work (reward, reference and old logprobs, the first optimizer step:
timing_s/stream_exposed), what overlap-stream hides besides. Their sum is the
most those two schedules can gain.

The model has random weights: only the timings mean anything.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.config import config_to_dict, load_config  # noqa: E402
from rollplex.dist import all_gather_objects  # noqa: E402
from rollplex.rl.loop import RLTrainer  # noqa: E402
from rollplex.rl.trainer import build_trainer  # noqa: E402

SCHEDULES = {  # colocated: every rank rolls out and trains
    "serial-naive": ["--schedule.kind", "serial", "--schedule.share_prefix", "false"],
    "serial-prefix": ["--schedule.kind", "serial", "--schedule.share_prefix", "true"],
    "overlap": ["--schedule.kind", "overlap"],
    "overlap-stream": ["--schedule.kind", "overlap", "--schedule.stream_groups", "true"],
}
PHASES = ("gen", "prefix", "ref", "old_log_prob", "update_actor")
PLANNED_PHASES = ("gen", "update_actor")  # the phases the loop's memory plan is logged for
RANDOM_NOTE = "weights are random: the figures are timings only"
CPU_NOTE = ("on CPU there is no side stream: overlap runs its prompt-work slices inline between decode steps, "
            "so it does the same work as serial-prefix and no overlap gain is expected")
CPU_RANKS_NOTE = ("on CPU the ranks are processes sharing this machine's cores and talking through gloo: "
                  "a per-GPU comparison in form only")
DISAGG_NOTE = ("disagg: perf/throughput is tokens / step time / all ranks (rollout and trainer), the per-GPU "
               "definition of the other schedules, so its ratios compare equal GPU counts")
DISAGG_PLAN_NOTE = "disagg: no plan (the memory plan models colocated ranks)"
KIND_COLOURS = {"vision": "tab:purple", "ref": "tab:orange", "actor": "tab:green", "old": "tab:red",
                # the finished groups' work (overlap-stream): rollplex.rl.schedules.overlap_stream
                "group reward": "tab:brown", "group ref": "tab:olive", "group old": "tab:pink",
                "group update": "tab:cyan"}


def schedules(world: int) -> dict[str, list[str]]:
    """The schedules run at this world size: the colocated three, and disagg from 2 ranks
    (the last world // 2 ranks generate, the rest train)."""
    out = dict(SCHEDULES)
    if world >= 2:
        out["disagg"] = ["--schedule.kind", "disagg", "--schedule.rollout_ranks", str(world // 2)]
    return out


class Recorder:
    """Host timestamps of one trainer's rollouts: the gen phase, vision encodes,
    each engine step, and the step's PromptWorkScheduler (its slices)."""

    def __init__(self, trainer: RLTrainer):
        self.steps: list[dict] = []
        self.cuda = trainer.device.type == "cuda"
        rollout, encode, generate = trainer.rollout, trainer.encode, trainer.engine.generate

        def recording_rollout(*args, **kwargs):
            rec = {"start": time.perf_counter(), "vision": [], "engine": [], "prefix": None, "stream": None}
            self.steps.append(rec)
            result = rollout(*args, **kwargs)
            rec["end"] = time.perf_counter()
            rec["prefix"] = result.prompt_work  # its spans fill in later too (serial drains after gen): see finish()
            rec["stream"] = result.stream
            return result

        def recording_encode(*args, **kwargs):
            start = time.perf_counter()
            out = encode(*args, **kwargs)
            if self.steps:
                self.steps[-1]["vision"].append(("vision", start, time.perf_counter()))
            return out

        def recording_generate(requests, params, between_steps=None, on_finished=None):
            engine = self.steps[-1]["engine"] if self.steps else []
            last = [time.perf_counter()]

            def after_step(running: int) -> None:  # an engine step ended; prompt-work slices (overlap) follow
                engine.append((last[0], time.perf_counter()))
                if between_steps is not None:
                    between_steps(running)
                last[0] = time.perf_counter()

            # GPU time of the generation (prefill + decode), from events on the caller's stream, which the
            # engine orders around its own decode stream; the side stream's prompt-work slices are not waited for.
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
            if events:
                events[0].record()
            out = generate(requests, params, after_step, on_finished)
            engine.append((last[0], time.perf_counter()))
            if events and self.steps:
                events[1].record()
                self.steps[-1]["gen_events"] = events
            return out

        trainer.rollout, trainer.encode, trainer.engine.generate = recording_rollout, recording_encode, recording_generate

    def finish(self) -> float | None:
        """After the step: keep the scheduler's timestamps, drop the scheduler (it holds the kept K/V).
        Returns the gen phase's GPU time in seconds (CUDA), else None."""
        rec = self.steps[-1]
        events = rec.pop("gen_events", None)
        prefix, stream = rec.pop("prefix"), rec.pop("stream")
        rec["spans"] = (list(prefix.spans) if prefix is not None else []) + \
            (list(stream.spans) if stream is not None else [])
        rec["step_ends"] = list(prefix.step_ends) if prefix is not None else []
        if events is None:
            return None
        events[1].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3

    def timeline(self, index: int) -> dict:
        """Step `index`'s timeline, seconds from its rollout start."""
        rec = self.steps[index]
        t0 = rec["start"]
        return {"gen_end": rec["end"] - t0,
                "engine_steps": [(a - t0, b - t0) for a, b in rec["engine"]],
                "prefix_spans": [(kind, a - t0, b - t0) for kind, a, b in rec["vision"] + rec["spans"]],
                "scheduler_step_ends": [t - t0 for t in rec["step_ends"]]}


class SampleDigests:
    """The hash of each step's sampled token ids, over every rank: each rank keeps the
    token ids of its rollout's groups (a disagg rollout rank keeps none: the trainer
    ranks hold every group), and `step_digest` hashes them all by prompt index."""

    def __init__(self, trainer: RLTrainer):
        self.world = trainer.world
        self.mine: dict[int, list[list[int]]] = {}
        rollout_phase = trainer._rollout_phase

        def recording_rollout_phase(*args, **kwargs):
            state = rollout_phase(*args, **kwargs)  # not called on a disagg rollout rank
            rollout = state.rollout
            self.mine = {e.index: [s.token_ids for s in g.samples] for e, g in zip(rollout.examples, rollout.groups)}
            return state

        trainer._rollout_phase = recording_rollout_phase

    def step_digest(self) -> str:
        """The last step's digest; collective under torchrun (every rank calls it after the step)."""
        groups: dict[int, list[list[int]]] = {}
        for part in all_gather_objects(self.mine) if self.world > 1 else [self.mine]:
            groups.update(part)
        self.mine = {}
        return digest(groups)


def digest(groups: dict[int, list[list[int]]]) -> str:
    """A short hash of each prompt's samples' token ids, in prompt index order."""
    h = hashlib.sha256()
    for index in sorted(groups):
        for tokens in groups[index]:
            h.update(f"{index}:{','.join(map(str, tokens))};".encode())
    return h.hexdigest()[:16]


def run_schedule(name: str, overrides: list[str], base_argv: list[str], steps: int, out: Path, trace: bool,
                 batches: list) -> dict | None:
    """Run one schedule on this rank (every rank calls it: the trainer is built and
    stepped collectively). Returns the schedule's results on rank 0, None elsewhere."""
    cfg = load_config(base_argv + overrides)
    load_before = os.getloadavg()[0]  # others' load on the machine skews a sequential comparison
    trainer = build_trainer(cfg)
    lead = trainer.rank == 0  # rank 0 trains in every schedule (disagg's rollout ranks are the last ones)
    cuda = trainer.device.type == "cuda"
    # Host timestamps of rank 0's rollouts; a disagg trainer rank has no engine and rolls nothing out.
    recorder = Recorder(trainer) if lead and trainer.engine is not None else None
    digests = SampleDigests(trainer)
    source = trainer._batches(0)
    rows, sample_digests = [], []
    # The objects so far (the trainer's and the imports', ~400k) out of every later collection: a full
    # gc.collect() then takes ms, not ~0.2 s, and an automatic one cannot land inside a timed step. Under
    # torchrun that matters twice: one rank's collection before a step is another's wait inside it.
    gc.collect()
    gc.freeze()
    try:
        for i in range(1 + steps + trace):
            if i == len(batches):  # the same prompts for every schedule; made once
                batches.append(next(source))
            trainer.step = i + 1  # as fit() numbers steps (the sampling seeds depend on it)
            gc.collect()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            if trace and i == steps + 1 and lead:  # the profiler trace is rank 0's
                activities = [torch.profiler.ProfilerActivity.CPU] + \
                    ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
                with torch.profiler.profile(activities=activities) as prof:
                    metrics = trainer.train_step(batches[i])
                prof.export_chrome_trace(str(out / f"trace_{name}.json.gz"))
            else:
                metrics = trainer.train_step(batches[i])  # {} on a disagg rollout rank
            row = {k: float(v) for k, v in metrics.items()}
            if recorder is not None:
                gen_gpu = recorder.finish()
                if gen_gpu is not None:
                    row["timing_s/gen_gpu"] = gen_gpu
            rows.append(row)
            sample_digests.append(digests.step_digest())
            if lead:
                print(f"  {name} step {i} ({'warm-up' if i == 0 else 'traced' if i > steps else 'measured'}): "
                      f"{metrics['timing_s/step']:.3f} s", flush=True)
    finally:
        gc.unfreeze()
    result = None
    if lead:
        result = {"overrides": overrides, "config": config_to_dict(cfg), "world_size": trainer.world,
                  "warmup": rows[0], "steps": rows[1:1 + steps], "traced": rows[1 + steps] if trace else None,
                  "mean": _mean(rows[1:1 + steps]), "sample_digests": sample_digests,
                  "timeline": recorder.timeline(steps) if recorder is not None else metrics_timeline(rows[steps]),
                  "trace": f"trace_{name}.json.gz" if trace else None, "device": str(trainer.device),
                  "loadavg_1min": [load_before, os.getloadavg()[0]]}
    trainer.logger.close()
    del trainer, recorder
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def metrics_timeline(m: dict) -> dict:
    """disagg, on a trainer rank: the step's timeline from its metrics alone, seconds from
    the end of the weight broadcast (about when the rollout ranks start generating):
    the broadcast before it, the rollout ranks' gen phase (the slowest replica's), and
    gen_end, when the samples reached the trainers. No engine steps or prompt work."""
    return {"gen_end": m["timing_s/train_idle"], "engine_steps": [], "prefix_spans": [], "scheduler_step_ends": [],
            "from_metrics": True, "update_weights": [-m.get("timing_s/update_weights", 0.0), 0.0],
            "rollout_gen": [0.0, m["timing_s/gen"]]}


def _mean(rows: list[dict]) -> dict:
    keys = set.intersection(*(set(r) for r in rows))
    return {k: sum(r[k] for r in rows) / len(rows) for k in sorted(keys)}


# (numerator, denominator): perf/throughput ratios, reported where both schedules ran
THROUGHPUT_RATIOS = (("overlap", "serial-naive"), ("overlap", "serial-prefix"), ("serial-prefix", "serial-naive"),
                     ("overlap-stream", "serial-prefix"), ("disagg", "overlap"), ("disagg", "serial-naive"))


def _key(schedule: str) -> str:
    return schedule.replace("-", "_")


def ratios(results: dict) -> dict:
    """The ratios of the schedules that ran: throughput_<a>_over_<b> (THROUGHPUT_RATIOS) and,
    against serial-prefix, the decode slowdown of each decode-window schedule (overlap's as
    decode_slowdown, overlap-stream's with the suffix _overlap_stream) and the shares of
    serial-prefix's step that the decode window can take."""
    tput = {n: r["mean"]["perf/throughput"] for n, r in results.items()}
    out = {f"throughput_{_key(a)}_over_{_key(b)}": tput[a] / tput[b]
           for a, b in THROUGHPUT_RATIOS if a in tput and b in tput}
    if "serial-prefix" not in results:
        return out
    p = results["serial-prefix"]["mean"]
    for name in ("overlap", "overlap-stream"):
        if name not in results:
            continue
        o, suffix = results[name]["mean"], "" if name == "overlap" else f"_{_key(name)}"
        # decode of the step (its gen phase without the prompt work it left exposed) against the
        # decode-only gen phase of serial-prefix (same vision encode, same samples, no slices)
        out[f"decode_slowdown{suffix}"] = (o["timing_s/gen"] - o.get("timing_s/prefix_exposed", 0.0)) / \
            p["timing_s/gen"] - 1
        if "timing_s/gen_gpu" in o and "timing_s/gen_gpu" in p:  # CUDA: the decode contention itself
            out[f"decode_slowdown_gpu{suffix}"] = o["timing_s/gen_gpu"] / p["timing_s/gen_gpu"] - 1
    # the most overlap can gain: serial-prefix's prompt work after rollout, as a share of its step
    out["prompt_work_share_serial_prefix"] = p.get("timing_s/prefix", 0.0) / p["timing_s/step"]
    # what overlap-stream can hide besides: serial-prefix's finished groups' work after decode
    out["finished_group_work_share_serial_prefix"] = p.get("timing_s/stream_exposed", 0.0) / p["timing_s/step"]
    return out


def same_samples(results: dict) -> tuple[bool, list[str]]:
    """Whether every schedule sampled the same token ids at every step (their digests), and a line per step."""
    runs = {n: r["sample_digests"] for n, r in results.items()}
    ok, lines = True, []
    for i, step in enumerate(zip(*runs.values())):
        match = len(set(step)) == 1
        ok &= match
        lines.append(f"  step {i}: " + "  ".join(f"{n} {d}" for n, d in zip(runs, step))
                     + ("  match" if match else "  MISMATCH"))
    return ok, lines


def print_table(results: dict, r: dict, cuda: bool) -> None:
    cols = ("step s", *PHASES, "gen gpu s", "tok/s", "hidden", "exposed", "ovl eff", "deferred", "grp hidden",
            "grp exposed")
    print(f"{'schedule':<14}" + "".join(f"{c:>13}" for c in cols))
    for name, res in results.items():
        m = res["mean"]
        values = [m["timing_s/step"], *(m.get(f"timing_s/{p}") for p in PHASES), m.get("timing_s/gen_gpu"),
                  m["perf/throughput"],
                  m.get("timing_s/prefix_hidden"), m.get("timing_s/prefix_exposed"), m.get("perf/overlap_efficiency"),
                  m.get("prefix/deferred_items"), m.get("timing_s/stream_hidden"), m.get("timing_s/stream_exposed")]
        print(f"{name:<14}" + "".join(f"{'-':>13}" if v is None else f"{v:>13.4g}" for v in values))
    if "disagg" in results:
        m = results["disagg"]["mean"]
        print(f"disagg per step: weights broadcast {m.get('timing_s/update_weights', 0.0):.4g} s, "
              f"rollout ranks idle {m['timing_s/rollout_idle']:.4g} s, "
              f"trainer ranks idle (waiting for samples) {m['timing_s/train_idle']:.4g} s "
              f"(gen above: the slowest rollout replica's)")
    print_memory(results, cuda)
    print_ratios(r)


def print_ratios(r: dict) -> None:
    """The ratios `ratios` found, one a line."""
    for a, b in THROUGHPUT_RATIOS:
        value = r.get(f"throughput_{_key(a)}_over_{_key(b)}")
        if value is not None:
            note = "  (per GPU, equal GPU count)" if a == "disagg" else ""
            print(f"throughput {a} / {b}".ljust(44) + f"{value:.3f}{note}")
    for name, suffix in (("overlap", ""), ("overlap-stream", "_overlap_stream")):
        if f"decode_slowdown{suffix}" in r:
            print(f"decode slowdown ({name} gen - exposed) / serial-prefix gen - 1  "
                  f"{r[f'decode_slowdown{suffix}']:+.3f}")
        if f"decode_slowdown_gpu{suffix}" in r:
            print(f"decode slowdown on the GPU (events): {name} gen / serial-prefix gen - 1  "
                  f"{r[f'decode_slowdown_gpu{suffix}']:+.3f}")
    if "prompt_work_share_serial_prefix" in r:
        print(f"prompt work share of the serial-prefix step (the most overlap can hide)  "
              f"{r['prompt_work_share_serial_prefix']:.3f}")
        print(f"finished groups' work share of the serial-prefix step (what overlap-stream can hide besides)  "
              f"{r['finished_group_work_share_serial_prefix']:.3f}")


def print_memory(results: dict, cuda: bool) -> None:
    """Per schedule: the loop's planned per-GPU figures; on CUDA also the measured peaks per
    phase and the plan's error (measured / planned - 1)."""
    def phase_values(m: dict, prefix: str) -> dict:
        return {k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)}

    if cuda:
        print("memory per GPU, GiB (planned: the loop's memory plan; measured: peak allocated per phase; "
              "error: measured / planned - 1):")
    else:
        print("memory per GPU, GiB (planned: the loop's memory plan; no measured peaks on CPU):")
    for name, res in results.items():
        m = res["mean"]
        planned = phase_values(m, "perf/planned_memory_gb/")
        line = f"  {name:<15}planned " + ("  ".join(f"{p} {planned[p]:.3g}" for p in PLANNED_PHASES if p in planned)
                                          or "-")
        if cuda:
            measured = phase_values(m, "perf/max_memory_allocated_gb/")
            errors = phase_values(m, "perf/memory_plan_error/")
            line += "   measured " + "  ".join(f"{p} {v:.3g}" for p, v in measured.items())
            line += "   error " + ("  ".join(f"{p} {errors[p]:+.1%}" for p in PLANNED_PHASES if p in errors) or "-")
        print(line)
    if "disagg" in results:
        print(f"  note: {DISAGG_PLAN_NOTE}")


def plot_timeline(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no timeline.png")
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.6 * len(results) + 0.8), sharex=True, squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        t = res["timeline"]
        if t.get("from_metrics"):
            _plot_from_metrics(ax, name, res)
            continue
        steps = t["engine_steps"]
        ax.broken_barh([(a, b - a) for a, b in steps[0::2]], (1.1, 0.8), color="tab:blue")
        ax.broken_barh([(a, b - a) for a, b in steps[1::2]], (1.1, 0.8), color="lightsteelblue")
        for kind, colour in KIND_COLOURS.items():
            ax.broken_barh([(a, b - a) for k, a, b in t["prefix_spans"] if k == kind], (0.1, 0.8), color=colour)
        if not t["prefix_spans"]:
            ax.text(0.01, 0.25, "no prompt work: every pass recomputes vision and prompt per sample",
                    transform=ax.transAxes, va="center", fontsize=8)
        ax.axvline(t["gen_end"], color="black", linestyle="--", linewidth=1)
        ax.set_yticks([0.5, 1.5], ["prefix", "engine"])
        ax.set_title(f"{name}: mean step {res['mean']['timing_s/step']:.3g} s, gen {res['mean']['timing_s/gen']:.3g} s; "
                     "below: the last measured step (dashed: end of its gen phase)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from rollout start (host clock; on CUDA: issue times)"
                           + ("; disagg: from the end of the weight broadcast" if "disagg" in results else ""))
    handles = [Patch(color="tab:blue", label="engine steps (alternate shades)")]
    handles += [Patch(color=c, label=f"prefix: {k}") for k, c in KIND_COLOURS.items()]
    if "disagg" in results:
        handles.append(Patch(color="tab:gray", label="disagg: weight broadcast"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_from_metrics(ax, name: str, res: dict) -> None:
    """disagg's panel: rank 0 trains and runs no engine, so only the step's metrics: the
    weight broadcast, the rollout ranks' gen phase and when the samples reached the trainers."""
    t, m = res["timeline"], res["mean"]
    (w0, w1), (g0, g1) = t["update_weights"], t["rollout_gen"]
    ax.broken_barh([(w0, w1 - w0)], (1.1, 0.8), color="tab:gray")
    ax.broken_barh([(g0, g1 - g0)], (1.1, 0.8), color="tab:blue")
    ax.text(0.01, 0.25, "rank 0 is a trainer (no engine): grey, the weight broadcast; blue, the rollout ranks' gen "
            "phase (slowest replica, from the metrics; no engine steps recorded); no prompt work",
            transform=ax.transAxes, va="center", fontsize=8)
    ax.axvline(t["gen_end"], color="black", linestyle="--", linewidth=1)
    ax.set_yticks([0.5, 1.5], ["prefix", "engine"])
    ax.set_title(f"{name}: mean step {m['timing_s/step']:.3g} s, gen {m['timing_s/gen']:.3g} s, idle: rollout ranks "
                 f"{m['timing_s/rollout_idle']:.3g} s, trainers {m['timing_s/train_idle']:.3g} s; below: the last "
                 "measured step (dashed: samples at the trainers)", fontsize=9, loc="left")


def main(argv: list[str] | None = None) -> dict:
    """Run the schedules; returns the report on rank 0 and {} on the other ranks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="other --section.field value options go to every schedule's config")
    parser.add_argument("--config", help="YAML config (default: the tiny demo preset)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per schedule (after 1 warm-up)")
    parser.add_argument("--schedules", nargs="+", metavar="NAME",
                        help="the schedules to run, in this order (default: every one this world size has)")
    parser.add_argument("--out", default="runs/bench_schedules", help="output folder")
    parser.add_argument("--no-trace", action="store_true", help="skip the profiled step and its Chrome trace")
    parser.add_argument("--no-timeline", action="store_true", help="skip timeline.png")
    opts, extra = parser.parse_known_args(argv)
    if opts.steps < 1:
        parser.error("--steps must be >= 1")
    # As rollplex.dist.init_distributed reads them (torchrun's variables); the trainers join the group.
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    available = schedules(world)
    unknown = [n for n in opts.schedules or () if n not in available]
    if unknown:
        parser.error(f"unknown schedule(s) {', '.join(unknown)} at {world} rank(s); they are: {', '.join(available)}")
    lead = rank == 0
    out = Path(opts.out)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    # Defaults first, so that the user's overrides win; the schedule's own go last.
    base = (["--config", opts.config] if opts.config else []) + [
        "--trainer.output_dir", str(out / "trainer"), "--trainer.eval_every", "0", "--trainer.save_every", "0",
        "--data.val_size", "1", "--logging.no_console", *extra]
    if lead:
        print(f"bench_schedules: {RANDOM_NOTE}" + (f"; {world} ranks" if world > 1 else ""))
    batches: list = []
    results, report = {}, {}
    for name in opts.schedules or available:
        if lead:
            print(f"{name}: {' '.join(available[name])}", flush=True)
        results[name] = run_schedule(name, available[name], base, opts.steps, out, not opts.no_trace, batches)
        if lead:  # after every schedule: a run cut short keeps what it measured
            report = make_report(results, sys.argv[1:] if argv is None else list(argv), base, world)
            (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    if not lead:
        return {}
    cuda = report["device"] != "cpu"
    print(f"same samples in every schedule (digest of the sampled token ids per step): "
          f"{'yes' if report['same_samples'] else 'NO'}")
    print("\n".join(same_samples(results)[1]))
    print_table(results, report["ratios"], cuda)
    print("note: " + "; ".join(report["notes"]))
    plotted = not opts.no_timeline and plot_timeline(results, out / "timeline.png")
    print(f"wrote {out / 'report.json'}" + (f", {out / 'timeline.png'}" if plotted else "")
          + ("" if opts.no_trace else f", {out}/trace_<schedule>.json.gz"))
    return report


def make_report(results: dict, argv: list[str], base: list[str], world: int) -> dict:
    """report.json's content for the schedules run so far."""
    cuda = next(iter(results.values()))["device"].startswith("cuda")
    notes = [RANDOM_NOTE] + ([] if cuda else [CPU_NOTE]) + ([CPU_RANKS_NOTE] if world > 1 and not cuda else []) \
        + ([DISAGG_NOTE, DISAGG_PLAN_NOTE] if "disagg" in results else [])
    return {"argv": argv, "base_argv": base,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "commit": commit_id(), "world_size": world, "notes": notes, "same_samples": same_samples(results)[0],
            "ratios": ratios(results), "schedules": results}


def commit_id() -> str:
    """ROLLPLEX_COMMIT (a device machine's copy of the tree has no .git), else git's HEAD, else ""."""
    if os.environ.get("ROLLPLEX_COMMIT"):
        return os.environ["ROLLPLEX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # joined by the first trainer (torchrun)
        torch.distributed.barrier()  # rank 0 writes its files while the others wait, then all tear down
        torch.distributed.destroy_process_group()
