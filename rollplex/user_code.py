"""Where a user's code failed (a reward function, a file it imports): its traceback without Rollplex's frames
around it, and its last frame, short enough for a one-line message.

    try:
        reward(samples)
    except Exception as error:
        user_traceback(error)   # "Traceback (most recent call last):\n  File \"/my/reward.py\", line 3, in ..."
        last_user_frame(error)  # "reward.py:3 in reward"

An error carried across a process (a reward worker's) or caught and turned into a count (a failed sample) has
lost its traceback by the time the run stops; such a run's error carries the user's traceback as text
(rollplex.run_errors writes it to error.log before the trainer's own).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path
from types import TracebackType

# As the frames name Rollplex's files: from the same path as __file__ (not resolved: a link in it stays).
ROLLPLEX_DIR = os.path.dirname(os.path.abspath(__file__))
# The standard library and the installed packages: a frame there is where a user's call went, not what it did.
_LIBRARY_DIRS = tuple(sorted({str(Path(sysconfig.get_paths()[name]).resolve())
                              for name in ("stdlib", "platstdlib", "purelib", "platlib")}))


def in_rollplex(filename: str) -> bool:
    """The file is one of Rollplex's own."""
    return filename.startswith(ROLLPLEX_DIR + os.sep)


def _in_library(filename: str) -> bool:
    return filename.startswith("<") or filename.startswith(_LIBRARY_DIRS)  # "<frozen importlib...>", "<string>"


def _user_part(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the first frame after Rollplex's own on: the user's function that Rollplex called. The
    frames of whatever called Rollplex (a script, a test) come first and are passed over; a traceback without any
    of Rollplex's frames is the user's throughout; None when it ends in Rollplex's frames."""
    first = tb
    while tb is not None and not in_rollplex(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None:
        return first
    while tb is not None and in_rollplex(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def user_traceback(error: BaseException) -> str:
    """`error`'s traceback as Python prints it, from the user's first frame on (the whole of it when no frame is
    outside Rollplex: a check of Rollplex's own failed); the errors chained to it in full."""
    tb = _user_part(error.__traceback__) or error.__traceback__
    return "".join(traceback.format_exception(type(error), error, tb))


def last_user_frame(error: BaseException) -> str:
    """"file.py:LINE in function" of the innermost frame of the user's code where `error` (or an error it was
    raised from) happened, preferring the user's own files to the libraries they called; "" when there is none
    (the error is Rollplex's own)."""
    for e in _chain(error):
        if isinstance(e, SyntaxError) and e.filename and not _in_library(e.filename) \
                and not in_rollplex(e.filename):
            return f"{Path(e.filename).name}:{e.lineno}"  # a file that does not parse has no frame of its own
        frames = [f for f in traceback.extract_tb(_user_part(e.__traceback__)) if not in_rollplex(f.filename)]
        own = [f for f in frames if not _in_library(f.filename)] or frames
        if own:
            return f"{Path(own[-1].filename).name}:{own[-1].lineno} in {own[-1].name}"
    return ""


def _chain(error: BaseException) -> list[BaseException]:
    """`error`, then the error it was raised from (or while handling), and so on."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def carry_user_traceback(error: BaseException, heading: str, text: str) -> BaseException:
    """`error`, carrying `text` (a user's traceback that its own traceback lacks) under `heading` for error.log;
    no text leaves it as it is."""
    if text:
        error.user_traceback = f"{heading}\n{text}"
    return error


def carried_user_traceback(error: BaseException) -> str:
    """The user's traceback (with its heading) that `error`, or an error it was raised from, carries; "" if none."""
    return next((e.user_traceback for e in _chain(error) if getattr(e, "user_traceback", "")), "")
