"""Benchmark cross-iteration overlap: `attach(overlap=True)` against `overlap=False`.

    sudo .venv/bin/python bench/shim_overlap.py

Trace-driven compute: one layer per module of a shipped model profile
(`--model`, default VGG-19, `gradlane.policies.profiles`), whose forward and
backward passes sleep for times proportional to the module's FLOPs (forward
`--forward-ms` in all, backward twice that; no arithmetic, so the 2-core
machine's CPU is not what is measured), each with a parameter of the
module's bytes scaled so the model holds `--model-mb` MB. Two workers
in two emulated hosts, each with gradlaned, at a link rate chosen so that
one iteration's communication time (each worker sends and receives the
model's size: half as contributions, half as results) is about its compute
time. Both settings run in the same cluster, alternating, `--rounds` times
each; the first `--warmup` iterations of every run are dropped.

Result: median iteration time of each, and their ratio (target <= 0.85).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from common import require_cluster_privileges, unwind_on_signals, write_result  # noqa: E402

from gradlane.benchmark import PAYLOAD_EFFICIENCY  # noqa: E402
from gradlane.daemon.config import DEFAULT_SHAPE_FRACTION  # noqa: E402


def trace(args: argparse.Namespace) -> list[tuple[int, float, float]]:
    """(parameter elements, forward s, backward s) per layer."""
    from gradlane.workloads import trace_spec

    return trace_spec(args.model, args.model_mb, args.forward_ms / 1000)


def worker(argv: Sequence[str]) -> None:
    """One rank (forked in its host: `gradlane.testbed.Cluster.fork`); rank 0 writes its
    iteration times and waits to `--out`."""
    import torch

    import gradlane.shim as gl
    from gradlane.workloads import make_trace, trace_batch

    ap = argparse.ArgumentParser(prog="shim_overlap.py worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--model-mb", type=float, required=True)
    ap.add_argument("--forward-ms", type=float, required=True)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--chunk-kb", type=int)
    ap.add_argument("--overlap", type=int, required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--address", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    model = make_trace(args.model, args.model_mb, args.forward_ms / 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times: list[float] = []
    waited: list[float] = []
    options = {"chunk_bytes": args.chunk_kb << 10} if args.chunk_kb else {}
    with gl.attach(
        model,
        opt,
        overlap=bool(args.overlap),
        daemon_socket=args.socket,
        job="overlap",
        address=args.address,
        **options,
    ) as sync:
        x = trace_batch()
        last = time.perf_counter()
        for _ in range(args.iters):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append(now - last)
            waited.append(sync.last_exposed_comm_s)
            last = now
        sync.flush()
    if int(os.environ["RANK"]) == 0:
        args.out.write_text(json.dumps({"times": times, "waited": waited}))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/shim_overlap.json")
    ap.add_argument("--model", default="vgg19", help="profile: resnet50, vgg19, bert_base, gpt2")
    ap.add_argument("--model-mb", type=float, default=10.0, help="scaled model size")
    ap.add_argument("--forward-ms", type=float, default=50.0, help="forward time per iteration")
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-kb", type=int, default=None, help="chunk size (default: shim's)")
    ap.add_argument("--rate", type=int, help="link rate in bit/s (default: comm = compute)")
    args = ap.parse_args()
    require_cluster_privileges("bench/shim_overlap.py")
    from gradlane.testbed import Cluster, Topology

    layers = trace(args)
    compute_s = sum(f + b for _, f, b in layers)
    model_bytes = 4 * sum(n for n, _, _ in layers)
    # Each worker sends the model's size per iteration (W = 2); pick the rate
    # at which that takes as long as the compute, counting TCP/IP framing and
    # the daemon's 95% shaping.
    payload_bps = PAYLOAD_EFFICIENCY * DEFAULT_SHAPE_FRACTION  # per bit/s of link rate
    rate = args.rate or int(model_bytes * 8 / compute_s / payload_bps)
    comm_s = model_bytes * 8 / (rate * payload_bps)
    base = ["--model", args.model, "--model-mb", str(args.model_mb),
            "--forward-ms", str(args.forward_ms), "--iters", str(args.iters),
            *(["--chunk-kb", str(args.chunk_kb)] if args.chunk_kb else [])]  # fmt: skip
    runs: dict[str, list[list[float]]] = {"overlap": [], "no_overlap": []}
    exposed: dict[str, list[float]] = {"overlap": [], "no_overlap": []}
    with tempfile.TemporaryDirectory() as tmp, Cluster(Topology.build("bovl", 2, rate)) as c:
        socks = [sock for _, sock in c.start_daemons(["h1", "h2"], Path(tmp)).values()]
        port = 29420
        for r in range(args.rounds):
            for name, overlap in (("overlap", 1), ("no_overlap", 0)):
                port += 1
                result = Path(tmp) / f"{name}-{r}.json"
                procs = []
                for rank, host in enumerate(("h1", "h2")):
                    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2",
                           "MASTER_ADDR": c.addr("h1"), "MASTER_PORT": str(port),
                           "OMP_NUM_THREADS": "1"}  # fmt: skip
                    argv = [*base, "--overlap", str(overlap), "--socket", str(socks[rank]),
                            "--address", c.addr(host), "--out", str(result)]
                    procs.append(c.fork(host, worker, argv, env=env,
                                        log=Path(tmp) / f"{name}-{r}-rank{rank}.log"))
                for p in procs:
                    if p.wait(timeout=300):
                        raise SystemExit(f"a worker failed:\n{p.output()[-3000:]}")
                out = json.loads(result.read_text())
                times = out["times"][args.warmup :]
                runs[name].append(times)
                exposed[name].extend(out["waited"][args.warmup :])
                print(
                    f"round {r + 1}/{args.rounds} {name}: median "
                    f"{statistics.median(times) * 1000:.1f} ms",
                    flush=True,
                )
    medians = {k: statistics.median(t for run in v for t in run) for k, v in runs.items()}
    ratio = medians["overlap"] / medians["no_overlap"]
    write_result(
        args.json,
        {
            "benchmark": "cross-iteration overlap: per-layer steps gating the next forward",
            "config": {
                "workers": 2,
                "model_profile": args.model,
                "layers": len(layers),
                "model_MB": round(model_bytes / (1 << 20), 3),
                "forward_s": args.forward_ms / 1000,
                "compute_s": round(compute_s, 4),
                "link_bps": rate,
                "communication_s_at_link_rate": round(comm_s, 4),
                "iters": args.iters,
                "warmup_dropped": args.warmup,
                "rounds": args.rounds,
                "chunk_bytes": (args.chunk_kb << 10) if args.chunk_kb else "default",
                "daemons": True,
            },
            "iteration_s": {k: [[round(t, 5) for t in run] for run in v] for k, v in runs.items()},
            "median_iteration_s": {k: round(v, 5) for k, v in medians.items()},
            # time rank 0's training thread waited for averages (communication not hidden)
            "median_exposed_communication_s": {
                k: round(statistics.median(v), 5) for k, v in exposed.items()
            },
            "ratio_overlap_to_no_overlap": round(ratio, 3),
        },
    )
    print(
        f"overlap {medians['overlap'] * 1000:.1f} ms vs no overlap "
        f"{medians['no_overlap'] * 1000:.1f} ms: ratio {ratio:.3f} -> {args.json}"
    )


if __name__ == "__main__":
    unwind_on_signals()  # a SIGTERM or a hang-up removes this run's clusters, as Ctrl-C does
    main()
