"""Step time of the three RL schedules on one workload, side by side.

    python tools/bench_schedules.py --config configs/bench_h200_video.yaml --steps 1     # one H200, ~3 min
    python tools/bench_schedules.py --steps 8 --data.task direction --data.num_frames 16 --data.image_size 112 \\
        --data.batch_size 4 --rollout.n 4 --rollout.min_tokens 8 --rollout.max_tokens 16 --rollout.ignore_eos true \\
        --algorithm.kl_coef 0.01 --rollout.kv_cache_memory 64e6                               # CPU, ~1 min

Any other `--section.field value` goes to every schedule's config (see
`python train.py --help`). Each schedule gets a fresh RLTrainer from the same
config and seeds, in this process, so it sees the same prompts and samples:

    serial-naive   --schedule.kind serial --schedule.share_prefix false
    serial-prefix  --schedule.kind serial --schedule.share_prefix true
    overlap        --schedule.kind overlap

Per schedule: 1 warm-up step (not counted), `--steps` measured steps, then one
more step under torch.profiler (not counted either: the profiler slows it)
whose Chrome trace is written. `--out` gets report.json, trace_<schedule>.json.gz
and timeline.png (engine steps and prefix slices of the last measured step).
Before each step the CUDA cache is emptied, so the prefix budget (read from
free device memory) is the same in every step. On CPU give
--rollout.kv_cache_memory in bytes: the default fraction of free RAM makes
every rollout zero-fill gigabytes of KV pool.

The model has random weights: only the timings mean anything.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollplex.config import config_to_dict, load_config  # noqa: E402
from rollplex.rl.loop import RLTrainer  # noqa: E402

SCHEDULES = {
    "serial-naive": ["--schedule.kind", "serial", "--schedule.share_prefix", "false"],
    "serial-prefix": ["--schedule.kind", "serial", "--schedule.share_prefix", "true"],
    "overlap": ["--schedule.kind", "overlap"],
}
PHASES = ("gen", "prefix", "ref", "old_log_prob", "update_actor")
# Same workload check: with seeded sampling these are equal in every schedule (see tests/test_schedules.py).
SAME = ("critic/score/mean", "response_length/mean")
RANDOM_NOTE = "weights are random: the figures are timings only"
CPU_NOTE = ("on CPU there is no side stream: overlap runs its prefix slices inline between decode steps, "
            "so it does the same work as serial-prefix and no overlap gain is expected")
KIND_COLOURS = {"vision": "tab:purple", "ref": "tab:orange", "actor": "tab:green", "old": "tab:red"}


class Recorder:
    """Host timestamps of one trainer's rollouts: the gen phase, vision encodes,
    each engine step, and the step's PrefixScheduler (its slices)."""

    def __init__(self, trainer: RLTrainer):
        self.steps: list[dict] = []
        rollout, encode, generate = trainer.rollout, trainer._encode, trainer.engine.generate

        def recording_rollout(*args, **kwargs):
            rec = {"start": time.perf_counter(), "vision": [], "engine": [], "prefix": None}
            self.steps.append(rec)
            result = rollout(*args, **kwargs)
            rec["end"] = time.perf_counter()
            rec["prefix"] = result.prefix  # its spans fill in later too (serial drains after gen): see finish()
            return result

        def recording_encode(*args, **kwargs):
            start = time.perf_counter()
            out = encode(*args, **kwargs)
            if self.steps:
                self.steps[-1]["vision"].append(("vision", start, time.perf_counter()))
            return out

        def recording_generate(requests, params, between_steps=None):
            engine = self.steps[-1]["engine"] if self.steps else []
            last = [time.perf_counter()]

            def after_step(running: int) -> None:  # an engine step ended; prefix slices (overlap) follow
                engine.append((last[0], time.perf_counter()))
                if between_steps is not None:
                    between_steps(running)
                last[0] = time.perf_counter()

            out = generate(requests, params, after_step)
            engine.append((last[0], time.perf_counter()))
            return out

        trainer.rollout, trainer._encode, trainer.engine.generate = recording_rollout, recording_encode, recording_generate

    def finish(self) -> None:
        """After the step: keep the scheduler's timestamps, drop the scheduler (it holds the kept K/V)."""
        rec = self.steps[-1]
        prefix = rec.pop("prefix")
        rec["spans"] = list(prefix.spans) if prefix is not None else []
        rec["step_ends"] = list(prefix.step_ends) if prefix is not None else []

    def timeline(self, index: int) -> dict:
        """Step `index`'s timeline, seconds from its rollout start."""
        rec = self.steps[index]
        t0 = rec["start"]
        return {"gen_end": rec["end"] - t0,
                "engine_steps": [(a - t0, b - t0) for a, b in rec["engine"]],
                "prefix_spans": [(kind, a - t0, b - t0) for kind, a, b in rec["vision"] + rec["spans"]],
                "scheduler_step_ends": [t - t0 for t in rec["step_ends"]]}


