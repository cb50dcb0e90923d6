"""The training worker of `gradlane demo` and `gradlane bench`, one per host.

``torchrun ... -m gradlane.worker --system S --steps N --out DIR [workload options]``
(the demo), or ``python -m gradlane.worker ...`` with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the benchmarks (`gradlane.demo.launch`)
call `main` the same way in a process forked with torch imported
(`gradlane.testbed.forked`).

Workloads (`gradlane.workloads`): ``cnn`` (a small real CNN, synthetic data,
the same seed in every system) or ``trace`` (per-layer sleeps and parameter
bytes from a model profile; ``--speed`` slows this worker's compute).
SGD with momentum, one CPU thread. Every rank writes
``DIR/<system>-rank<R>.json`` with its iteration times, losses, the time it
waited on communication (gradlane systems), when each backward ended (on the
machine-wide monotonic clock), the CPU cores it used over
the training loop and how long per step its training thread waited for a
core (`run_queue_s`).

Systems:
- ``ddp``: PyTorch DistributedDataParallel over gloo, default buckets.
- ``fifo``: gradlane's transport with one band and no overlap, no daemon.
- ``priority``: P3-like: forward-order priority, chunks and cross-iteration
  overlap in the shim, 4 bands, but no daemon (the kernel does not prioritize).
- ``gradlane``: everything: the shim as in ``priority`` plus gradlaned.
- ``ddp-hook``: DDP as in ``ddp`` with gradlane's communication hook
  (`gradlane.shim.comm_hook`: its buckets chunked, in forward order, over the
  band connections) plus gradlaned: what a job keeps without leaving DDP (no
  cross-iteration overlap: DDP's backward waits for every bucket).
- ``local``: no exchange at all, every rank steps on its own gradients: the
  compute-only reference the bench's lower bound is measured with (the same
  workload, the same CPU contention, nothing sent).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradlane.shim.config import EXCHANGES, LAYOUTS
from gradlane.systems import DAEMON_SYSTEMS, REFERENCE
from gradlane.systems import SYSTEMS as BENCHED
from gradlane.workloads import BATCH, cnn_batch, make_cnn, make_trace, trace_batch

SYSTEMS = (*BENCHED, REFERENCE)


def run_queue_s() -> float | None:
    """Seconds the calling thread has spent ready to run but waiting for a core
    (Linux schedstats: /proc/thread-self/schedstat); None where not available."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def shim_options(args: argparse.Namespace) -> dict[str, Any]:
    """The DDP hook's options (`gradlane.shim.HookState`) for `args`: the systems with
    gradlaned take its socket and the exchange asked for; the others no daemon and their
    own exchange."""
    options: dict[str, Any] = {"job": args.job,
                               "address": args.address and args.address.split(",")}
    if args.chunk_bytes is not None:
        options["chunk_bytes"] = args.chunk_bytes
    if args.credit_bytes is not None:
        options["credit_bytes"] = args.credit_bytes
    if args.system in DAEMON_SYSTEMS:
        options.update(daemon_socket=args.daemon_socket, exchange=args.exchange)
    else:
        options["daemon_socket"] = "/nonexistent/gradlaned.sock"
    return options


