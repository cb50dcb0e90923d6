"""Copying rank 0's model to every rank at attach, on the emulated cluster (needs root).

    sudo .venv/bin/python bench/state_copy.py [--hosts 8] [--model-mb 64] [--reps 3] [--nics 2]

`gradlane.shim.attach` copies rank 0's parameters and buffers to every rank
along a path through the ranks' connections (`Routes.copy_parents`), each
rank passing on each piece of a chunk's size as it comes
(`gradlane.shim.transport.relay`). This measures that copy of a VGG-19-shaped
model (the profile's tensors scaled to ``--model-mb`` MiB; its largest layer
is three quarters of it) between `--hosts` emulated hosts on 1 Gbit/s links,
over the shim's real connections, three ways in the same run, in turns:

- ``path``: what attach does;
- ``routes``: down the result routes of the chunks rank 0 owns, in pieces;
- ``routes_whole``: the same, each tensor passed on once it is whole (what
  attach did before: ``relay`` with pieces as large as the largest tensor).

for the ring exchange (its result routes are the path: W-1 hops) and the flat
one (rank 0 sends to every rank itself). With ``--nics 2`` (two NICs a host,
each on its own switch plane, both at the rate) it compares instead, along the
path, ``planes`` (what attach does there: every other piece on the second
plane, `gradlane.shim.transport.relay_planes`) and ``plane0`` (all on the
first, as attach did before), into ``state_copy-2nics.json``. A copy's time
runs from the first rank leaving a store barrier to the last one holding the
whole model (one clock: the hosts are namespaces of one machine). Also reported: the model's time on
one link at TCP's payload rate, the least any copy can take.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO,
    require_cluster_privileges,
    run_ranks,
    unwind_on_signals,
    write_result,
)

from gradlane.benchmark import PAYLOAD_EFFICIENCY  # noqa: E402

RATE = "1gbit"
RATE_BPS = 1e9
EXCHANGES = ("ring", "flat")
WAYS = ("path", "routes", "routes_whole")
PLANE_WAYS = ("planes", "plane0")  # --nics 2: along the path, over both planes or the first


def rank_main(args: argparse.Namespace) -> None:
    """One rank: connect as attach does, then time every (exchange, way) `reps` times."""
    import torch
    import torch.distributed as dist

    from gradlane.policies.chunks import Routes
    from gradlane.policies.profiles import trace_spec
    from gradlane.shim.config import DEFAULT_DSCP, ShimConfig
    from gradlane.shim.transport import Mesh, gather, relay, relay_planes, tensor_bytes

    torch.set_num_threads(1)
    rank, world = args.rank, args.world
    host, port = args.master.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    mesh = Mesh(rank, world, store, args.address.split(","), DEFAULT_DSCP,
                credit_bytes=128 << 10, connect=False)
    mesh.connect(r for r in range(world) if r != rank)  # both exchanges' peers
    chunk = ShimConfig().chunk_bytes
    sizes = [n for n, _, _ in trace_spec("vgg19", args.model_mb, 0.1)]
    tensors = [torch.zeros(n) for n in sizes]
    if rank == 0:
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(n, generator=g) for n in sizes]
    views = [tensor_bytes(t) for t in tensors]
    largest = max(len(v) for v in views)
    ways = PLANE_WAYS if mesh.planes > 1 else WAYS
    times: dict[str, dict[str, list[float]]] = {e: {w: [] for w in ways} for e in EXCHANGES}
    for rep in range(args.reps):
        for exchange in EXCHANGES:
            routes = Routes.agreed(exchange, world, None, None)
            for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                parents = (routes.of(0)[1] if way.startswith("routes")
                           else routes.copy_parents())
                tree = mesh.tree(parents)
                if rank != 0:
                    for t in tensors:
                        t.zero_()
                key = f"copy/{rep}/{exchange}/{way}"
                gather(store, f"{key}/go", rank, world, "")
                began = time.monotonic()
                if way == "planes":
                    relay_planes(views, tree, chunk, 120.0)
                else:
                    relay(views, *tree[0], largest if way == "routes_whole" else chunk, 120.0)
                ended = time.monotonic()
                digest = hashlib.sha256(b"".join(bytes(v) for v in views)).hexdigest()
                posts = [json.loads(p) for p in gather(
                    store, f"{key}/done", rank, world, json.dumps([began, ended, digest]))]
                if len({p[2] for p in posts}) != 1:
                    raise SystemExit(f"{exchange}/{way}: the ranks hold different models")
                times[exchange][way].append(max(p[1] for p in posts) - min(p[0] for p in posts))
    mesh.close()
    store.add("left", 1)
    deadline = time.monotonic() + 60  # rank 0 hosts the store: it goes last
    while rank == 0 and store.add("left", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank == 0:
        print(json.dumps({"model_bytes": sum(len(v) for v in views), "largest_bytes": largest,
                          "tensors": len(views), "piece_bytes": chunk, "times_s": times}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8, help="emulated hosts, one rank each")
    ap.add_argument("--model-mb", type=float, default=64.0, help="the model's size, MiB")
    ap.add_argument("--reps", type=int, default=3, help="copies per exchange and way")
    ap.add_argument("--nics", type=int, choices=(1, 2), default=1,
                    help="NICs a host (2: over both planes against the first alone)")
    ap.add_argument("--json", type=Path, default=None,
                    help="default: bench/results/state_copy.json (-2nics with --nics 2)")
    for hidden in ("--rank", "--world"):
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    for hidden in ("--address", "--master"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    if not 3 <= args.hosts <= 16 or args.model_mb <= 0 or args.reps < 1:
        raise SystemExit("need 3-16 hosts, a positive model size and at least 1 rep")
    require_cluster_privileges("bench/state_copy.py")
    if args.json is None:
        suffix = "-2nics" if args.nics == 2 else ""
        args.json = REPO / f"bench/results/state_copy{suffix}.json"
    from gradlane.testbed import Cluster, Topology

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, str(Path(__file__).resolve()), "--model-mb", str(args.model_mb),
            "--reps", str(args.reps), "--world", str(args.hosts)]
    print(f"{args.hosts} hosts at {RATE} ({args.nics} NIC{'s' * (args.nics > 1)} each), "
          f"{args.model_mb:g} MiB model, {args.reps} copies per exchange and way ...",
          flush=True)
    with Cluster(Topology.build("btsc", args.hosts, RATE, nics=args.nics)) as c:
        base += ["--master", f"{c.addr(1)}:29400"]
        outs = run_ranks(base, [(",".join(c.addr(h, k) for k in range(args.nics)),
                                 lambda argv, h=h, **kw: c.popen(h, argv, env=env, **kw))
                                for h in range(1, args.hosts + 1)])
    run = json.loads(outs[0])
    least = run["model_bytes"] * 8 / (RATE_BPS * PAYLOAD_EFFICIENCY)
    ways = PLANE_WAYS if args.nics > 1 else WAYS
    medians = {e: {w: statistics.median(run["times_s"][e][w]) for w in ways} for e in EXCHANGES}
    result: dict[str, Any] = {
        "benchmark": "state_copy",
        "config": {"hosts": args.hosts, "rate_bps": RATE_BPS, "model_mb": args.model_mb,
                   "reps": args.reps, "profile": "vgg19", "nics": args.nics},
        **{k: run[k] for k in ("model_bytes", "largest_bytes", "tensors", "piece_bytes")},
        "one_link_s": round(least, 4),
        "times_s": run["times_s"],
        "median_s": {e: {w: round(v, 4) for w, v in ms.items()} for e, ms in medians.items()},
    }
    if args.nics > 1:
        result["plane0_over_planes"] = {e: round(ms["plane0"] / ms["planes"], 3)
                                        for e, ms in medians.items()}
        result["planes_over_one_link"] = {e: round(ms["planes"] / least, 3)
                                          for e, ms in medians.items()}
    else:
        result["before_over_path"] = {e: round(ms["routes_whole"] / ms["path"], 3)
                                      for e, ms in medians.items()}
        result["path_over_one_link"] = {e: round(ms["path"] / least, 3)
                                        for e, ms in medians.items()}
    write_result(args.json, result)
    for e, ms in medians.items():
        if args.nics > 1:
            print(f"{e}: {ms['planes']:.2f} s along the path over both planes, "
                  f"{ms['plane0']:.2f} s over the first alone "
                  f"({result['plane0_over_planes'][e]:.2f}x); one link's time {least:.2f} s")
        else:
            print(f"{e}: {ms['path']:.2f} s along the path, {ms['routes']:.2f} s down the "
                  f"result routes, {ms['routes_whole']:.2f} s down them tensor by tensor "
                  f"(before: {result['before_over_path'][e]:.2f}x); one link's time "
                  f"{least:.2f} s")
    print(f"-> {args.json}")


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
