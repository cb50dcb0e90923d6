"""A training worker for the shim's multi-process tests, and its reference.

``python -m tests.shim_worker --out DIR [options]`` with RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set trains a small CNN for `--steps` steps through
`gradlane.shim.attach` and saves its final parameters to
``DIR/rank<R>.pt``. Every rank draws the same global batch per step and
trains on its slice of it (`--batches` gives the slice sizes), so
`reference` (one process, the whole batch, no shim) must end at the same
parameters.

Exit codes: 0 done, 3 `PeerLost` (the message goes to stderr), 4 other
`TransportError`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01),
}


def make_model(dtype: torch.dtype, hidden: int = 32) -> nn.Module:
    """The test CNN: 15 KB of parameters (float32), more with a wider `hidden` layer."""
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )
    return model.to(dtype)


class WithUnused(nn.Module):
    """`inner`, and a layer its forward never uses."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.unused = nn.Linear(4, 4).to(next(inner.parameters()).dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]


def batch(step: int, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 3, 12, 12, generator=g, dtype=dtype), torch.randint(
        0, 10, (size,), generator=g
    )


def make_scheduler(opt: torch.optim.Optimizer, on: bool) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s) if on else 1.0)


def reference(
    optimizer: str, dtype: torch.dtype, steps: int, sizes: list[int], sched: bool,
    hidden: int = 32,
) -> dict[str, torch.Tensor]:
    """Single-process training on the concatenated batch."""
    model = make_model(dtype, hidden)
    opt = OPTIMIZERS[optimizer](model.parameters())
    scheduler = make_scheduler(opt, sched)
    for step in range(steps):
        x, y = batch(step, sum(sizes), dtype)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batches", default="4,4,4,4")
    ap.add_argument("--sched", action="store_true")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--chunk-bytes", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--die-at", type=int, default=-1, help="SIGKILL self in this step's backward")
    ap.add_argument("--hang-at", type=int, default=-1,
                    help="SIGSTOP self in this step's backward (alive, connected, silent)")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--daemon-socket", default="/nonexistent/gradlaned.sock")
    ap.add_argument("--ddp-hook", action="store_true", help="DDP(gloo) + gradlane's comm hook")
    ap.add_argument("--no-samples", action="store_true",
                    help="with --ddp-hook: leave the hook's samples unset (the plain mean)")
    ap.add_argument("--wider", action="store_true", help="a different model (mismatch test)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="with --ddp-hook: micro-batches per step, all but the last under "
                         "DDP's no_sync()")
    ap.add_argument("--unused", action="store_true",
                    help="with --ddp-hook: DDP wraps the model with a layer forward never "
                         "uses (find_unused_parameters=True)")
    ap.add_argument("--ddp-option", action="append", default=[], metavar="NAME",
                    help="with --ddp-hook: a DDP flag to set (gradient_as_bucket_view, "
                         "static_graph)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="with --ddp-hook: DDP's bucket size (default DDP's: one bucket for "
                         "the test CNN)")
    ap.add_argument("--hidden", type=int, default=32,
                    help="units of the hidden linear layer (`make_model`; 512: 159 KB)")
    ap.add_argument("--leaf", type=int, default=None, help="this rank's leaf switch")
    ap.add_argument("--exchange", default="auto", help="ShimConfig.exchange")
    ap.add_argument("--address", type=lambda a: a.split(","), default=None,
                    help="the loopback address this rank listens on (127.0.0.x: as if a host); "
                         "several, comma-separated: one per plane (NIC)")
    ap.add_argument("--advise-owners", type=int, default=-1,
                    help="with --ddp-hook: after this step, rank 0 is advised (as if by a "
                         "control plan) that the last rank owns every chunk")
    args = ap.parse_args(argv)

    import gradlane.shim as gl
    from gradlane.errors import PeerLost, TransportError

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dtype = getattr(torch, args.dtype)
    sizes = [int(s) for s in args.batches.split(",")]
    model = make_model(dtype, args.hidden)
    if args.wider:
        model[-1] = nn.Linear(args.hidden, 11).to(dtype)
    if rank:
        with torch.no_grad():  # attach must broadcast rank 0's parameters
            for p in model.parameters():
                p.add_(1.0)
    opt = OPTIMIZERS[args.optimizer](model.parameters())
    scheduler = make_scheduler(opt, args.sched)
    start = sum(sizes[:rank])
    if args.ddp_hook:
        run_ddp_hook(model, opt, scheduler, args, rank, sizes, dtype)
        return
    try:
        with gl.attach(
            model,
            opt,
            chunk_bytes=args.chunk_bytes,
            overlap=not args.no_overlap,
            timeout_s=args.timeout,
            daemon_socket=args.daemon_socket,
            job="test",
            leaf=args.leaf,
            exchange=args.exchange,
            address=args.address,
        ) as sync:
            for step in range(args.steps):
                x, y = batch(step, sum(sizes), dtype)
                x, y = x[start : start + sizes[rank]], y[start : start + sizes[rank]]
                loss = nn.functional.cross_entropy(model(x), y)
                _end_in_backward(loss, step, args)
                loss.backward()
                opt.step()
                scheduler.step()
                opt.zero_grad()
                print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
                time.sleep(args.step_sleep)
            sync.flush()
            print(f"rank {rank} leaves {sync.leaves} hosts {sync.hosts} {sync.engine.kind}",
                  flush=True)
            trial = sync.layout_trial["chosen"] if sync.layout_trial else None
            print(f"rank {rank} layout {sync.layout} trial {trial}", flush=True)
    except PeerLost as exc:
        print(f"PeerLost: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
    except TransportError as exc:
        print(f"TransportError: {exc}", file=sys.stderr, flush=True)
        sys.exit(4)
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / f"rank{rank}.pt"
    )


