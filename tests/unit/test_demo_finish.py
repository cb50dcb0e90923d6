"""How the demo and the bench end their workers' processes when one fails or hangs: the
first failure's own words, and nothing left running (neither path ran before)."""

import subprocess
import sys

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
        _finish(procs, "the training run", timeout=2)
    assert str(failed.value) == "the training run failed (exit 3):\nrank 1: boom"
    assert all(p.poll() is not None for p in procs)


def test_a_worker_that_hangs_is_killed_and_said() -> None:
    procs = [_python("import sys, time; sys.stderr.write('stuck in step 3'); sys.stderr.flush();"
                     " time.sleep(60)")]
    with pytest.raises(TestbedError, match=r"^the training run did not finish in 1 s: "
                                           r"stuck in step 3$"):
        _finish(procs, "the training run", timeout=1)
    assert procs[0].poll() is not None
