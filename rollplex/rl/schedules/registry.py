"""Every schedule, and the one function that reads schedule.kind.

A new schedule is one module in this package (a `Schedule` subclass) and its
line in SCHEDULES; the config's schedule.kind literal names the kinds.
"""

from __future__ import annotations

from rollplex.config import Config
from rollplex.rl.schedules.base import Schedule
from rollplex.rl.schedules.disagg import Disagg
from rollplex.rl.schedules.overlap import Overlap
from rollplex.rl.schedules.overlap_stream import OverlapStream
from rollplex.rl.schedules.serial import SerialNaive, SerialPrefix

SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (SerialNaive, SerialPrefix, Overlap, OverlapStream, Disagg)}


def build_schedule(cfg: Config) -> Schedule:
    """The schedule the config's schedule section selects (schedule.kind and its options)."""
    s = cfg.schedule
    if s.kind == "serial":
        name = "serial-prefix" if s.share_prefix else "serial-naive"
    elif s.kind == "overlap":
        name = "overlap-stream" if s.stream_groups else "overlap"
    else:
        name = s.kind
    return SCHEDULES[name](cfg)
