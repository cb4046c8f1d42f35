"""Rollplex entry point: config -> distributed init -> build_trainer(...).fit().

    python train.py                                   # the tiny CPU demo (rollplex/presets/tiny.yaml)
    python train.py --config configs/x.yaml --rollout.n 4
    torchrun --nproc-per-node 8 train.py --config configs/x.yaml --parallel.tp 2
    python train.py --help                            # every option

A run that stops on an error or Ctrl-C ends with one line saying what happened, its last checkpoint and how to
resume; the traceback goes to <output_dir>/error.log (ROLLPLEX_DEBUG=1 prints it too: rollplex.run_errors).
"""

import sys
from pathlib import Path

import torch.distributed as dist

from rollplex.config import load_config
from rollplex.rl.trainer import build_trainer
from rollplex.run_errors import run_ends_in_one_line


def main(argv: list[str] | None = None) -> None:
    with run_ends_in_one_line() as run:
        cfg = load_config(argv)
        run.output_dir = Path(cfg.trainer.output_dir)
        build_trainer(cfg).fit()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its groups down while another still talks on them
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
