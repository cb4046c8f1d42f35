"""Experiment trackers the metrics logger feeds: TensorBoard, Weights & Biases, SwanLab.

Each takes the step's numbers (`log`) and is closed at the end of the run. All
three are optional extras (``pip install 'rollplex[tensorboard]'``,
``'rollplex[wandb]'``, ``'rollplex[swanlab]'``); asking for one that is not
installed is an error naming its extra, raised by `require_trackers` on every
rank before the run loads anything. Their mode is theirs to set, as they document it: online by
default, ``WANDB_MODE=offline`` keeps a run in ``<output_dir>/wandb`` and
``SWANLAB_MODE=offline`` (or ``local``) in ``<output_dir>/swanlog``, to sync later.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

TENSORBOARD_DIR = "tb"  # in the output folder


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TrackerMissing(ImportError):
    """A tracker the config asks for is not installed."""


def require_trackers(names: list[str]) -> None:
    """Raise TrackerMissing, naming the extra to install, for the first of `names` (tensorboard, wandb, swanlab:
    each its package, its rollplex extra and its logging switch) that is not installed."""
    for name in names:
        if not _installed(name):
            raise TrackerMissing(f"logging.{name} is on but the {name} package is not installed: "
                                 f"pip install 'rollplex[{name}]' (or turn logging.{name} off)")


def _installed(name: str) -> bool:
    if name == "tensorboard":  # torch holds the writer, which fails to import without the tensorboard package
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            return False
        return True
    return importlib.util.find_spec(name) is not None  # found, not imported: wandb takes seconds to import


class TensorBoardTracker:
    def __init__(self, log_dir: Path, first_step: int | None = None):
        """`first_step`: the step a resumed run logs first; TensorBoard then hides the interrupted run's events
        from it on (which the resumed run redoes), so each step shows once."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=first_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run; its files go to `<output_dir>/wandb`."""

    def __init__(self, output_dir: Path, project: str, name: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=project, name=name, config=config, dir=str(output_dir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class SwanlabTracker:
    """A SwanLab run; its files go to `<output_dir>/swanlog`."""

    def __init__(self, output_dir: Path, project: str, name: str, config: dict[str, Any]):
        import swanlab

        self.run = swanlab.init(project=project, name=name, config=config, log_dir=str(output_dir / "swanlog"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def open_trackers(output_dir: Path, tensorboard: bool, extras: list[str], project: str, run_name: str,
                  config: dict[str, Any], first_step: int | None = None) -> list[Tracker]:
    """The trackers a run asked for (rank 0 only), which `require_trackers` found installed: TensorBoard, and
    `extras` (wandb, swanlab). `first_step`: a resumed run's first step (TensorBoardTracker)."""
    trackers: list[Tracker] = []
    if tensorboard:
        trackers.append(TensorBoardTracker(output_dir / TENSORBOARD_DIR, first_step))
    kinds = {"wandb": WandbTracker, "swanlab": SwanlabTracker}
    name = run_name or output_dir.resolve().name
    trackers += [kinds[extra](output_dir, project, name, config) for extra in extras]
    return trackers