def _end_in_backward(loss: torch.Tensor, step: int, args: argparse.Namespace) -> None:
    """--die-at and --hang-at: this rank dies (SIGKILL) or hangs (SIGSTOP) in `step`'s
    backward, with its peers mid-iteration."""
    for at, sig in ((args.die_at, signal.SIGKILL), (args.hang_at, signal.SIGSTOP)):
        if step == at:
            loss.register_hook(lambda g, sig=sig: os.kill(os.getpid(), sig))


def run_ddp_hook(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    args: argparse.Namespace,
    rank: int,
    sizes: list[int],
    dtype: torch.dtype,
) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gradlane.shim as gl

    dist.init_process_group("gloo", rank=rank, world_size=len(sizes))
    flags: dict[str, Any] = dict.fromkeys(args.ddp_option, True)
    if args.bucket_cap_mb is not None:
        flags["bucket_cap_mb"] = args.bucket_cap_mb
    if args.unused:
        ddp = DistributedDataParallel(WithUnused(model), find_unused_parameters=True, **flags)
    else:
        ddp = DistributedDataParallel(model, **flags)
    state = gl.HookState(ddp, chunk_bytes=args.chunk_bytes, timeout_s=args.timeout, job="test",
                         leaf=args.leaf, exchange=args.exchange,
                         daemon_socket=args.daemon_socket, address=args.address)
    ddp.register_comm_hook(state, gl.comm_hook)
    start = sum(sizes[:rank])
    for step in range(args.steps):
        x, y = batch(step, sum(sizes), dtype)
        if not args.no_samples:
            state.samples = sizes[rank]
        # Micro-batches: each loss weighted by its share of the slice, so the accumulated
        # gradient is the slice's mean, as without them.
        parts = [c for c in torch.arange(start, start + sizes[rank]).tensor_split(
            args.accumulate) if len(c)]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = nn.functional.cross_entropy(ddp(x[part]), y[part]) * len(part) / sizes[rank]
                _end_in_backward(loss, step, args)
                try:
                    loss.backward()
                except RuntimeError as exc:  # DDP's, around the hook's PeerLost
                    print(f"PeerLost (through DDP): {exc}", file=sys.stderr, flush=True)
                    state.close()  # its goodbyes name the rank lost, for the others
                    sys.exit(3)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        if step == 0:
            print(f"rank {rank} early sends in step 0: {state.early_sends}", flush=True)
        if rank == 0 and step == args.advise_owners:  # what gradlaned passes on from a plan
            chunks = sum(len(state._groups[gid].chunks) for gid in state._last_ready
                         if gid in state._groups)
            state.client.advised_owners = (len(sizes) - 1,) * chunks
        time.sleep(args.step_sleep)
    print(f"rank {rank} leaves {state.leaves} hosts {state.hosts} {state.engine.kind}",
          flush=True)
    largest = max((c.stop - c.start) * g.grad.element_size()
                  for g in state._groups.values() for c in g.chunks)
    print(f"rank {rank} hook chunk bytes {state.chunk_bytes}, largest cut {largest}, "
          f"early sends {state.early_sends}, buckets {len(state._buckets)}", flush=True)
    print(f"rank {rank} owners taken at {state.owners_taken_at}, owned {state.owned_bytes()}",
          flush=True)
    state.close()
    # DDP's reducer first, while the process group is registered (`gradlane.worker`: freed
    # after it, the reducer joins the group's gloo threads holding the GIL; a hang at exit).
    # So nothing of gradlane's may keep DDP alive once the names are gone.
    alive = weakref.ref(ddp)
    del ddp, state
    print(f"rank {rank} DDP freed before the group: {alive() is None}", flush=True)
    dist.destroy_process_group()
    torch.save(
        {k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / f"rank{rank}.pt"
    )


if __name__ == "__main__":
    main()
