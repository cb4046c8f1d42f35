"""Rollplex entry point: config -> distributed init -> RLTrainer(...).fit().

    python train.py                                   # the built-in default (configs/tiny.yaml)
    python train.py --config configs/x.yaml --rollout.n 4
    torchrun --nproc-per-node 8 train.py --config configs/x.yaml --parallel.tp 2
    python train.py --help                            # every option
"""

import sys

import torch.distributed as dist

from rollplex.config import load_config
from rollplex.rl.loop import RLTrainer


def main(argv: list[str] | None = None) -> None:
    RLTrainer(load_config(argv)).fit()
    if dist.is_initialized():
        dist.barrier()  # no rank tears its groups down while another still talks on them
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
