"""SIGTERM as an exception, so that emulated clusters are removed on the way out."""

from __future__ import annotations

import os
import signal

__all__ = ["unwind_on_sigterm"]


def unwind_on_sigterm(exc: type[BaseException] = SystemExit) -> None:
    """Make SIGTERM raise `exc` (with 128 + the signal) in this process, as Ctrl-C does.

    A SIGTERM (a CI timeout, ``kill``) otherwise ends Python at once, and the
    ``with Cluster(...)`` blocks on the stack never remove their namespaces;
    raised as an exception, the stack unwinds and they do. A child that
    pyroute2 forks to enter a namespace inherits the handler and is stopped
    with SIGTERM: it leaves at once instead of unwinding its copy of the
    parent's stack and removing the parent's clusters.
    """
    main = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != main:
            os._exit(128 + signum)
        raise exc(128 + signum)

    signal.signal(signal.SIGTERM, handler)
