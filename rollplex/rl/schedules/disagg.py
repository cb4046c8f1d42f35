"""disagg: rollout and training on separate ranks, taking turns (the baseline).

The last schedule.rollout_ranks ranks only generate, the others only train;
each step the trainers broadcast their weights, the rollout ranks generate,
and every rank receives the samples. Its trainer is rollplex.rl.disagg's
`DisaggTrainer` (`separate_ranks`); the trainer ranks' phases after rollout
are serial-naive's, with no prompt work.
"""

from __future__ import annotations

from rollplex.rl.schedules.base import Schedule


class Disagg(Schedule):
    name = "disagg"
    separate_ranks = True

    @property
    def memory_layout(self) -> str:
        """Planned as if colocated (over-counting each side), its training passes packed as configured."""
        return "serial-prefix" if self.cfg.schedule.share_prefix else "serial-naive"
