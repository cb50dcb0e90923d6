"""Test worker processes forked from a server that imported torch once.

A rank started as ``python -m tests.shim_worker`` imports torch itself (about
1.2 s of CPU) and tears it down at exit (0.3 s more): four ranks on a 2-core
machine spend some 3 s of a 5 s test there. multiprocessing's forkserver
imports torch and the shim once per test session, then forks a clean process
for each rank: no pytest state and no threads in it, its environment and
arguments its own, its output in a file. Training in it is the same code as
under ``python -m``; only the start differs.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

_SERVER = multiprocessing.get_context("forkserver")
# Imported once in the server; each rank then starts with them in memory.
_SERVER.set_forkserver_preload(["torch", "gradlane.shim", "tests.shim_worker"])


def _stop_server() -> None:
    """At exit, stop the server and wait for it (it would stop on its own once this process
    is gone, a moment after: the test run must end with no process left)."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # "used by unit tests"
    if stop is not None:
        stop()


atexit.register(_stop_server)


def _run(main: Callable[[Sequence[str]], None], argv: list[str], env: dict[str, str],
         log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    main(argv)


class Forked:
    """One forked process, with the part of `subprocess.Popen`'s interface the tests use.

    ``returncode`` is the exit code, or minus the signal that ended it (as
    Popen's); `output` is what it wrote to stdout and stderr.
    """

    def __init__(self, main: Callable[[Sequence[str]], None], argv: list[str],
                 env: dict[str, str], log: Path) -> None:
        self.log = log
        self._proc = _SERVER.Process(target=_run, args=(main, argv, env, str(log)))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked {self._proc.pid}", timeout or 0.0)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
