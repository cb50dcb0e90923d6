"""Room for open files: the soft open-file limit (RLIMIT_NOFILE) raised towards the hard one.

The usual soft limit is 1,024 (systemd's default for services too), far below the
usual hard one: a process that needs more raises its own, as the shim does for its
band connections and gradlaned for its clients.
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

__all__ = ["MARGIN", "NoRoom", "make_room"]

logger = logging.getLogger(__name__)

MARGIN = 64  # files for whatever else the process opens meanwhile


@dataclass
class NoRoom(Exception):
    """The hard limit leaves no room: `needed` files against `hard`, `in_use` open now."""

    needed: int
    hard: int
    in_use: int


def make_room(more: int, what: str) -> None:
    """Let `more` files open beyond those open now (and `MARGIN`): raise the soft limit
    if it is lower, logging it for `what`. Without procfs to count the open files by,
    the limits are left as they are.

    Raises:
        NoRoom: the hard limit is lower than that.
    """
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    needed = in_use + more + MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise NoRoom(needed, hard, in_use)
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    logger.info("open-file limit raised from %d to %d for %s", soft, needed, what)
