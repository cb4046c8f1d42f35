"""Rollplex entry point: config -> distributed init -> build_trainer(...).fit() (rollplex.cli.train).

    python train.py                                   # the tiny CPU demo (rollplex/presets/tiny.yaml)
    python train.py --config configs/x.yaml --rollout.n 4
    torchrun --nproc-per-node 8 train.py --config configs/x.yaml --parallel.tp 2
    python train.py --help                            # every option
"""

import sys

from rollplex.cli import train

main = train  # the name tests and older scripts import

if __name__ == "__main__":
    train(sys.argv[1:])
