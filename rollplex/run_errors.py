"""How a run that stops on an error or on Ctrl-C ends: one line on the console, the traceback in a file.

    with run_ends_in_one_line() as run:
        cfg = load_config(argv)
        run.output_dir = Path(cfg.trainer.output_dir)
        ...

Whatever stops the run, the console gets one line (stderr) saying what happened, the run's last complete
checkpoint and its step, and how to resume, and the full traceback is appended to ``<output_dir>/error.log``
with the time, rank and command (``ROLLPLEX_DEBUG=1`` prints it on the console too). Every torchrun rank
reports: rank 0 the whole line, the others a short one each. The exit status stays non-zero (130 for Ctrl-C, as
a shell gives; 1 otherwise), so torchrun still restarts a group one of whose ranks failed.
"""

from __future__ import annotations

import errno
import os
import shlex
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from rollplex.engine.nonfinite import NonFiniteLogitsError
from rollplex.rl.step_metrics import RewardsFailed
from rollplex.run_lock import RunFolderInUse
from rollplex.train.checkpoint import STEP_DIR, CheckpointSaveError, latest_checkpoint
from rollplex.trackers import TrackerMissing

DEBUG_ENV = "ROLLPLEX_DEBUG"
ERROR_LOG = "error.log"  # in the output folder
INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
FAILED_STATUS = 1
# Errors whose message already tells the user what is wrong and what to change (ValueError: bad input, with
# ConfigError, MemoryPlanError, CheckpointError and the data errors): the message alone is the line.
USER_ERRORS = (ValueError, RunFolderInUse, RewardsFailed, CheckpointSaveError, TrackerMissing, NonFiniteLogitsError)
# What a run may stop on: DCP's CheckpointException derives from BaseException, not Exception.
RUN_STOPS = (Exception, KeyboardInterrupt, CheckpointException)


@dataclass
class RunPlace:
    """Where a run writes, once its config names it (None before: a run that fails to load its config)."""

    output_dir: Path | None = None


@contextmanager
def run_ends_in_one_line() -> Iterator[RunPlace]:
    """Run the body; when it stops on an error or Ctrl-C, report it (see the module docstring) and exit."""
    place = RunPlace()
    try:
        yield place
    except RUN_STOPS as error:
        rank = int(os.environ.get("RANK", "0"))  # torchrun's; one plain process is rank 0
        log = append_traceback(error, place.output_dir, rank)
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exception(error)
        print(run_end_line(error, place.output_dir, rank, log), file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED_STATUS if isinstance(error, KeyboardInterrupt) else FAILED_STATUS)


def run_end_line(error: BaseException, output_dir: Path | None, rank: int, log: Path | None) -> str:
    """The one line a stopped run ends with: what happened and, on rank 0, the last checkpoint and how to resume."""
    where = f"The traceback is in {log}." if log else f"{DEBUG_ENV}=1 prints the traceback."
    if rank != 0:
        return f"rollplex rank {rank}: {_what_happened(error, output_dir)}. {where}"
    if isinstance(error, RunFolderInUse) or output_dir is None:  # the folder is another run's, or none was named
        return f"rollplex: {_what_happened(error, output_dir)}. {where}"
    return f"rollplex: {_what_happened(error, output_dir)}. {_how_to_resume(output_dir)} {where}"


def _what_happened(error: BaseException, output_dir: Path | None) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if (full := _disk_full(error)) is not None:
        folder = Path(full.filename).parent if full.filename else output_dir or "the output folder"
        return f"the disk holding {folder} is full ({full.strerror}): free space there"
    if isinstance(error, USER_ERRORS):
        return str(error).rstrip(".")
    return f"failed with {type(error).__name__}: {str(error).rstrip('.')}"


def _disk_full(error: BaseException) -> OSError | None:
    """The first ENOSPC among `error`, its causes and contexts, and DCP's per-rank failures."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [cause for cause, _ in e.failures.values()]
    return None


def _how_to_resume(output_dir: Path) -> str:
    with warnings.catch_warnings():  # its warnings about unfinished saves are not what this line is about
        warnings.simplefilter("ignore")
        last = latest_checkpoint(output_dir / "checkpoints")
    if last is None:
        return "No checkpoint was saved yet."
    step = int(STEP_DIR.fullmatch(last.name).group(1))
    return f"Last checkpoint: step {step} ({last}); run the same command to resume."


def append_traceback(error: BaseException, output_dir: Path | None, rank: int) -> Path | None:
    """Append `error`'s traceback, with the time, rank, pid and command, to the output folder's error.log;
    returns the file, or None when there is no folder yet or it cannot be written (a full disk)."""
    if output_dir is None:
        return None
    head = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} pid {os.getpid()}: {shlex.join(sys.argv)}\n"
    entry = (head + "".join(traceback.format_exception(error)) + "\n").encode()
    path = output_dir / ERROR_LOG
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        # One write to a file opened for appending: the ranks' entries do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, entry)
        finally:
            os.close(fd)
    except OSError:
        return None
    return path if written == len(entry) else None
