"""Training curves of a run, from its metrics.jsonl, in one PNG: the `rollplex plot` command.

    rollplex plot runs/x                    # writes runs/x/curves.png
    rollplex plot runs/x --out /tmp/x.png

(`python tools/plot_run.py ...` is the same command.)

Three panels against the step: reward (critic/score/mean with its min-max band,
and val/score as points), response length (response_length/mean), and the
per-phase step time (every timing_s/* metric, with timing_s/step as the total).
A panel whose metrics the run never logged says so instead of staying blank.

matplotlib is not a dependency of Rollplex: `pip install 'rollplex[plot]'` (or matplotlib) to use this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollplex.metrics import read_metrics


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, leaving out the steps where it is absent or null."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(records: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    fig, (reward, length, timing) = plt.subplots(3, 1, figsize=(11, 10), sharex=True)
    fig.suptitle(title)

    steps, mean = series(records, "critic/score/mean")
    if steps:
        reward.plot(steps, mean, label="critic/score/mean")
    band = [(r["step"], r["critic/score/min"], r["critic/score/max"]) for r in records
            if r.get("critic/score/min") is not None and r.get("critic/score/max") is not None]
    if band:
        band_steps, low, high = zip(*band)
        reward.fill_between(band_steps, low, high, alpha=0.2, label="min-max")
    val_steps, val = series(records, "val/score")
    if val_steps:
        reward.plot(val_steps, val, "o", label="val/score")
    _finish(reward, "reward")

    steps, values = series(records, "response_length/mean")
    if steps:
        length.plot(steps, values, label="response_length/mean")
    _finish(length, "response tokens")

    # Phases as lines rather than a stack: they can overlap (rollplex runs prompt work during decode),
    # so stacking would overstate the step; timing_s/step, drawn thicker, is the real total.
    phases = sorted({k for r in records for k in r if k.startswith("timing_s/")})
    for key in phases:
        steps, values = series(records, key)
        timing.plot(steps, values, label=key, linewidth=2.5 if key == "timing_s/step" else 1.2)
    timing.set_ylim(bottom=0)
    _finish(timing, "seconds")
    timing.set_xlabel("step")

    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _finish(ax, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.has_data():
        # Outside the axes, on the right: inside, it hides whichever curve runs under it.
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Plot as `argv` (default: sys.argv[1:]) asks; returns the exit status. `prog`: the command's name in its
    help."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plotting needs matplotlib, which Rollplex does not install: pip install 'rollplex[plot]' "
              "(or pip install matplotlib)", file=sys.stderr)
        return 2
    path = args.run_dir / "metrics.jsonl"
    if not path.is_file():
        print(f"no metrics file at {path}", file=sys.stderr)
        return 1
    records = read_metrics(path)
    if not records:
        print(f"{path} holds no records", file=sys.stderr)
        return 1
    out = args.out or args.run_dir / "curves.png"
    plot(records, out, title=str(args.run_dir))
    print(f"wrote {out} ({len(records)} steps)")
    return 0
