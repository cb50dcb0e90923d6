"""What integration tests share: independent looks at the kernel, goodput ceilings,
a fake-backed gradlaned process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gradlane.daemon import protocol
from gradlane.testbed import Cluster
from tests import REPO

# A full TCP segment carries 1448 payload bytes (MSS with timestamps) in a
# 1514-byte frame, which is what HTB charges: the best goodput a shaped rate gives.
PAYLOAD_EFFICIENCY = 1448 / 1514


def max_goodput(rate_bps: float) -> float:
    return rate_bps * PAYLOAD_EFFICIENCY


def tc(namespace: str, *args: str) -> str:
    """Run the real `tc` in a namespace: an independent view of the kernel state."""
    return subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout


def port_below_ephemeral(start: int = 20000) -> int:
    """A loopback port free now and below the kernel's ephemeral range, for a server that
    binds it later (a rank 0's store, a daemon in its own process): no bind to port 0 or
    outgoing connection takes one from there meanwhile, as they may one found by binding
    port 0.

    Each pytest-xdist worker (``make test`` runs the tests that need no namespace in
    several) looks in its own share of those ports: a port one worker found free could
    otherwise be found by another before the first one's server binds it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    span = (low - start) // workers
    base, end = start + worker * span, start + (worker + 1) * span
    for port in range(base + os.getpid() % (span // 2), end):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {base}..{end}")


class AgentStore:
    """A rendezvous store listening in the test process before any rank starts, as
    torchrun's agent holds one for its workers; `env` has ranks on loopback meet there.

    A port merely free when the test picks it (binding port 0) can be taken before rank 0
    binds it, seconds later on a loaded machine: rank 0 then fails (EADDRINUSE) and its
    peers wait out their rendezvous timeout. Keep the object as long as the ranks run.
    """

    def __init__(self, timeout_s: float = 120) -> None:
        import datetime

        import torch.distributed as dist

        self.store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False)
        self.env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True"}


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    socket: Path
    url: str

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/status", timeout=5) as resp:
            return json.load(resp)  # type: ignore[no-any-return]

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def start_daemon(sock: Path, http: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fakes", str(sock), http], cwd=REPO, stderr=subprocess.PIPE
    )


def end(proc: subprocess.Popen[bytes], timeout: float = 15) -> int | None:
    """SIGTERM `proc` and wait for it; its exit code, or None if it had to be killed
    (it ignored SIGTERM for `timeout` seconds): nothing is left running either way."""
    proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None
    finally:
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    sock = tmp_path / "gl.sock"
    port = port_below_ephemeral()
    proc = start_daemon(sock, f"127.0.0.1:{port}")
    running = RunningDaemon(proc, sock, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 20
    while True:
        try:
            running.status()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "daemon did not become ready"
            time.sleep(0.05)
    try:
        yield running
    finally:
        killed_by_test = proc.poll() is not None
        code = end(proc)
    if not killed_by_test:  # a clean stop exits 0 and removes its socket
        assert code == 0
        assert not sock.exists()


def start_netns_daemon(
    cluster: Cluster, host: str, tmp: Path, config: Path | None = None, rate: str = "200mbit"
) -> tuple[subprocess.Popen[str], Path]:
    """Run the real gradlaned on `host`'s eth0; returns it and its socket once it serves."""
    args = ["--config", str(config)] if config is not None else []
    return cluster.start_daemon(host, tmp, rate=rate, args=args)


def stop(proc: subprocess.Popen[str], sig: signal.Signals = signal.SIGTERM) -> int:
    """Signal a daemon and wait for it; its exit code."""
    proc.send_signal(sig)
    code = proc.wait(timeout=20)
    if proc.stderr is not None:
        proc.stderr.close()
    return code


def status(cluster: Cluster, host: str = "h1") -> dict[str, Any]:
    out = cluster.run(host, [sys.executable, "-m", "gradlane.cli", "status", "--json"]).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def wait_for(predicate: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def hello(flows: list[dict[str, Any]], job: str = "train", rank: int = 0) -> dict[str, Any]:
    return {
        "type": "hello",
        "version": 1,
        "job": job,
        "rank": rank,
        "world_size": 4,
        "flows": flows,
    }


def register(sock: Path, message: dict[str, Any]) -> socket.socket:
    client = socket.socket(socket.AF_UNIX)
    client.settimeout(10)
    client.connect(str(sock))
    client.sendall(protocol.encode(message))
    decoder, got = protocol.FrameDecoder(), []
    while len(got) < 2:
        data = client.recv(65536)
        if not data:
            client.close()
            raise AssertionError(f"daemon closed the connection: {got}")
        got += decoder.feed(data)
    assert got[0]["type"] == "welcome", got
    return client