def run_schedule(name: str, base_argv: list[str], steps: int, out: Path, trace: bool, batches: list) -> dict:
    cfg = load_config(base_argv + SCHEDULES[name])
    load_before = os.getloadavg()[0]  # others' load on the machine skews a sequential comparison
    trainer = RLTrainer(cfg)
    cuda = trainer.device.type == "cuda"
    recorder = Recorder(trainer)
    source = trainer._batches(0)
    rows = []
    for i in range(1 + steps + trace):
        if i == len(batches):  # the same prompts for every schedule; made once
            batches.append(next(source))
        trainer.step = i + 1  # as fit() numbers steps (the sampling seeds depend on it)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if trace and i == steps + 1:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=activities) as prof:
                metrics = trainer.train_step(batches[i])
            prof.export_chrome_trace(str(out / f"trace_{name}.json.gz"))
        else:
            metrics = trainer.train_step(batches[i])
        recorder.finish()
        rows.append({k: float(v) for k, v in metrics.items()})
        print(f"  {name} step {i} ({'warm-up' if i == 0 else 'traced' if i > steps else 'measured'}): "
              f"{metrics['timing_s/step']:.3f} s", flush=True)
    result = {"overrides": SCHEDULES[name], "config": config_to_dict(cfg), "warmup": rows[0],
              "steps": rows[1:1 + steps], "traced": rows[1 + steps] if trace else None,
              "mean": _mean(rows[1:1 + steps]), "timeline": recorder.timeline(steps),
              "trace": f"trace_{name}.json.gz" if trace else None, "device": str(trainer.device),
              "loadavg_1min": [load_before, os.getloadavg()[0]]}
    trainer.logger.close()
    del trainer, recorder
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _mean(rows: list[dict]) -> dict:
    keys = set.intersection(*(set(r) for r in rows))
    return {k: sum(r[k] for r in rows) / len(rows) for k in sorted(keys)}


def ratios(results: dict) -> dict:
    tput = {n: r["mean"]["perf/throughput"] for n, r in results.items()}
    o, p = results["overlap"]["mean"], results["serial-prefix"]["mean"]
    return {"throughput_overlap_over_serial_naive": tput["overlap"] / tput["serial-naive"],
            "throughput_overlap_over_serial_prefix": tput["overlap"] / tput["serial-prefix"],
            "throughput_serial_prefix_over_serial_naive": tput["serial-prefix"] / tput["serial-naive"],
            # decode of the overlap step (its gen phase without the prefix work it left exposed) against the
            # decode-only gen phase of serial-prefix (same vision encode, same samples, no slices)
            "decode_slowdown": (o["timing_s/gen"] - o.get("timing_s/prefix_exposed", 0.0)) / p["timing_s/gen"] - 1}


def same_samples(results: dict) -> tuple[bool, list[str]]:
    lines, ok = [], True
    runs = {n: [r["warmup"], *r["steps"], *([r["traced"]] if r["traced"] else [])] for n, r in results.items()}
    for i in range(len(next(iter(runs.values())))):
        values = {n: tuple(rows[i][k] for k in SAME) for n, rows in runs.items()}
        match = len(set(values.values())) == 1
        ok &= match
        lines.append(f"  step {i}: " + "  ".join(f"{n} score {v[0]:.4f} len {v[1]:.2f}" for n, v in values.items())
                     + ("  match" if match else "  MISMATCH"))
    return ok, lines


