"""SIGTERM and hang-ups as exceptions, so that emulated clusters are removed on the way out."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import threading

__all__ = ["end_with", "end_with_parent", "ending_signals", "unwind_on_signals"]

_PR_SET_PDEATHSIG = 1


def ending_signals() -> list[signal.Signals]:
    """Besides Ctrl-C's SIGINT, the signals that end a run in the foreground: SIGTERM, and
    SIGHUP unless this process ignores it (as under ``nohup``)."""
    hang_up = [] if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGTERM, *hang_up]


def _leave_the_terminal() -> None:
    """Send what went to a terminal (stdout, stderr) to /dev/null from now on.

    After a hang-up the terminal is gone: a write to it fails (EIO), and a
    message printed on the way out would interrupt the clean-up with an error
    of its own. A file or a pipe keeps what is written to it.
    """
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        dev_null = os.fstat(null)
        for fd in (1, 2):
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and not os.path.samestat(st, dev_null):
                os.dup2(null, fd)
    finally:
        os.close(null)


def unwind_on_signals(exc: type[BaseException] = SystemExit) -> None:
    """Make SIGTERM and SIGHUP raise `exc` (with 128 + the signal) in this process, as
    Ctrl-C does.

    A SIGTERM (a CI timeout, ``kill``) or a hang-up (the terminal closed, an
    ssh connection dropped) otherwise ends Python at once, and the
    ``with Cluster(...)`` blocks on the stack never remove their namespaces;
    raised as an exception, the stack unwinds and they do. On a hang-up,
    output to the terminal is dropped first (`_leave_the_terminal`). A
    SIGHUP this process ignores (``nohup``) stays ignored. A child that
    pyroute2 forks to enter a namespace inherits the handler and is stopped
    with SIGTERM: it leaves at once instead of unwinding its copy of the
    parent's stack and removing the parent's clusters.
    """
    main = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != main:
            os._exit(128 + signum)
        if signum == signal.SIGHUP:
            _leave_the_terminal()
        raise exc(128 + signum)

    for sig in ending_signals():
        signal.signal(sig, handler)


def end_with_parent(parent: int) -> None:
    """Have the kernel send this process SIGTERM when its parent, process `parent`, ends;
    if it has ended already, exit now (128 + SIGTERM).

    For what the testbed starts in a host: a caller that cannot unwind
    (SIGKILL, the OOM killer) takes its workers and daemons with it, instead
    of leaving them to run on in its namespaces. SIGTERM lets each end as it
    does when stopped (torchrun stops its workers, gradlaned restores the
    qdisc). The kernel's "parent" is the thread that started the process:
    start it from one that outlives it. Survives exec (unless set-user-ID).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # it ended before the kernel was told to watch it
        os._exit(128 + signal.SIGTERM)


def end_with(pid: int) -> None:
    """Send this process SIGTERM when process `pid` ends (any process, not only the
    parent: a thread waits on its pidfd); if it has ended already, exit now.

    For a worker forked by multiprocessing's fork server, whose parent is the
    server, not the caller: the server outlives the caller while any of its
    children do, so `end_with_parent` would never fire.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(128 + signal.SIGTERM)

    def watch() -> None:
        select.select([fd], [], [])  # readable once `pid` has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name=f"gl-end-with-{pid}", daemon=True).start()
