"""The testbed's traffic tool itself, on loopback: what the receiver reports of each flow."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.helpers import port_below_ephemeral

TOOL = [sys.executable, "-m", "gradlane.testbed.traffic"]


def test_the_receiver_reports_every_flow_s_label_dscp_bytes_and_samples() -> None:
    port = port_below_ephemeral()
    recv = subprocess.Popen([*TOOL, "recv", "--bind", "127.0.0.1", "--port", str(port),
                             "--flows", "2", "--timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    senders: list[subprocess.Popen[str]] = []
    try:
        assert recv.stdout is not None and recv.stdout.readline().strip() == "READY"
        # Sizes that are no multiple of the tool's 256 KiB writes.
        for label, dscp, size in (("high", 46, 3_000_001), ("low", 0, 700_003)):
            senders.append(subprocess.Popen(
                [*TOOL, "send", "--to", "127.0.0.1", "--port", str(port), "--dscp", str(dscp),
                 "--label", label, "--bytes", str(size)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        sent = [json.loads(s.communicate(timeout=60)[0]) for s in senders]
        out, err = recv.communicate(timeout=60)
    finally:
        for proc in [recv, *senders]:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert recv.returncode == 0, err
    assert [(s["label"], s["bytes"]) for s in sent] == [("high", 3_000_001), ("low", 700_003)]
    flows = {f["label"]: f for f in json.loads(out)["flows"]}
    assert {k: (f["dscp"], f["bytes"]) for k, f in flows.items()} == {
        "high": (46, 3_000_001), "low": (0, 700_003)}
    for f in flows.values():
        times = [t for t, _ in f["samples"]]
        counts = [b for _, b in f["samples"]]
        # From the first byte (0 then) to the last (all of them), in order.
        assert f["samples"][0] == [f["first"], 0] and f["samples"][-1] == [f["last"], f["bytes"]]
        assert times == sorted(times) and counts == sorted(counts)


def test_a_receiver_that_gets_too_few_flows_ends_at_its_timeout_saying_so() -> None:
    port = port_below_ephemeral()
    done = subprocess.run([*TOOL, "recv", "--bind", "127.0.0.1", "--port", str(port),
                           "--flows", "1", "--timeout", "0.5"],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "READY"
    assert done.returncode == 1 and "receiver timed out with 0/1 flows done" in done.stderr
