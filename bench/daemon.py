"""Benchmark gradlaned: change-to-kernel latency and CPU per chunk event.

    sudo .venv/bin/python bench/daemon.py --json bench/results/daemon.json

Builds a 2-host emulated cluster, runs the real `gradlaned` in host h1 and
this script's measuring side in h1 too (so it sees h1's kernel), then:

1. latency: N times, a registered worker moves one band connection to
   another band (a `flows` message); the clock runs from sending it until the
   kernel announces (RTNLGRP_TC) the connection's filter pointing at the new
   leaf. One change at a time finds the daemon idle, so coalescing (which
   gathers the changes that arrive while it is busy) does not delay it.
   The kernel's announcement stops the clock; a dump then confirms the new
   target (not timed).
2. CPU: the daemon's user+system CPU time (from /proc) while it takes
   100,000 chunk events in batches of 1,000, per 1,000 events.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import require_cluster_privileges, unwind_on_signals, write_result  # noqa: E402


def measure(sock_path: str, daemon_pid: int, samples: int) -> dict[str, Any]:
    """Runs inside host h1."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.rtnl import RTM_NEWTFILTER, RTMGRP_TC
    from pyroute2.netlink.rtnl.marshal import MarshalRtnl

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
    ipr = IPRoute()
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
    # The kernel announces every new filter on the RTNLGRP_TC multicast group:
    # the clock stops when the announcement for the new leaf arrives, without
    # polling dumps that would compete with the daemon for the rtnl lock.
    marshal = MarshalRtnl()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as monitor:
        monitor.bind((0, RTMGRP_TC))
        for i in range(samples):
            band = (i + 1) % 4
            start = time.perf_counter()
            client.sendall(protocol.encode({"type": "flows", "flows": [flow(band)]}))
            while True:
                left = 5 - (time.perf_counter() - start)
                if left <= 0:
                    raise RuntimeError("change did not reach the kernel in 5 s")
                monitor.settimeout(left)
                seen = [
                    parse_u32_filter(m)
                    for m in marshal.parse(monitor.recv(1 << 16))
                    if m["header"]["type"] == RTM_NEWTFILTER
                ]
                # The kernel announces a filter once the change is done (for an
                # in-place change it quotes the old target, so only the match
                # is compared here and the target is checked just below).
                if any(f and f.bytemap == keys for f in seen):
                    break
            latencies.append(time.perf_counter() - start)
            if classid_now() != base + band + 1:
                raise RuntimeError(f"after the announcement the flow is not in band {band}")
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
    ipr.close()
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    hist = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics)
        if f.name == "gradlane_reconcile_seconds"
        for s in f.samples
        if s.name.endswith(("_sum", "_count"))
    }
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
        "daemon_reconcile_ms_mean": 1000
        * hist["gradlane_reconcile_seconds_sum"]
        / hist["gradlane_reconcile_seconds_count"],
        "daemon_reconciles": hist["gradlane_reconcile_seconds_count"],
        "daemon_cpu_s_per_1000_chunk_events": used / (batches * per_batch / 1000),
        "chunk_events": batches * per_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/daemon.json")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument(
        "--coalesce-ms",
        type=float,
        default=None,
        help="daemon coalescing window (default: its own)",
    )
    parser.add_argument("--measure", nargs=2, metavar=("SOCKET", "PID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]), args.samples)))
        return
    require_cluster_privileges("bench/daemon.py")

    from gradlane.testbed import Cluster, Topology

    with tempfile.TemporaryDirectory() as tmp, Cluster(Topology.build("bdmn", 2, "1gbit")) as c:
        sock = f"{tmp}/gl.sock"
        config = Path(tmp) / "gradlaned.toml"
        coalesce = "" if args.coalesce_ms is None else f"coalesce_ms = {args.coalesce_ms}\n"
        config.write_text(f'[daemon]\n{coalesce}\n[[interface]]\nname = "eth0"\nrate = "1gbit"\n')
        daemon = c.popen("h1", [sys.executable, "-m", "gradlane.cli", "daemon", "--config",
                                str(config), "--socket", sock, "--state-dir", tmp,
                                "--http", "127.0.0.1:9464"])  # fmt: skip
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
        "config": {
            "link": "1gbit",
            "coalesce_ms": 2.0 if args.coalesce_ms is None else args.coalesce_ms,
            "samples": args.samples,
        },
        "results": json.loads(out.stdout),
        "notes": (
            "change_to_kernel_ms is the target figure (one change at a time, daemon idle "
            "between them). daemon_reconcile_ms_mean averages every reconcile of the run, "
            "including start-up and registrations, which re-read the kernel's tree."
        ),
    }
    write_result(args.json, result)
    lat = result["results"]["change_to_kernel_ms"]
    print(
        f"change -> kernel: median {lat['median']:.2f} ms, p90 {lat['p90']:.2f} ms "
        f"({lat['samples']} samples; daemon reconcile mean "
        f"{result['results']['daemon_reconcile_ms_mean']:.2f} ms); daemon CPU "
        f"{result['results']['daemon_cpu_s_per_1000_chunk_events'] * 1000:.2f} ms per 1,000 "
        f"chunk events -> {args.json}"
    )


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
