"""Experiment trackers the metrics logger feeds: TensorBoard, Weights & Biases, SwanLab.

Each takes the step's numbers (`log`) and is closed at the end of the run. wandb
and SwanLab are optional extras (``pip install 'rollplex[wandb]'``,
``'rollplex[swanlab]'``); asking for one that is not installed is an error
naming its extra, raised by `require_trackers` on every rank before the run
loads anything. Their mode is theirs to set, as they document it: online by
default, ``WANDB_MODE=offline`` keeps a run in ``<output_dir>/wandb`` and
``SWANLAB_MODE=offline`` (or ``local``) in ``<output_dir>/swanlog``, to sync later.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any, Protocol

EXTRA_TRACKERS = ("wandb", "swanlab")  # name = its package = its rollplex extra
TENSORBOARD_DIR = "tb"  # in the output folder


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TrackerMissing(ImportError):
    """A tracker the config asks for is not installed."""


def require_trackers(names: list[str]) -> None:
    """Raise TrackerMissing, naming the extra to install, for the first of `names` that is not installed."""
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise TrackerMissing(f"logging.{name} is on but the {name} package is not installed: "
                                 f"pip install 'rollplex[{name}]' (or turn logging.{name} off)")


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
    """The trackers a run asked for (rank 0 only). TensorBoard, which ships with most torch installs, is skipped
    with a warning when missing; `extras` (wandb, swanlab) were checked by `require_trackers`. `first_step`:
    a resumed run's first step (TensorBoardTracker)."""
    trackers: list[Tracker] = []
    if tensorboard:
        try:
            trackers.append(TensorBoardTracker(output_dir / TENSORBOARD_DIR, first_step))
        except ImportError:
            warnings.warn("logging.tensorboard is on but the tensorboard package is not installed "
                          "(pip install tensorboard); TensorBoard logging is off", stacklevel=3)
    kinds = {"wandb": WandbTracker, "swanlab": SwanlabTracker}
    name = run_name or output_dir.resolve().name
    trackers += [kinds[extra](output_dir, project, name, config) for extra in extras]
    return trackers
