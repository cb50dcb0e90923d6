"""Benchmark the shim's transport: throughput, CPU per MB, chunk size.

    .venv/bin/python bench/shim_transport.py                   # loopback only
    sudo .venv/bin/python bench/shim_transport.py --testbed    # + a 1 Gbit/s emulated link

Two worker processes synchronize one 64 MB float32 gradient with the shim's
engine (reduce-scatter + all-gather over 4 band connections per peer, the
same code `attach` uses), `--reps` times per chunk size, after 2 warm-ups.
For each rep rank 0 times ``ready`` -> averaged.

Reported per chunk size:
- ``gradient_GBps``: gradient bytes / time (what a training step sees);
- ``wire_GBps``: payload bytes each process sent / time. With 2 workers each
  sends half the gradient as its contribution and half as results, so the
  wire carries the gradient size in each direction;
- ``cpu_ms_per_MB``: rank 0's CPU time (all threads, user + system) per MB
  of gradient synchronized.

On the testbed the two processes run in two emulated hosts joined by
1 Gbit/s links (no daemon: one job alone), and goodput is compared with the
link's payload capacity (rate x 1448/1514, what TCP can carry in full frames).

Choosing the default chunk size: small chunks preempt sooner (a high-priority
chunk waits for at most one chunk per connection) but each costs a fixed
amount of CPU; loopback is the CPU-bound worst case. ``recommended_chunk_bytes``
is the smallest size reaching 75% of the best loopback throughput: on a real
link, where the network and not the CPU is the bottleneck, its overhead is
then a few percent at most. The JSON also lists each size's preemption delay
at 1 Gbit/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import (  # noqa: E402
    require_cluster_privileges,
    run_ranks,
    unwind_on_signals,
    write_result,
)

from gradlane.benchmark import PAYLOAD_EFFICIENCY  # noqa: E402

CHUNK_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(args: argparse.Namespace) -> None:
    """One worker: rendezvous, then time every chunk size."""
    import datetime

    import torch
    import torch.distributed as dist

    from gradlane.shim.config import DEFAULT_DSCP
    from gradlane.shim.engine import Engine
    from gradlane.shim.layout import assign_owners, split
    from gradlane.shim.transport import Mesh

    torch.set_num_threads(1)
    host, port = args.master.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), 2, is_master=args.rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    mesh = Mesh(args.rank, 2, store, args.address, DEFAULT_DSCP, credit_bytes=128 << 10)
    engine = Engine(mesh, timeout_s=60)
    numel = args.size_mb * (1 << 20) // 4
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(args.rank))
    results = []
    step = 0
    for gid, chunk in enumerate(args.chunks):
        ranges = split(numel, 4, chunk)
        owners = assign_owners([(b - a) * 4 for a, b in ranges], 2)
        group = engine.add_group(gid, f"{chunk}", grad, ranges, owners, priority=0, band=0)
        times, cpu = [], 0.0
        for rep in range(args.reps + 2):
            engine.begin(step, 1)
            c0, t0 = cpu_seconds(), time.perf_counter()
            engine.ready(group)
            engine.wait([group])
            dt, dc = time.perf_counter() - t0, cpu_seconds() - c0
            step += 1
            if rep >= 2:
                times.append(dt)
                cpu += dc
        size = numel * 4
        median = statistics.median(times)
        results.append(
            {
                "chunk_bytes": chunk,
                "times_s": [round(t, 5) for t in times],
                "median_s": round(median, 5),
                "gradient_GBps": round(size / median / 1e9, 3),
                "wire_GBps": round(size / median / 1e9, 3),
                "wire_Gbps": round(size * 8 / median / 1e9, 3),
                "cpu_ms_per_MB": round(cpu * 1000 / (len(times) * size / 1e6), 4),
                "preemption_delay_ms_at_1Gbps": round(chunk * 8 / 1e9 * 1000, 2),
            }
        )
    engine.close(linger_s=10)
    if args.rank == 0:
        print(json.dumps(results))


def run_pair(argv: list[str], hosts: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Run the two ranks; `hosts` gives (address, popen function) per rank."""
    return json.loads(run_ranks(argv, hosts, timeout_s=600)[0])  # type: ignore[no-any-return]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pick_default(loopback: list[dict[str, Any]]) -> int:
    best = max(r["gradient_GBps"] for r in loopback)
    return min(r["chunk_bytes"] for r in loopback if r["gradient_GBps"] >= 0.75 * best)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/shim_transport.json")
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--testbed", action="store_true", help="also measure a 1 Gbit/s link (root)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument(
        "--chunks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=CHUNK_SIZES,
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    base = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--size-mb",
        str(args.size_mb),
        "--reps",
        str(args.reps),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def local(argv: list[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(argv, env=env, **kw)

    master = f"127.0.0.1:{free_port()}"
    print(f"loopback: {args.size_mb} MB gradient, chunk sizes {args.chunks} ...", flush=True)
    loopback = run_pair([*base, "--master", master], [("127.0.0.1", local)] * 2)
    default = pick_default(loopback)
    result: dict[str, Any] = {
        "benchmark": "shim transport: 2 processes, one gradient, reduce-scatter + all-gather",
        "config": {
            "gradient_MB": args.size_mb,
            "reps": args.reps,
            "bands": 4,
            "credit_bytes": 128 << 10,
        },
        "loopback": loopback,
        "recommended_chunk_bytes": default,
    }
    at_default = next(r for r in loopback if r["chunk_bytes"] == default)
    print(
        f"loopback at chunk {default >> 10} KiB: {at_default['gradient_GBps']} GB/s, "
        f"{at_default['cpu_ms_per_MB']} ms CPU per MB",
        flush=True,
    )
    if args.testbed:
        require_cluster_privileges("bench/shim_transport.py --testbed")
        from gradlane.testbed import Cluster, Topology

        rate = 1e9
        with Cluster(Topology.build("btrn", 2, "1gbit")) as c:
            hosts = [
                (c.addr(h), lambda argv, h=h, **kw: c.popen(h, argv, env=env, **kw))
                for h in ("h1", "h2")
            ]
            runs = run_pair(
                [*base, "--master", f"{c.addr('h1')}:29400", "--chunks", str(default)], hosts
            )
        run = runs[0]
        goodput = run["wire_Gbps"] * 1e9
        result["testbed"] = {
            "link_bps": rate,
            **run,
            "goodput_fraction_of_payload_capacity": round(goodput / (rate * PAYLOAD_EFFICIENCY), 3),
            "goodput_fraction_of_line_rate": round(goodput / rate, 3),
        }
        print(
            f"testbed 1 Gbit/s: {run['wire_Gbps']} Gbit/s each way = "
            f"{result['testbed']['goodput_fraction_of_payload_capacity']:.1%} of payload "
            f"capacity",
            flush=True,
        )
    write_result(args.json, result)
    print(f"-> {args.json}")


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
