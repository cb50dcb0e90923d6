"""How the demo and the bench end their workers' processes when one fails or hangs: the
first failure's own words, and nothing left running (neither path ran before)."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradlane.demo import _finish
from gradlane.errors import TestbedError


def _python(code: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_worker_that_fails_is_said_with_its_stderr_and_the_others_are_killed() -> None:
    procs = [_python("pass"),
             _python("import sys; sys.stderr.write('rank 1: boom'); sys.exit(3)"),
             _python("import time; time.sleep(60)")]
    with pytest.raises(TestbedError) as failed:
        _finish(procs, "the training run", timeout=120)
    assert str(failed.value) == "the training run failed (exit 3):\nrank 1: boom"
    # Killed at once: not waited for until the deadline, or until its sleep's end (exit 0).
    assert procs[2].returncode == -signal.SIGKILL


def test_the_failure_is_said_though_a_rank_before_it_waits_on() -> None:
    # Rank 0 waits for its peer (as one blocked in a collective does); rank 1 fails.
    procs = [_python("import time; time.sleep(60)"),
             _python("import sys, time; time.sleep(0.3); sys.stderr.write('rank 1: boom');"
                     " sys.exit(3)")]
    with pytest.raises(TestbedError) as failed:
        _finish(procs, "the training run", timeout=120)
    assert str(failed.value) == "the training run failed (exit 3):\nrank 1: boom"
    assert procs[0].returncode == -signal.SIGKILL


def test_a_worker_that_writes_more_than_a_pipe_holds_does_not_block_its_peer(
        tmp_path: Path) -> None:
    # Rank 0 ends once rank 1 has written 1 MB to stderr (a pipe holds 64 KB) and said so.
    flag = tmp_path / "written"
    procs = [_python(f"import os, sys, time\nfor _ in range(600):\n"
                     f"    if os.path.exists({str(flag)!r}): sys.exit(0)\n"
                     f"    time.sleep(0.1)\nsys.exit(1)"),
             _python(f"import sys; sys.stderr.write('x' * (1 << 20)); sys.stderr.flush();"
                     f" open({str(flag)!r}, 'w').close()")]
    _finish(procs, "the training run", timeout=120)
    assert [p.returncode for p in procs] == [0, 0]


def test_a_worker_that_hangs_is_killed_and_said() -> None:
    procs = [_python("import sys, time; sys.stderr.write('stuck in step 3'); sys.stderr.flush();"
                     " time.sleep(60)")]
    with pytest.raises(TestbedError, match=r"^the training run did not finish in 1 s: "
                                           r"stuck in step 3$"):
        _finish(procs, "the training run", timeout=1)
    assert procs[0].poll() is not None


class _Logged:
    """A worker whose output goes to a file, as `gradlane.testbed.forked.Forked`'s: no pipes;
    `communicate` reads it once the worker has ended."""

    def __init__(self, code: int, output: str) -> None:
        self.returncode, self._output = code, output

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str, str]:
        return "", self._output

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def test_a_failure_without_pipes_is_said_from_its_log() -> None:
    procs = [_Logged(0, "rank 0: fine"), _Logged(1, "Traceback ...\nValueError: rank 1: boom")]
    with pytest.raises(TestbedError) as failed:
        _finish(procs, "measuring the demo model", timeout=10)
    assert str(failed.value) == ("measuring the demo model failed (exit 1):\n"
                                 "Traceback ...\nValueError: rank 1: boom")