def attach_options(args: argparse.Namespace) -> dict[str, Any]:
    """`gradlane.shim.attach`'s options for `args`: `shim_options` and the grouping;
    ``fifo`` sends everything on one band (DSCP 0) and starts no forward before every
    average is in."""
    options = {**shim_options(args), "layout": args.layout}
    if args.system == "fifo":
        options.update(dscp=(0,), overlap=False)
    return options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=SYSTEMS, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--daemon-socket", default="/run/gradlane/gradlaned.sock")
    ap.add_argument("--workload", choices=["cnn", "trace"], default="cnn")
    ap.add_argument("--model", default="vgg19", help="trace: the profile")
    ap.add_argument("--model-mb", type=float, default=10.0, help="trace: scaled model size")
    ap.add_argument("--forward-ms", type=float, default=50.0, help="trace: forward time")
    ap.add_argument("--speed", type=float, default=1.0, help="trace: relative compute speed")
    ap.add_argument("--batch", type=int, default=BATCH, help="trace: this worker's batch size")
    ap.add_argument("--job", default="bench", help="all but ddp: the job name the shims give")
    ap.add_argument("--follow-advice", action="store_true",
                    help="trace, gradlane, ddp-hook: take the local batch size the control "
                         "plane advises")
    ap.add_argument("--layout", choices=LAYOUTS, default="auto",
                    help="fifo, priority, gradlane: the shim's gradient grouping")
    ap.add_argument("--exchange", choices=EXCHANGES, default="auto",
                    help="gradlane, ddp-hook: each chunk's path (`ShimConfig.exchange`)")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="fifo, priority, gradlane, ddp-hook: the largest chunk "
                         "(default: the shim's)")
    ap.add_argument("--credit-bytes", type=int, default=None,
                    help="fifo, priority, gradlane, ddp-hook: unsent bytes each band "
                         "connection may hold in the kernel (default: the shim's)")
    ap.add_argument("--address", default=None,
                    help="fifo, priority, gradlane, ddp-hook: the address this rank listens on "
                         "(default: the one that routes to the rendezvous); several, "
                         "comma-separated, one per NIC")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.workload == "cnn":
        model = make_cnn()
    else:
        model = make_trace(args.model, args.model_mb, args.forward_ms / 1000, args.speed)
    # lr 0.003: the CNN trains without loss spikes for 100+ steps. At 0.02 it spiked near
    # step 40, and past a spike two runs that differ only in summation order drift apart.
    opt = torch.optim.SGD(model.parameters(), lr=0.003, momentum=0.9)
    # "ends": when each step ended, on the machine-wide monotonic clock (the same in every
    # namespace), so runs of jobs started side by side can be lined up.
    # "backward_ends": when each backward returned (the same clock): with the shim, once this
    # worker's gradients are all handed to the exchange, so lined up across ranks they show
    # how long the fastest worker waited for the slowest.
    record: dict[str, Any] = {"times": [], "ends": [], "losses": [], "waited": [], "batch": [],
                              "backward_ends": []}

    def train(net: nn.Module, sync: Any = None, hook: Any = None) -> None:
        # `sync`: attach's (it times the forward's wait); `hook`: the DDP hook's state,
        # told each step's samples (its wait is inside backward, as DDP's).
        advisor = sync if sync is not None else hook
        # CPU of this process (all threads) over the training loop: a worker
        # near 1.0 core is CPU-bound, whatever the network does.
        cpu0, sys0, wall0 = time.process_time(), os.times().system, time.perf_counter()
        train0 = time.thread_time()
        queued0 = run_queue_s()
        last = wall0
        for step in range(args.steps):
            if args.workload == "cnn":
                x, y = cnn_batch(step, rank)
                if hook is not None:
                    hook.samples = len(x)
                loss = nn.functional.cross_entropy(net(x), y)
            else:
                batch = args.batch
                if args.follow_advice and advisor is not None:
                    batch = advisor.advised_batch_size or batch  # the control plane's share
                record["batch"].append(batch)
                if hook is not None:
                    hook.samples = batch
                loss = net(trace_batch(batch)).sum()
            loss.backward()  # type: ignore[no-untyped-call]
            record["backward_ends"].append(time.monotonic())
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            record["times"].append(now - last)
            record["ends"].append(time.monotonic())
            record["losses"].append(loss.item())
            record["waited"].append(sync.last_exposed_comm_s if sync is not None else 0.0)
            last = now
        # The training thread's, read inside the span of the process's: never more than it.
        train_s = time.thread_time() - train0
        wall = time.perf_counter() - wall0
        record["cpu_cores"] = (time.process_time() - cpu0) / wall
        # ... of which in the kernel (sending, receiving: TCP), in clock ticks (10 ms).
        record["cpu_sys_cores"] = (os.times().system - sys0) / wall
        # ... of which this, the training thread (the rest: the exchange's threads).
        record["cpu_train_cores"] = train_s / wall
        # How long this (the training) thread was ready to run but had no core: the
        # CPU bottleneck on the critical path, per step.
        queued = run_queue_s()
        if queued is not None and queued0 is not None:
            record["run_queue_s_per_step"] = (queued - queued0) / args.steps

    if args.system == REFERENCE:
        train(model)
    elif args.system in ("ddp", "ddp-hook"):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        def train_ddp() -> None:
            ddp = DistributedDataParallel(model)
            state = None
            try:
                if args.system == "ddp-hook":
                    import gradlane.shim as gl

                    state = gl.HookState(ddp, **shim_options(args))
                    ddp.register_comm_hook(state, gl.comm_hook)
                    record["exchange"] = state.engine.kind
                train(ddp, hook=state)
            finally:
                if state is not None:
                    state.close()
                # DDP's reducer goes first, while the process group is still registered:
                # freed last, the group's gloo threads are joined under the reducer's hold
                # of the GIL, which one of them may be waiting for (a hang at exit seen
                # about once in six 2-rank runs; torch 2.13).
                del ddp, state

        dist.init_process_group("gloo")
        try:
            train_ddp()
        finally:
            dist.destroy_process_group()
    else:
        import gradlane.shim as gl

        with gl.attach(model, opt, **attach_options(args)) as sync:
            # Each rank's leaf switch and host when chunks are reduced within them first,
            # and how the ranks exchange (`gradlane.daemon.fields.EXCHANGES`).
            record["leaves"] = list(sync.leaves) if sync.leaves else None
            record["hosts"] = list(sync.hosts) if sync.hosts else None
            record["exchange"] = sync.engine.kind
            train(model, sync)
            sync.flush()
            # What the grouping trial measured and kept (`ShimConfig.layout`).
            record["layout_trial"] = sync.layout_trial
            # Whose chunks: the bytes each rank owns, and the step the ranks took the
            # control plan's owners (None: they kept their own).
            record["owned_bytes"] = sync.owned_bytes()
            record["owners_taken_at"] = sync.owners_taken_at
    (args.out / f"{args.system}-rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
