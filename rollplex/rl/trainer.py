"""The trainer a config asks for: colocated (rollplex.rl.loop), or disagg's (rollplex.rl.disagg)."""

from __future__ import annotations

from rollplex.config import Config
from rollplex.rl.disagg import DisaggTrainer
from rollplex.rl.loop import RLTrainer
from rollplex.rl.schedules.registry import build_schedule


def build_trainer(cfg: Config) -> RLTrainer:
    """The trainer of `cfg`'s schedule: its own for rollout and training on separate ranks."""
    return DisaggTrainer(cfg) if build_schedule(cfg).separate_ranks else RLTrainer(cfg)
