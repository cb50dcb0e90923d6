"""A process on a terminal that can be hung up, as when an ssh connection drops.

`on_a_terminal` starts a command in a new session whose controlling terminal
is a new pseudo-terminal, as a login shell's is. Closing the pty's other
side (the one returned) is what the kernel does when the connection behind
a terminal goes: the terminal is hung up (writes to it fail with EIO) and
the session gets SIGHUP.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import subprocess
import termios
import time
from collections.abc import Callable, Sequence

__all__ = ["on_a_terminal", "read_until"]


def on_a_terminal(argv: Sequence[str], before: Callable[[], None] | None = None,
                  **popen: object) -> tuple[subprocess.Popen[bytes], int]:
    """`argv` with a new pty as stdin, stdout, stderr and controlling terminal (`before`
    runs in the child just before it starts); and the pty's other side: read it to see the
    output, close it to hang the terminal up."""
    master, slave = os.openpty()

    def session() -> None:  # after setsid: the pty becomes this new session's terminal
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        # As a login session starts: a hang-up ends it. A test run under nohup would pass
        # its ignored SIGHUP on, and gradlane keeps an ignored SIGHUP ignored.
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if before is not None:
            before()

    try:
        proc = subprocess.Popen(list(argv), stdin=slave, stdout=slave, stderr=slave,
                                start_new_session=True, preexec_fn=session,
                                **popen)  # type: ignore[call-overload]
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return proc, master


def read_until(master: int, proc: subprocess.Popen[bytes], done: Callable[[bytes], bool],
               timeout: float) -> bytes:
    """Read the terminal's output until `done(what was read)`; fail if `timeout` seconds
    pass or the process ends first."""
    seen = b""
    deadline = time.monotonic() + timeout
    while not done(seen):
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, seen.decode(errors="replace")[-2000:]
        if select.select([master], [], [], min(left, 0.1))[0]:
            seen += os.read(master, 4096)
    return seen
