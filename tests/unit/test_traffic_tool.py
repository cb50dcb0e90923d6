"""The testbed's traffic tool itself, on loopback: what the receiver reports of each flow."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from gradlane.testbed.traffic import SAMPLE_EVERY
from tests.integration.helpers import port_below_ephemeral

TOOL = [sys.executable, "-m", "gradlane.testbed.traffic"]


def test_the_receiver_reports_every_flow_s_label_dscp_bytes_and_samples() -> None:
    port = port_below_ephemeral()
    recv = subprocess.Popen([*TOOL, "recv", "--bind", "127.0.0.1", "--port", str(port),
                             "--flows", "3", "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    senders: list[subprocess.Popen[str]] = []
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "READY"
        # Sizes that are no multiple of the tool's 256 KiB writes; one flow sized by time.
        for label, dscp, size in (("high", 46, ["--bytes", "3000001"]),
                                  ("low", 0, ["--bytes", "700003"]),
                                  ("timed", 8, ["--seconds", "0.3"])):
            senders.append(subprocess.Popen(
                [*TOOL, "send", "--to", "127.0.0.1", "--port", str(port), "--dscp", str(dscp),
                 "--label", label, *size],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        sent = [json.loads(s.communicate(timeout=60)[0]) for s in senders]
        out, err = recv.communicate(timeout=60)
    finally:
        for proc in [recv, *senders]:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert recv.returncode == 0, err
    timed = sent[2]["bytes"]
    assert [(s["label"], s["bytes"]) for s in sent] == [("high", 3_000_001), ("low", 700_003),
                                                        ("timed", timed)]
    assert timed > 0 and 0.3 <= sent[2]["seconds"] < 30  # sent for 0.3 s, then drained
    flows = {f["label"]: f for f in json.loads(out)["flows"]}
    assert {k: (f["dscp"], f["bytes"]) for k, f in flows.items()} == {
        "high": (46, 3_000_001), "low": (0, 700_003), "timed": (8, timed)}
    for f in flows.values():
        times = [t for t, _ in f["samples"]]
        counts = [b for _, b in f["samples"]]
        # From the first byte (0 then) to the last (all of them), in order.
        assert f["samples"][0] == [f["first"], 0] and f["samples"][-1] == [f["last"], f["bytes"]]
        assert times == sorted(times) and counts == sorted(counts)
        # A sample every SAMPLE_EVERY at most, the last one at the close whenever it came.
        assert all(b - a >= SAMPLE_EVERY for a, b in itertools.pairwise(times[:-1]))
    assert len(flows["timed"]["samples"]) > 5  # 0.3 s of it


def test_a_receiver_that_gets_too_few_flows_ends_at_its_timeout_saying_so() -> None:
    port = port_below_ephemeral()
    done = subprocess.run([*TOOL, "recv", "--bind", "127.0.0.1", "--port", str(port),
                           "--flows", "1", "--timeout", "0.5"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "READY"
    assert done.returncode == 1 and "receiver timed out with 0/1 flows done" in done.stderr


def test_a_sender_started_before_its_receiver_waits_for_it() -> None:
    port = port_below_ephemeral()
    send = subprocess.Popen([*TOOL, "send", "--to", "127.0.0.1", "--port", str(port),
                             "--bytes", "100000", "--connect-timeout", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)  # refused meanwhile: it retries
        recv = subprocess.run([*TOOL, "recv", "--bind", "127.0.0.1", "--port", str(port),
                               "--timeout", "30"], capture_output=True, text=True, timeout=60)
        out, err = send.communicate(timeout=60)
    finally:
        if send.poll() is None:
            send.kill()
            send.communicate()
    assert send.returncode == 0, err
    assert json.loads(out)["bytes"] == 100_000
    assert recv.returncode == 0, recv.stderr
    flow = json.loads(recv.stdout.splitlines()[1])["flows"][0]
    assert (flow["bytes"], flow["dscp"]) == (100_000, 0)  # DSCP 0 unless given


@pytest.mark.parametrize(("args", "says"), [
    (["send", "--to", "127.0.0.1", "--dscp", "64", "--bytes", "1"],
     "argument --dscp: must be in 0..63, got 64"),
    (["send", "--to", "127.0.0.1", "--seconds", "inf"],
     "argument --seconds: must be in 0.0..3600.0, got inf"),
    (["send", "--to", "127.0.0.1", "--bytes", "0"], "argument --bytes: must be in 1.."),
    (["send", "--to", "127.0.0.1", "--port", "0", "--bytes", "1"],
     "argument --port: must be in 1..65535, got 0"),
    (["recv", "--timeout", "soon"], "argument --timeout: not a number: 'soon'"),
    (["recv", "--flows", "0"], "argument --flows: must be in 1..1024, got 0"),
])
def test_a_bad_argument_is_refused_before_anything_is_sent_or_bound(
        args: list[str], says: str) -> None:
    """Every run of the tool is bounded: no endless flow or wait, no DSCP the socket
    option would refuse with a traceback."""
    done = subprocess.run([*TOOL, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert done.stdout == ""  # no READY: nothing bound