def print_table(results: dict, r: dict) -> None:
    cols = ("step s", *PHASES, "tok/s", "hidden", "exposed", "ovl eff", "deferred")
    print(f"{'schedule':<14}" + "".join(f"{c:>13}" for c in cols))
    for name, res in results.items():
        m = res["mean"]
        values = [m["timing_s/step"], *(m.get(f"timing_s/{p}") for p in PHASES), m["perf/throughput"],
                  m.get("timing_s/prefix_hidden"), m.get("timing_s/prefix_exposed"), m.get("perf/overlap_efficiency"),
                  m.get("prefix/deferred_items")]
        print(f"{name:<14}" + "".join(f"{'-':>13}" if v is None else f"{v:>13.4g}" for v in values))
    memory = {n: {k.rsplit("/", 1)[1]: v for k, v in res["mean"].items() if k.startswith("perf/max_memory_allocated_gb/")}
              for n, res in results.items()}
    if any(memory.values()):
        print("peak memory allocated per phase, GiB:")
        for name, phases in memory.items():
            print(f"  {name:<14}" + "  ".join(f"{p} {v:.1f}" for p, v in phases.items()))
    print(f"throughput overlap / serial-naive   {r['throughput_overlap_over_serial_naive']:.3f}")
    print(f"throughput overlap / serial-prefix  {r['throughput_overlap_over_serial_prefix']:.3f}")
    print(f"throughput serial-prefix / naive    {r['throughput_serial_prefix_over_serial_naive']:.3f}")
    print(f"decode slowdown (overlap gen - exposed) / serial-prefix gen - 1  {r['decode_slowdown']:+.3f}")


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
        steps = t["engine_steps"]
        ax.broken_barh([(a, b - a) for a, b in steps[0::2]], (1.1, 0.8), color="tab:blue")
        ax.broken_barh([(a, b - a) for a, b in steps[1::2]], (1.1, 0.8), color="lightsteelblue")
        for kind, colour in KIND_COLOURS.items():
            ax.broken_barh([(a, b - a) for k, a, b in t["prefix_spans"] if k == kind], (0.1, 0.8), color=colour)
        if not t["prefix_spans"]:
            ax.text(0.01, 0.25, "no prefix work: every pass recomputes vision and prompt per sample",
                    transform=ax.transAxes, va="center", fontsize=8)
        ax.axvline(t["gen_end"], color="black", linestyle="--", linewidth=1)
        ax.set_yticks([0.5, 1.5], ["prefix", "engine"])
        ax.set_title(f"{name}: mean step {res['mean']['timing_s/step']:.3g} s, gen {res['mean']['timing_s/gen']:.3g} s; "
                     "below: the last measured step (dashed: end of its gen phase)", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from rollout start (host clock; on CUDA: issue times)")
    handles = [Patch(color="tab:blue", label="engine steps (alternate shades)")]
    handles += [Patch(color=c, label=f"prefix: {k}") for k, c in KIND_COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog="other --section.field value options go to every schedule's config")
    parser.add_argument("--config", help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per schedule (after 1 warm-up)")
    parser.add_argument("--out", default="runs/bench_schedules", help="output folder")
    parser.add_argument("--no-trace", action="store_true", help="skip the profiled step and its Chrome trace")
    opts, extra = parser.parse_known_args(argv)
    if opts.steps < 1:
        parser.error("--steps must be >= 1")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    # Defaults first, so that the user's overrides win; the schedule's own go last.
    base = (["--config", opts.config] if opts.config else []) + [
        "--trainer.output_dir", str(out / "trainer"), "--trainer.eval_every", "0", "--trainer.save_every", "0",
        "--data.val_size", "1", "--logging.no_console", *extra]
    print(f"bench_schedules: {RANDOM_NOTE}")
    batches: list = []
    results = {}
    for name, overrides in SCHEDULES.items():
        print(f"{name}: {' '.join(overrides)}", flush=True)
        results[name] = run_schedule(name, base, opts.steps, out, not opts.no_trace, batches)
    device = results["overlap"]["device"]
    cuda = device.startswith("cuda")
    r = ratios(results)
    ok, lines = same_samples(results)
    print(f"same samples in every schedule (mean score, response length per step): {'yes' if ok else 'NO'}")
    print("\n".join(lines))
    print_table(results, r)
    print(f"note: {RANDOM_NOTE}" + ("" if cuda else f"; {CPU_NOTE}"))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    report = {"argv": sys.argv[1:] if argv is None else list(argv), "base_argv": base,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "commit": commit, "notes": [RANDOM_NOTE] + ([] if cuda else [CPU_NOTE]), "same_samples": ok,
              "ratios": r, "schedules": results}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    plotted = plot_timeline(results, out / "timeline.png")
    print(f"wrote {out / 'report.json'}" + (f", {out / 'timeline.png'}" if plotted else "")
          + ("" if opts.no_trace else f", {out}/trace_<schedule>.json.gz"))
    return report


if __name__ == "__main__":
    main()
