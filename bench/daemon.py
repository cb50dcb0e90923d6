"""Benchmark gradlaned: change-to-kernel latency and CPU per chunk event.

    sudo .venv/bin/python bench/daemon.py --json bench/results/daemon.json

Builds a 2-host emulated cluster, runs the real `gradlaned` in host h1 and
this script's measuring side in h1 too (so it sees h1's kernel), then:

1. latency: N times, a registered worker moves one band connection to
   another band (a `flows` message); the clock runs from sending it until a
   netlink dump of h1's filters shows the connection's filter pointing at the
   new leaf. This includes the daemon's coalescing window (coalesce_ms).
2. CPU: the daemon's user+system CPU time (from /proc) while it takes
   100,000 chunk events in batches of 1,000, per 1,000 events.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def environment() -> dict[str, Any]:
    def run(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO).stdout.strip()

    import pyroute2

    import gradlane

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line),
        platform.processor(),
    )
    return {
        "commit": run("git", "rev-parse", "HEAD"),
        "dirty": bool(run("git", "status", "--porcelain")),
        "kernel": platform.release(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "gradlane": gradlane.__version__,
        "pyroute2": pyroute2.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def measure(sock_path: str, daemon_pid: int, samples: int) -> dict[str, Any]:
    """Runs inside host h1."""
    from pyroute2 import IPRoute

    from gradlane.daemon import protocol
    from gradlane.daemon.tc import ipv4_tcp_keys, parse_u32_filter, u32_bytemap

    client = socket.socket(socket.AF_UNIX)
    client.connect(sock_path)
    decoder = protocol.FrameDecoder()

    def flow(band: int) -> dict[str, Any]:
        return {
            "band": band,
            "src": "10.200.0.1",
            "sport": 45000,
            "dst": "10.200.0.2",
            "dport": 5201,
        }

    client.sendall(protocol.encode({"type": "hello", "version": 1, "job": "bench", "rank": 0,
                                    "world_size": 1, "flows": [flow(0)]}))  # fmt: skip
    got: list[dict[str, Any]] = []
    while len(got) < 2:
        got += decoder.feed(client.recv(65536))
    keys = u32_bytemap(ipv4_tcp_keys("10.200.0.1", 45000, "10.200.0.2", 5201))
    latencies = []
    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname="eth0")[0]

        def classid_now() -> int | None:
            for msg in ipr.get_filters(index, parent=0x474C0000):
                f = parse_u32_filter(msg)
                if f is not None and f.bytemap == keys:
                    return f.classid
            return None

        deadline = time.monotonic() + 10
        while classid_now() is None:
            assert time.monotonic() < deadline, "the worker's filter never appeared"
            time.sleep(0.001)
        base = classid_now() & ~0xFF  # type: ignore[operator]
        for i in range(samples):
            band = (i + 1) % 4
            start = time.perf_counter()
            client.sendall(protocol.encode({"type": "flows", "flows": [flow(band)]}))
            while classid_now() != base + band + 1:
                if time.perf_counter() - start > 5:
                    raise RuntimeError("change did not reach the kernel in 5 s")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)  # let the next change start from an idle daemon

    def cpu_seconds() -> float:
        fields = Path(f"/proc/{daemon_pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    batches, per_batch = 100, 1000
    event = [3, 65536, 1, 0.0]
    before = cpu_seconds()
    for i in range(batches):
        client.sendall(protocol.encode({"type": "chunks", "iteration": i,
                                        "events": [event] * per_batch}))  # fmt: skip
    # a timing message after the chunks: once the daemon answers nothing
    # more is queued. Use a fresh connection's hello/welcome as the barrier.
    barrier = socket.socket(socket.AF_UNIX)
    barrier.connect(sock_path)
    barrier.sendall(protocol.encode({"type": "hello", "version": 1, "job": "barrier", "rank": 0,
                                     "world_size": 1, "flows": []}))  # fmt: skip
    barrier.recv(65536)
    time.sleep(0.5)  # the first client's frames are handled before it goes idle
    used = cpu_seconds() - before
    client.close()
    barrier.close()
    ms = [x * 1000 for x in latencies]
    return {
        "change_to_kernel_ms": {
            "samples": len(ms),
            "median": statistics.median(ms),
            "p90": statistics.quantiles(ms, n=10)[-1],
            "min": min(ms),
            "max": max(ms),
            "raw": ms,
        },
        "daemon_cpu_s_per_1000_chunk_events": used / (batches * per_batch / 1000),
        "chunk_events": batches * per_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/daemon.json")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--measure", nargs=2, metavar=("SOCKET", "PID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]), args.samples)))
        return
    if os.geteuid() != 0:
        sys.exit("bench/daemon.py needs root (it builds an emulated cluster)")

    from gradlane.testbed import Cluster, Topology

    with tempfile.TemporaryDirectory() as tmp, Cluster(Topology.build("bdmn", 2, "1gbit")) as c:
        sock = f"{tmp}/gl.sock"
        daemon = c.popen("h1", [sys.executable, "-m", "gradlane.cli", "daemon", "-i", "eth0=1gbit",
                                "--socket", sock, "--state-dir", tmp, "--http", ""])  # fmt: skip
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert time.monotonic() < deadline and daemon.poll() is None, "daemon did not start"
            time.sleep(0.05)
        time.sleep(0.2)
        argv = [sys.executable, str(Path(__file__).resolve()), "--samples", str(args.samples)]
        out = c.run("h1", [*argv, "--measure", sock, str(daemon.pid)], timeout=300)
        daemon.terminate()
        daemon.wait(timeout=20)
    result = {
        "benchmark": "gradlaned change-to-kernel latency and CPU per chunk event",
        "environment": environment(),
        "config": {"link": "1gbit", "coalesce_ms": 2, "samples": args.samples},
        "results": json.loads(out.stdout),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    lat = result["results"]["change_to_kernel_ms"]
    print(
        f"change -> kernel: median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms "
        f"({lat['samples']} samples); daemon CPU "
        f"{result['results']['daemon_cpu_s_per_1000_chunk_events'] * 1000:.2f} ms per 1,000 "
        f"chunk events -> {args.json}"
    )


if __name__ == "__main__":
    main()
