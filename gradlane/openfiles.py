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

__all__ = ["MARGIN", "NoRoom", "Room", "make_room", "room_for"]

logger = logging.getLogger(__name__)

MARGIN = 64  # files for whatever else the process opens meanwhile


@dataclass
class NoRoom(Exception):
    """The hard limit leaves no room: `needed` files against `hard`, `in_use` open now."""

    needed: int
    hard: int
    in_use: int


@dataclass(frozen=True)
class Room:
    """What `more` files take: `needed` in all with the `in_use` open now (and `MARGIN`),
    against the `soft` and `hard` limits (`resource.RLIM_INFINITY`: none)."""

    needed: int
    in_use: int
    soft: int
    hard: int

    @property
    def fits_soft(self) -> bool:
        return self.soft == resource.RLIM_INFINITY or self.needed <= self.soft

    @property
    def fits_hard(self) -> bool:
        return self.hard == resource.RLIM_INFINITY or self.needed <= self.hard


def room_for(more: int) -> Room | None:
    """Whether this process's limits let `more` files open (None without procfs to count
    the open ones by)."""
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return Room(in_use + more + MARGIN, in_use, soft, hard)


def make_room(more: int, what: str) -> None:
    """Let `more` files open beyond those open now (and `MARGIN`): raise the soft limit
    if it is lower, logging it for `what`. Without procfs to count the open files by,
    the limits are left as they are.

    Raises:
        NoRoom: the hard limit is lower than that.
    """
    room = room_for(more)
    if room is None or room.fits_soft:
        return
    if not room.fits_hard:
        raise NoRoom(room.needed, room.hard, room.in_use)
    resource.setrlimit(resource.RLIMIT_NOFILE, (room.needed, room.hard))
    logger.info("open-file limit raised from %d to %d for %s", room.soft, room.needed, what)
