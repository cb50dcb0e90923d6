"""Room for open files: the soft open-file limit (RLIMIT_NOFILE) raised towards the hard one.

The usual soft limit is 1,024 (systemd's default for services too), far below the
usual hard one: a process that needs more raises its own, as the shim does for its
band connections and gradlaned for its clients.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

__all__ = ["MARGIN", "NoRoom", "make_room"]

MARGIN = 64  # files for whatever else the process opens meanwhile


@dataclass
class NoRoom(Exception):
    """The hard limit leaves no room: `needed` files against `hard`, `in_use` open now."""

    needed: int
    hard: int
    in_use: int


def make_room(more: int) -> tuple[int, int] | None:
    """Let `more` files open beyond those open now (and `MARGIN`): raise the soft limit
    if it is lower.

    Returns:
        The soft limit before and after, if it was raised; None if there was room, or
        no procfs to count the open files by.

    Raises:
        NoRoom: the hard limit is lower than that.
    """
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: leave the limits as they are
        return None
    needed = in_use + more + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return None
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise NoRoom(needed, hard, in_use)
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return soft, needed
