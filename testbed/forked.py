"""Python workers forked from a server that imported torch once.

A training worker started as ``python -m gradlane.worker`` spends seconds of
CPU before its first step: importing torch, then, at its first optimizer,
torch._dynamo (torch.optim imports it lazily). On a 2-core machine running
eight of them that is most of a short scenario's time. multiprocessing's
forkserver imports both once (`PRELOAD`), then forks a clean process for
each worker: no state of the caller, no thread but one that waits for the
caller to end (then the worker gets SIGTERM), its own environment and
arguments, its output in a file, and (on an emulated cluster) inside its
host's network namespace. The training that follows is the same code as
under ``python -m``; only the start differs, and start-up is never in a
measured iteration time.

As with any multiprocessing start method but fork, each forked process
first imports the caller's main module again (as ``__mp_main__``): a script
that forks workers must keep its work under ``if __name__ == "__main__":``,
or every worker would run the script again (build its cluster, ...).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from gradlane.signals import end_with
from gradlane.testbed.netns import enter

__all__ = ["PRELOAD", "Forked", "Main", "Proc", "preload"]

_SERVER = multiprocessing.get_context("forkserver")
# Imported once in the server (a module that is not installed is skipped there).
PRELOAD = ["torch", "torch._dynamo", "gradlane.worker"]
_SERVER.set_forkserver_preload(PRELOAD)


def preload(modules: Sequence[str]) -> None:
    """Have the server import `modules` too (effective only before the first fork)."""
    _SERVER.set_forkserver_preload([*PRELOAD, *modules])


def _stop_server() -> None:
    """At exit, stop the server and wait for it (it would stop on its own once this process
    is gone, a moment after: a test run must end with no process left)."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # "used by unit tests"
    if stop is not None:
        stop()


atexit.register(_stop_server)


class Proc(Protocol):
    """What the testbed needs of a process it started: a `subprocess.Popen`, or a `Forked`."""

    @property
    def returncode(self) -> int | Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[Any, Any]: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


Main = Callable[[Sequence[str]], None] | str  # a function, or its "module:name"


def _run(main: Main, argv: list[str], env: dict[str, str], log: str,
         namespace: str | None, caller: int) -> None:
    end_with(caller)  # rather than train on in a cluster nobody will remove
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if namespace is not None:
        enter(namespace)
    os.environ.clear()
    os.environ.update(env)
    if isinstance(main, str):
        module, _, name = main.partition(":")
        function: Callable[[Sequence[str]], None] = getattr(importlib.import_module(module), name)
    else:
        function = main
    function(argv)


class Forked:
    """``main(argv)`` in a forked process, with the part of `subprocess.Popen`'s interface
    the testbed and the tests use.

    `main` is a function or its ``"module:name"`` (imported in the forked
    process only: the caller need not import torch). `env` is its whole
    environment; `namespace` the network namespace it runs in (None: this
    one). Its stdout and stderr go to `log`. ``returncode`` is its exit code
    (1 if `main` raised, the traceback in `log`), or minus the signal that
    ended it, as Popen's.
    """

    def __init__(self, main: Main, argv: Sequence[str], env: dict[str, str], log: Path,
                 namespace: str | None = None) -> None:
        self.log = log
        name = main if isinstance(main, str) else f"{main.__module__}:{main.__qualname__}"
        self.args = [name, *argv]
        self._proc = _SERVER.Process(target=_run,
                                     args=(main, list(argv), env, str(log), namespace,
                                           os.getpid()))
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
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._proc.exitcode

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str, str]:
        """Wait as `wait`; then ("", its output): stdout and stderr share the log. It reads
        no input."""
        self.wait(timeout)
        return "", self.output()

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""
