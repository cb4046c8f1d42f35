"""How a run that stops on an error, Ctrl-C or SIGTERM ends: one line on the console, the traceback in a file;
and Rollplex's warnings, one line each.

    with warnings_in_one_line(), run_ends_in_one_line() as run:
        cfg = load_config(argv)
        run.output_dir = Path(cfg.trainer.output_dir)
        ...

Whatever stops the run, the console gets one line (stderr) saying what happened, the run's last complete
checkpoint and its step, and how to resume (unless the command itself must change: a config the run refuses),
and the full traceback is appended to ``<output_dir>/error.log`` with the time, rank and command
(``ROLLPLEX_DEBUG=1`` prints it on the console too), after the traceback of the user's code that caused it when
the trainer's own lacks it (a reward function's, raised in a worker process: rollplex.user_code). Every torchrun
rank reports: rank 0 the whole line, the others a short one each; each also writes the line and its traceback
into the error file torchrun names (TORCHELASTIC_ERROR_FILE), so that torchrun's report of the failure ("Root
Cause") ends with that line rather than "error_file: <N/A>". The exit status stays non-zero (130 for Ctrl-C, 143
for SIGTERM, as a shell gives; 1 otherwise), so torchrun still restarts a group one of whose ranks failed.
Ctrl-C and SIGTERM are handled here too (rollplex.stop_signals).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
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
from typing import TextIO

from torch.distributed.checkpoint.api import CheckpointException

from rollplex.config import ConfigError
from rollplex.data.datasets import PromptTemplateError
from rollplex.data.rewards import RewardTypeError
from rollplex.engine.nonfinite import NonFiniteLogitsError
from rollplex.rl.memory.plan import MemoryPlanError
from rollplex.rl.step_metrics import RewardsFailed
from rollplex.run_lock import RunFolderInUse
from rollplex.stop_signals import TERM_STATUS, Terminated, handling_stop_signals
from rollplex.train.actor import TooManySkippedSteps
from rollplex.train.checkpoint import STEP_DIR, CheckpointSaveError, latest_checkpoint
from rollplex.trackers import TrackerMissing
from rollplex.user_code import carried_user_traceback, in_rollplex

DEBUG_ENV = "ROLLPLEX_DEBUG"
ERROR_LOG = "error.log"  # in the output folder
INTERRUPTED_STATUS = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
FAILED_STATUS = 1
# Errors whose message already tells the user what is wrong and what to change (ValueError: bad input, with
# ConfigError, MemoryPlanError, CheckpointError and the data errors): the message alone is the line.
USER_ERRORS = (ValueError, RunFolderInUse, RewardsFailed, CheckpointSaveError, TrackerMissing, NonFiniteLogitsError,
               RewardTypeError, TooManySkippedSteps, PromptTemplateError)
# Errors that running the same command again meets again: the config or the folder must change first (the
# message says how), so the line says nothing of resuming.
COMMAND_ERRORS = (ConfigError, MemoryPlanError, RunFolderInUse)
# What a run may stop on: DCP's CheckpointException derives from BaseException, not Exception; so do
# KeyboardInterrupt and Terminated (SIGTERM).
RUN_STOPS = (Exception, KeyboardInterrupt, Terminated, CheckpointException)
ELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun's, one per rank: the rank's failure, as JSON


@dataclass
class RunPlace:
    """Where a run writes, once its config names it (None before: a run that fails to load its config)."""

    output_dir: Path | None = None


@contextmanager
def run_ends_in_one_line() -> Iterator[RunPlace]:
    """Run the body; when it stops on an error, Ctrl-C or SIGTERM, report it (see the module docstring) and exit."""
    place = RunPlace()
    try:
        with handling_stop_signals() as received:
            yield place
    except RUN_STOPS as error:
        rank = int(os.environ.get("RANK", "0"))  # torchrun's; one plain process is rank 0
        log = append_traceback(error, place.output_dir, rank)
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exception(error)
        stop = received.signal_that_stopped(error)  # Ctrl-C, where a library reported it as its own error
        line = run_end_line(stop, place.output_dir, rank, log)
        print(line, file=sys.stderr, flush=True)
        write_elastic_error_file(line, error)
        sys.exit(exit_status(stop))


def exit_status(error: BaseException) -> int:
    """As a shell reports a command stopped by the signal (128 + its number), or 1 for an error."""
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_STATUS
    return TERM_STATUS if isinstance(error, Terminated) else FAILED_STATUS


def run_end_line(error: BaseException, output_dir: Path | None, rank: int, log: Path | None) -> str:
    """The one line a stopped run ends with: what happened and, on rank 0, the last checkpoint and how to resume."""
    where = f"The traceback is in {log}." if log else f"{DEBUG_ENV}=1 prints the traceback."
    if rank != 0:
        return f"rollplex rank {rank}: {_what_happened(error, output_dir)}. {where}"
    if isinstance(error, COMMAND_ERRORS) or output_dir is None:  # the command must change, or named no folder
        return f"rollplex: {_what_happened(error, output_dir)}. {where}"
    return f"rollplex: {_what_happened(error, output_dir)}. {_how_to_resume(output_dir)} {where}"


def _what_happened(error: BaseException, output_dir: Path | None) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(error, Terminated):
        if error.saved_step is None:
            return "stopped by SIGTERM"
        return f"stopped by SIGTERM after finishing step {error.saved_step} and saving it (trainer.save_on_term)"
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
    entry = (head + full_traceback(error) + "\n").encode()
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


def full_traceback(error: BaseException) -> str:
    """`error`'s traceback, after the user's traceback it carries (the code that caused it, its file and line
    first), when it carries one."""
    trainer = "".join(traceback.format_exception(error))
    user = carried_user_traceback(error)
    return f"{user.rstrip()}\n\nThe trainer's traceback:\n{trainer}" if user else trainer


def write_elastic_error_file(line: str, error: BaseException) -> None:
    """Under torchrun, write this rank's failure where torchrun reads it (the file TORCHELASTIC_ERROR_FILE names,
    in the format torch.distributed.elastic's ErrorHandler.record_exception writes): torchrun then shows it as
    the failure's traceback, with `line` last, instead of "error_file: <N/A>"."""
    path = os.environ.get(ELASTIC_ERROR_FILE_ENV)
    if not path:
        return
    # torchrun names the failure with the earliest time (whole seconds) the root cause, and times a rank that died
    # without a file (killed) when it notices, up to its monitor interval after the death: rounded up, a rank that
    # failed because a peer died (a collective's "connection reset") does not look earlier than that peer.
    stamp = math.ceil(time.time())
    report = {"message": {"message": line, "extraInfo": {"py_callstack": f"{full_traceback(error)}\n{line}",
                                                          "timestamp": str(stamp)}}}
    try:
        Path(path).write_text(json.dumps(report), encoding="utf-8")
    except OSError:  # a full disk: torchrun then says <N/A>, as it did before
        pass


@contextmanager
def warnings_in_one_line() -> Iterator[None]:
    """Rollplex's own warnings as one plain line each on stderr ("rollplex warning: ...", "rollplex rank 3
    warning: ..."), without Python's file:line of the warnings.warn call and its source line, which tell a user
    nothing; other libraries' warnings as Python shows them."""
    rank = int(os.environ.get("RANK", "0"))
    prefix = "rollplex warning: " if rank == 0 else f"rollplex rank {rank} warning: "
    show_others = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
             line: str | None = None) -> None:
        if not in_rollplex(str(filename)):
            show_others(message, category, filename, lineno, file, line)
            return
        with contextlib.suppress(OSError):  # as Python's own: a warning that cannot be shown is dropped
            (file or sys.stderr).write(f"{prefix}{message}\n")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = show_others
