"""`gradlane.signals`: a SIGTERM or a hang-up unwinds the stack, as Ctrl-C does.

Each case runs a child on a terminal of its own (`tests.terminal`), which
the test hangs up as a dropped ssh connection would.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.terminal import on_a_terminal, read_until

_CHILD = """
import sys, time
from gradlane.signals import unwind_on_signals

unwind_on_signals()
try:
    print("ready", flush=True)  # in the try: the test hangs up as soon as it reads this
    # In short sleeps: CPython runs a handler between bytecodes, and a sleep that began
    # after the signal came is not cut short by it. The test's signal comes as the sleep
    # begins; once in about a hundred runs under load it came first and waited out 30 s.
    for _ in range(300):
        time.sleep(0.1)
except SystemExit as exc:
    with open(sys.argv[1], "a") as f:
        f.write(f"{exc.code}\\n")
    print("on the way out", flush=True)  # to the terminal, gone after a hang-up
    with open(sys.argv[1], "a") as f:
        f.write("printed\\n")
    raise
"""


def _on_a_terminal(log: Path, before: Callable[[], None] | None = None
                   ) -> tuple[subprocess.Popen[bytes], int]:
    """The child on a terminal of its own, once it said it is ready; and the terminal's
    other side."""
    proc, master = on_a_terminal([sys.executable, "-c", _CHILD, str(log)], before)
    # The whole line (the terminal's newline is \r\n): a hang-up between "ready" and its
    # newline would fail the newline's write.
    read_until(master, proc, lambda seen: b"ready\r\n" in seen, timeout=30)
    return proc, master


def _finish(proc: subprocess.Popen[bytes]) -> int:
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_hang_up_unwinds_and_what_is_printed_on_the_way_out_goes_nowhere(
        tmp_path: Path) -> None:
    log = tmp_path / "unwound"
    proc, master = _on_a_terminal(log)
    os.close(master)  # the terminal goes away: hung up, SIGHUP to the session
    assert _finish(proc) == 128 + signal.SIGHUP
    assert log.read_text().split() == [str(128 + signal.SIGHUP), "printed"]


def test_a_sigterm_unwinds_and_the_terminal_keeps_what_is_printed(tmp_path: Path) -> None:
    log = tmp_path / "unwound"
    proc, master = _on_a_terminal(log)
    try:
        proc.terminate()
        assert _finish(proc) == 128 + signal.SIGTERM
        seen = b""
        while select.select([master], [], [], 5)[0]:
            try:
                chunk = os.read(master, 1024)
            except OSError:  # EIO: the child and its side of the pty are gone
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert log.read_text().split() == [str(128 + signal.SIGTERM), "printed"]
    assert b"on the way out" in seen


def test_under_nohup_a_hang_up_is_still_ignored(tmp_path: Path) -> None:
    log = tmp_path / "unwound"
    proc, master = _on_a_terminal(log, lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    os.close(master)
    time.sleep(1.0)
    assert proc.poll() is None  # not stopped by the hang-up
    proc.terminate()
    assert _finish(proc) != 0
    # It unwound on the SIGTERM. Its print on the way out failed (the terminal is gone and
    # only a hang-up leaves it), as before: nohup itself sends a terminal's output to a file.
    assert log.read_text().split() == [str(128 + signal.SIGTERM)]


def test_after_a_hang_up_what_goes_to_a_file_is_kept(tmp_path: Path) -> None:
    """Only the terminal is given up: output sent to a file (a log) still gets there."""
    child = ("import sys, time\n"
             "from gradlane.signals import unwind_on_signals\n"
             "unwind_on_signals()\n"
             "try:\n"
             "    print('ready', file=sys.stderr, flush=True)  # the terminal\n"
             "    for _ in range(300):\n"
             "        time.sleep(0.1)\n"
             "except SystemExit:\n"
             "    print('on the way out', flush=True)  # the file\n"
             "    raise\n")
    log = tmp_path / "out.log"

    def to_the_file() -> None:
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT, 0o600), 1)

    proc, master = on_a_terminal([sys.executable, "-c", child], to_the_file)
    read_until(master, proc, lambda seen: b"ready\r\n" in seen, timeout=30)
    os.close(master)
    assert _finish(proc) == 128 + signal.SIGHUP
    assert log.read_text() == "on the way out\n"


def test_a_fork_of_the_process_leaves_at_once_on_sigterm(tmp_path: Path) -> None:
    """A fork (pyroute2's, to enter a namespace) exits 128 + SIGTERM without unwinding
    its copy of the parent's stack (whose clean-up is the parent's to do)."""
    child = ("import os, signal, sys, time\n"
             "from gradlane.signals import unwind_on_signals\n"
             "unwind_on_signals()\n"
             "pid = os.fork()\n"
             "if pid == 0:\n"
             "    try:\n"
             "        time.sleep(30)\n"
             "    finally:\n"
             "        open(sys.argv[1], 'w').write('unwound')\n"
             "    os._exit(0)\n"
             "time.sleep(0.2)\n"
             "os.kill(pid, signal.SIGTERM)\n"
             "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path / "unwound")],
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == [str(128 + signal.SIGTERM)]
    assert not (tmp_path / "unwound").exists()


def test_a_process_told_to_end_with_one_gone_already_exits_at_once() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: no such process
    # Any process (its pidfd cannot be had), or the parent (not the one it has now).
    for call in (f"end_with({gone.pid})", f"end_with_parent({gone.pid})"):
        done = subprocess.run(
            [sys.executable, "-c",
             f"from gradlane.signals import end_with, end_with_parent; {call}; print('on')"],
            capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (128 + signal.SIGTERM, ""), call
