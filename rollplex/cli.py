"""Rollplex's entry points: `python train.py` and the installed `rollplex` command run `train`.

    python train.py --config configs/x.yaml          # the same as: rollplex train --config configs/x.yaml
    torchrun --nproc-per-node 8 train.py --config configs/x.yaml

A run that stops on an error or Ctrl-C ends with one line saying what happened, its last checkpoint and how to
resume; the traceback goes to <output_dir>/error.log (ROLLPLEX_DEBUG=1 prints it too: rollplex.run_errors).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from rollplex.config import load_config
from rollplex.rl.trainer import build_trainer
from rollplex.run_errors import run_ends_in_one_line


def train(argv: list[str] | None = None) -> None:
    """Load the config from `argv` (default: sys.argv[1:]) and run it to its end."""
    with run_ends_in_one_line() as run:
        cfg = load_config(argv)
        run.output_dir = Path(cfg.trainer.output_dir)
        build_trainer(cfg).fit()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its groups down while another still talks on them
        dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1:])
