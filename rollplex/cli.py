"""Rollplex's entry points: `python train.py` runs `train`; the installed `rollplex` command (`main`) runs
it and the tools a run's folder is for.

    python train.py --config configs/x.yaml          # the same as: rollplex train --config configs/x.yaml
    torchrun --nproc-per-node 8 train.py --config configs/x.yaml
    rollplex export runs/x --out my_model            # the latest checkpoint as a Hugging Face folder (rollplex.export)
    rollplex plot runs/x                             # its curves in runs/x/curves.png (rollplex.plot)

A run that stops on an error, Ctrl-C or SIGTERM ends with one line saying what happened, its last checkpoint and
how to resume; the traceback goes to <output_dir>/error.log (ROLLPLEX_DEBUG=1 prints it too: rollplex.run_errors).
SIGTERM lets the step under way finish and saves it (trainer.save_on_term: rollplex.stop_signals).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from rollplex import export, plot
from rollplex.config import load_config
from rollplex.rl.trainer import build_trainer
from rollplex.run_errors import run_ends_in_one_line, warnings_in_one_line


def train(argv: list[str] | None = None) -> None:
    """Load the config from `argv` (default: sys.argv[1:]) and run it to its end."""
    with warnings_in_one_line(), run_ends_in_one_line() as run:
        cfg = load_config(argv)
        run.output_dir = Path(cfg.trainer.output_dir)
        build_trainer(cfg).fit()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its groups down while another still talks on them
        dist.destroy_process_group()



def _train(argv: list[str]) -> int:
    train(argv)
    return 0


def _export(argv: list[str]) -> int:
    export.main(argv, prog="rollplex export")
    return 0


def _plot(argv: list[str]) -> int:
    return plot.main(argv, prog="rollplex plot")


# name: (what it does, the function that runs it on the arguments after the name and returns the exit status)
COMMANDS = {
    "train": ("train as the config and options say (= python train.py); --help lists every option", _train),
    "export": ("write a run's checkpoint as a Hugging Face folder that transformers loads", _export),
    "plot": ("draw a run's curves from its metrics.jsonl into a PNG", _plot),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {what}" for name, (what, _) in COMMANDS.items())
    return (f"usage: rollplex COMMAND [ARGS...]\n\nRL post-training for vision-language models.\n\ncommands:\n"
            f"{commands}\n\nrollplex COMMAND --help says what each takes.")


def main(argv: list[str] | None = None) -> int:
    """The `rollplex` command: the subcommand `argv[0]` (default: sys.argv[1:]) on the rest; returns the exit
    status (2: no or an unknown command)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{usage()}\n\nrollplex: {problem}", file=sys.stderr)
        return 2
    _, run = COMMANDS[argv[0]]
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
