"""Measure the shim engine's chunk timing between two hosts (priority tests).

``main(["--rank", R, "--master", ADDR:PORT, "--address", A, "--bands", K,
"--socket", SOCK, "--out", FILE])`` runs in both hosts of an emulated cluster
(forked: `gradlane.testbed.Cluster.fork`), each with a gradlaned on SOCK.
Both ranks register their band connections with their daemon, then run the
same steps; rank 0 writes JSON to FILE:

- ``order``: four 2 MB groups of priorities 0..3 (band = priority, or band 0
  with one band) are made ready in backward order 3, 2, 1, 0 within a few
  milliseconds; their completion order on rank 0.
- ``high_latency_s``: an 8 MB priority-9 group (last band) starts streaming;
  0.3 s later a 64 KB priority-0 group (band 0) becomes ready; the time
  from that until it is averaged on rank 0. The median of three such steps
  (``high_latencies_s``), so that one stall of a process (this machine is
  shared) does not decide it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from gradlane.shim.client import DaemonClient
from gradlane.shim.config import DEFAULT_DSCP, ShimConfig
from gradlane.shim.engine import Engine, Group
from gradlane.shim.layout import split
from gradlane.shim.transport import Mesh

MB = 1 << 20


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--bands", type=int, choices=[1, 4], required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    host, port = args.master.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), 2, is_master=args.rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    config = ShimConfig(
        dscp=DEFAULT_DSCP[: args.bands], daemon_socket=args.socket, job=f"probe{args.bands}"
    )
    mesh = Mesh(args.rank, 2, store, args.address, config.dscp, credit_bytes=config.credit_bytes)
    client = DaemonClient(config, args.rank, 2, mesh)
    deadline = time.monotonic() + 20
    while not client.connected:
        if time.monotonic() > deadline:
            raise SystemExit("the daemon did not accept the registration")
        time.sleep(0.05)
    time.sleep(0.5)  # the daemon installs the flows' filters
    engine = Engine(mesh, timeout_s=60)
    done: dict[str, float] = {}

    def stamp(group: Group) -> None:
        done[group.label] = time.monotonic()

    def group(gid: int, label: str, nbytes: int, priority: int, band: int) -> Group:
        ranges = split(nbytes // 4, 4, config.chunk_bytes)
        return engine.add_group(
            gid,
            label,
            torch.ones(nbytes // 4),
            ranges,
            [1] * len(ranges),
            priority=priority,
            band=min(band, args.bands - 1),
            on_done=stamp,
        )

    warm = group(0, "warm-up", 4 * MB, 0, 0)
    ordered = [group(1 + p, f"p{p}", 2 * MB, p, p) for p in range(4)]
    bulk = group(5, "bulk", 8 * MB, 9, 3)
    high = group(6, "high", 64 << 10, 0, 0)  # front layers are small (ResNet-50 conv1: 37 KB)

    engine.begin(0, 1)
    engine.ready(warm)
    engine.wait([warm])

    engine.begin(1, 1)
    for g in reversed(ordered):  # backward order: the last layer's gradient first
        engine.ready(g)
    engine.wait(ordered)
    order = sorted((g.label for g in ordered), key=lambda label: done[label])

    latencies = []
    for step in (2, 3, 4):
        engine.begin(step, 1)
        engine.ready(bulk)
        time.sleep(0.3)
        started = time.monotonic()
        engine.ready(high)
        engine.wait([high, bulk])
        latencies.append(done["high"] - started)

    engine.close()
    client.close()
    if args.rank == 0:
        args.out.write_text(json.dumps({"order": order,
                                        "high_latency_s": statistics.median(latencies),
                                        "high_latencies_s": latencies,
                                        "registered": client.daemon_bands is not None}))


if __name__ == "__main__":
    main()
