"""One live run per output folder.

Global rank 0 holds an exclusive ``flock`` on ``<trainer.output_dir>/run.lock``
from before the run reads its folder (to resume or not) until the run ends; a
second run started there stops at once, on every rank, naming the first. The
lock file also holds its holder's host, pid, start time and command, to name it.

Why flock rather than a pid file alone: the kernel drops the lock when its
holder dies, however it dies (SIGKILL, the OOM killer, torchrun stopping the
group to restart it), so a killed run's restart takes the folder over without
guessing whether a recorded pid is stale; the file such a run leaves behind is
simply locked again. The lock belongs to the open file, which a child forked
without exec would share: the reward workers are fresh interpreters
(subprocess), which inherit no descriptors. A filesystem without file locks
(some FUSE or Lustre mounts) gets a warning and no lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

from rollplex.config import ConfigError

LOCK_FILE = "run.lock"
_NO_LOCKS_HERE = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)

# The locks this process holds, by lock file: a second trainer built in the same process (a tool or a test that
# builds one per schedule and never fits it) takes the folder over from the first, as a restart would.
_HELD_HERE: dict[Path, RunLock] = {}


class RunFolderInUse(RuntimeError):
    """Another live run holds the output folder."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run folder, as its lock file says."""

    host: str
    pid: int
    started: str
    command: str

    @classmethod
    def this_process(cls) -> LockHolder:
        return cls(socket.gethostname(), os.getpid(), datetime.now().isoformat(timespec="seconds"),
                   shlex.join([sys.executable, *sys.argv]))

    @classmethod
    def read(cls, path: Path) -> LockHolder | None:
        """The holder `path` names; None while its holder has not written it yet, or when it is unreadable."""
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            return None

    def is_gone(self) -> bool:
        """On this host, and its pid no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process: alive
            pass
        return False


class RunLock:
    """This process's exclusive lock on a run folder, held until `release`."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, folder: str | Path) -> RunLock:
        """Lock `folder` (which must exist) for this process; RunFolderInUse names the live run that holds it."""
        path = (Path(folder) / LOCK_FILE).resolve()
        earlier = _HELD_HERE.pop(path, None)
        if earlier is not None and _same_file(earlier._fd, path):
            fd, earlier._fd = earlier._fd, None  # the earlier trainer of this process gives the folder up
        else:
            if earlier is not None:
                earlier.release()  # its folder was deleted and made again: lock the new one
            fd = _lock(path, Path(folder))
        lock = cls(path, fd)
        if fd is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(asdict(LockHolder.this_process())) + "\n").encode(), 0)
            _HELD_HERE[path] = lock
        return lock

    def release(self) -> None:
        """Give the folder up (the run's end): the lock file goes while still locked, so that whoever opens it
        next opens a new one. Idempotent."""
        if self._fd is None:
            return
        if _HELD_HERE.get(self.path) is self:
            del _HELD_HERE[self.path]
        if _same_file(self._fd, self.path):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    """`fd` is open on the file at `path`: nobody removed (or replaced) it since it was opened."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def _lock(path: Path, folder: Path) -> int | None:
    """A descriptor of `path` holding its flock; None where the filesystem has no locks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(path, folder) from None
        except OSError as error:
            os.close(fd)
            if error.errno not in _NO_LOCKS_HERE:
                raise
            warnings.warn(f"cannot lock {path} ({error.strerror}): this filesystem has no file locks, so nothing "
                          f"stops a second run in {folder}", stacklevel=3)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it at its end, between our open and our lock: lock the file there now


def _in_use(path: Path, folder: Path) -> RunFolderInUse:
    holder = LockHolder.read(path)
    if holder is None:
        who = f"which is starting (it has not written its name into {path} yet)"
    elif holder.is_gone():
        who = (f"pid {holder.pid} on this host, which is no longer running, but a process it started still holds "
               f"{path} (`fuser {path}` names it)")
    else:
        who = f"pid {holder.pid} on host {holder.host}, started {holder.started}: {holder.command}"
    return RunFolderInUse(f"trainer.output_dir {folder} is in use by another run, {who}. Two runs in one folder "
                          f"overwrite each other's checkpoints and metrics: wait for that run to end or stop it, or "
                          f"set another trainer.output_dir. A run that was killed leaves its folder free: starting "
                          f"it again resumes it.")


def _make_folder(folder: Path) -> None:
    """`folder` and the folders above it, made where missing; a clear error where one of them is a file."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        what = "is a file" if existing == folder else f"is below {existing}, which is a file"
        raise ConfigError(f"trainer.output_dir {folder} {what}, not a folder: give the folder for the run's "
                          f"checkpoints, metrics and samples (it is made where missing)")
    folder.mkdir(parents=True, exist_ok=True)


def claim_run_folder(folder: str | Path, rank: int, world: int) -> RunLock | None:
    """Make the run folder and lock it for this run, before anything reads or writes it: rank 0 does, and every
    rank gets its answer or its error (collective when `world` > 1), so that all stop alike and none waits on a
    peer that stopped. Returns rank 0's lock, None on the other ranks."""
    outcome: list[Exception | None] = [None]
    lock = None
    if rank == 0:
        try:
            _make_folder(Path(folder))
            lock = RunLock.acquire(folder)
        except Exception as error:  # noqa: BLE001 - sent to the other ranks, raised on every one
            outcome[0] = error
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise outcome[0]
    return lock
