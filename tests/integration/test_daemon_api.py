"""gradlaned's local API, /status and /metrics, against a real daemon process.

The daemon runs with an in-memory qdisc backend (tests/fakes.py), so these
tests need no root; the kernel side is covered by test_daemon_netns.py.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gradlane.daemon import protocol
from gradlane.daemon.config import DEFAULT_SHAPE_FRACTION
from gradlane.daemon.service import host_id
from gradlane.errors import ProtocolError
from tests.integration.helpers import RunningDaemon, end, start_daemon


class Client:
    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.decoder = protocol.FrameDecoder()
        self.inbox: list[dict[str, Any]] = []

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(protocol.encode(message))

    def recv(self) -> dict[str, Any]:
        while not self.inbox:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.inbox += self.decoder.feed(data)
        return self.inbox.pop(0)

    def close(self) -> None:
        self.sock.close()


def hello(job: str, rank: int = 0, sport: int = 40000) -> dict[str, Any]:
    flow = {"band": 0, "src": "10.0.0.1", "sport": sport, "dst": "10.0.0.2", "dport": 5201}
    return {
        "type": "hello",
        "version": 1,
        "job": job,
        "rank": rank,
        "world_size": 2,
        "flows": [flow],
    }


def test_hello_gets_welcome_and_plan_and_shows_in_status(daemon: RunningDaemon) -> None:
    client = Client(daemon.socket)
    # As its ranks agreed; a name rich would take for markup (and fail on) is shown as it is.
    client.send({**hello("train[/]"), "global_batch": 32})
    welcome, plan = client.recv(), client.recv()
    assert welcome["type"] == "welcome" and welcome["bands"] == [46, 34, 26, 18]
    assert plan["type"] == "plan" and plan["batch_share"] is None
    # Its host's name: this process shares gradlaned's boot and network namespace.
    assert welcome["host"] == daemon.status()["host"] == host_id()
    # Each address of its interfaces, with the rate it shapes the interface to.
    assert welcome["nics"] == [["10.0.0.1", int(1e9 * DEFAULT_SHAPE_FRACTION)]]
    client.send({"type": "chunks", "iteration": 2, "events": [[0, 1000, 0, 0.5], [3, 24, 3, 0.6]]})
    client.send({"type": "timing", "iteration": 2, "compute_s": 0.1, "comm_s": 0.2, "samples": 8})
    deadline = time.monotonic() + 5
    while True:
        jobs = daemon.status()["jobs"]
        if jobs and jobs[0]["workers"][0]["chunk_events"] == 2:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    worker = jobs[0]["workers"][0]
    assert jobs[0]["name"] == "train[/]" and worker["chunk_bytes"] == [1000, 0, 0, 24]
    assert worker["last_timing"]["samples"] == 8 and worker["flows"] == 1
    assert worker["global_batch"] == 32

    shown = subprocess.run(
        [sys.executable, "-m", "gradlane.cli", "status", "--url", daemon.url],
        capture_output=True, text=True, timeout=30, check=True,
        env={**os.environ, "COLUMNS": "200"},  # one line per row
    ).stdout  # fmt: skip
    assert "train[/]" in shown and "policy fair" in shown and "474c:" in shown
    assert "8 of 32" in shown  # its latest batch, of the job's
    as_json = subprocess.run(
        [sys.executable, "-m", "gradlane.cli", "status", "--url", daemon.url, "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(as_json)["jobs"][0]["name"] == "train[/]"

    client.send({"type": "bye"})
    with pytest.raises(ConnectionError):
        client.recv()
    client.close()


def test_status_of_a_daemon_without_workers_says_so(daemon: RunningDaemon) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "gradlane.cli", "status", "--url", daemon.url],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert "jobs: none (no training process has registered)" in shown
    assert "┏" in shown  # the classes' table, there all the same


def test_metrics_parse_with_prometheus_parser(daemon: RunningDaemon) -> None:
    client = Client(daemon.socket)
    client.send(hello("train"))
    client.recv()
    client.send({"type": "chunks", "iteration": 1, "events": [[0, 1, 0, 0.0]] * 5})
    time.sleep(1.5)  # one stats sample
    with urllib.request.urlopen(f"{daemon.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    workers = {s.labels["job"]: s.value for s in families["gradlane_workers"].samples}
    assert workers == {"train": 1.0}
    reconcile = {s.name: s.value for s in families["gradlane_reconcile_seconds"].samples
                 if s.name.endswith(("_count", "_sum"))}
    status = daemon.status()  # read after: it may have seen a reconcile more, never fewer
    count, spent = reconcile["gradlane_reconcile_seconds_count"], reconcile[
        "gradlane_reconcile_seconds_sum"]
    assert 1 <= count <= status["reconcile"]["count"] <= count + 1, (count, status["reconcile"])
    assert 0 < spent <= status["uptime_s"]  # one after another, all since the daemon started
    chunks = [s for s in families["gradlane_chunk_events"].samples if s.name.endswith("_total")]
    assert chunks[0].value == 5
    assert {"gradlane_class_bytes", "gradlane_class_drops", "gradlane_api_errors"} <= set(families)
    client.close()


def test_out_of_order_and_conflicts_get_errors(daemon: RunningDaemon) -> None:
    early = Client(daemon.socket)
    early.send({"type": "chunks", "iteration": 1, "events": []})
    assert early.recv() == {"type": "error", "code": "order", "message": "chunks before hello"}
    first = Client(daemon.socket)
    first.send(hello("train"))
    first.recv()
    second = Client(daemon.socket)
    second.send(hello("train"))  # same job and rank, first process still alive
    reply = second.recv()
    assert reply["code"] == "conflict" and "is registered already" in reply["message"]
    first.send(hello("train"))
    assert first.recv()["type"] == "plan"
    assert first.recv()["code"] == "order"
    for c in (early, first, second):
        c.close()


def test_a_burst_of_registrations_is_coalesced(daemon: RunningDaemon) -> None:
    before = daemon.status()["reconcile"]["count"]
    clients = [Client(daemon.socket) for _ in range(60)]
    for i, c in enumerate(clients):
        # 1 ms apart: each would find the daemon idle were it not for the
        # coalescing window (2 ms) after every reconcile. A stalled machine
        # only bunches them further.
        c.send(hello(f"burst{i}"))
        time.sleep(0.001)
    for c in clients:
        assert c.recv()["type"] == "welcome"
    deadline = time.monotonic() + 5
    while len(daemon.status()["jobs"]) != 60 or daemon.status()["reconcile"]["count"] == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)  # any trailing reconcile
    reconciles = daemon.status()["reconcile"]["count"] - before
    # Measured here: 17-18 with the window, 43-45 without it.
    assert 1 <= reconciles <= 30, reconciles
    for c in clients:
        c.close()


def test_client_limit(daemon: RunningDaemon) -> None:
    clients = [Client(daemon.socket) for _ in range(64)]
    for i, c in enumerate(clients):  # the daemon has them all before the next arrives
        c.send(hello("many", rank=0, sport=1000 + i) | {"world_size": 1, "job": f"j{i}"})
        assert c.recv()["type"] == "welcome"
    extra = Client(daemon.socket)
    assert extra.recv()["code"] == "limit"
    for c in [*clients, extra]:
        c.close()


def test_second_daemon_on_the_same_socket_refuses_to_start(daemon: RunningDaemon) -> None:
    proc = start_daemon(daemon.socket, "")
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        end(proc)  # not left serving if it did not refuse
    assert proc.returncode != 0 and b"another gradlaned is serving" in err
    assert daemon.status()["clients"] == 0  # the first one still serves, on its socket too:
    client = Client(daemon.socket)  # the second, failing, left it where it was
    client.send(hello("after"))
    assert client.recv()["type"] == "welcome"
    client.close()


# -- fuzzing -----------------------------------------------------------------

VALID = [
    hello("fuzz"),
    {"type": "chunks", "iteration": 3, "events": [[1, 4096, 2, 0.25]] * 3},
    {"type": "timing", "iteration": 3, "compute_s": 0.1, "comm_s": 0.05, "samples": 16},
    {"type": "flows", "flows": hello("x")["flows"]},
]
ODD_VALUES = [None, True, -1, 2**63, 1.5, "", "x" * 200, [], {}, [1, 2], {"a": 1}, b"\x00"]


def bad_frame(rng: random.Random) -> tuple[str, bytes]:
    """One hostile input of a random kind, as raw bytes for a fresh connection."""
    kind = rng.choice(["garbage", "truncated", "oversized", "typed", "mutated", "order"])
    base = rng.choice(VALID)
    frame = protocol.encode(base)
    if kind == "garbage":
        body = rng.randbytes(rng.randint(1, 64))
        return kind, len(body).to_bytes(4, "big") + body
    if kind == "truncated":
        return kind, frame[: rng.randint(1, len(frame) - 1)]
    if kind == "oversized":
        return kind, rng.randint(protocol.MAX_FRAME + 1, 2**32 - 1).to_bytes(4, "big") + b"x" * 16
    if kind == "typed":
        message = dict(base)
        message[rng.choice(list(message))] = rng.choice(ODD_VALUES)
        body = msgpack.packb(message)
        return kind, len(body).to_bytes(4, "big") + body
    if kind == "mutated":
        data = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(4, len(data))] = rng.randrange(256)
        return kind, bytes(data)
    return kind, protocol.encode(rng.choice(VALID[1:]))  # anything but hello first


def expect_error(data: bytes) -> bool:
    """Whether the protocol itself says this input is bad (as the first message)."""
    try:
        messages = list(protocol.FrameDecoder().feed(data))
        if not messages or len(data) != sum(4 + len(msgpack.packb(m)) for m in messages):
            return True  # truncated, or trailing bytes
        first = protocol.parse(messages[0], bands=4)
    except (ProtocolError, ValueError):
        return True
    return not isinstance(first, protocol.Hello)


@pytest.mark.timeout(300)
def test_fuzz_ten_thousand_bad_frames(daemon: RunningDaemon) -> None:
    rng = random.Random(20261122)
    good = Client(daemon.socket)
    good.send(hello("good"))
    assert good.recv()["type"] == "welcome"
    good.recv()
    rss_before = daemon.rss_kib()
    errors = 0
    kinds: dict[str, int] = {}
    for i in range(10_000):
        kind, data = bad_frame(rng)
        kinds[kind] = kinds.get(kind, 0) + 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(daemon.socket))
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            replies = b""
            while chunk := s.recv(65536):
                replies += chunk
        got = list(protocol.FrameDecoder().feed(replies))
        got_error = any(m.get("type") == "error" for m in got)
        assert got_error == expect_error(data), (kind, data[:80], got)
        errors += got_error
        if i % 500 == 0:  # the well-behaved client keeps working throughout
            good.send({"type": "chunks", "iteration": i, "events": [[0, 10, 0, 0.0]]})
    assert errors >= 9_000, kinds
    assert daemon.proc.poll() is None  # never died
    deadline = time.monotonic() + 5
    while daemon.status()["jobs"][0]["workers"][0]["chunk_events"] != 20:
        assert time.monotonic() < deadline, daemon.status()["jobs"]
        time.sleep(0.05)
    status = daemon.status()
    assert [j["name"] for j in status["jobs"]] == ["good"]  # no fuzz registration left
    assert status["clients"] == 1
    assert sum(status["api_errors"].values()) == errors
    growth_mib = (daemon.rss_kib() - rss_before) / 1024
    assert growth_mib < 20, f"daemon RSS grew by {growth_mib:.1f} MiB"
    good.close()
