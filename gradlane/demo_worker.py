"""The demo's training worker, launched by torchrun in each emulated host.

``torchrun ... -m gradlane.demo_worker --system ddp|gradlane --steps N --out DIR``

A small CNN on synthetic CIFAR-sized data (3x32x32, 10 classes; the same
seed gives the same data and initial weights in both systems), SGD with
momentum, one CPU thread. Every rank writes ``DIR/<system>-rank<R>.json``
with its iteration times and losses.

- ``ddp``: PyTorch DistributedDataParallel over gloo, default buckets.
- ``gradlane``: `gradlane.shim.attach` (layer-wise sync, cross-iteration
  overlap, band connections registered with the host's gradlaned).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

BATCH = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic but learnable: the label decides the mean of each image's channels."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    x = torch.randn(BATCH, 3, 32, 32, generator=g) * 0.5
    x += (y.float() / 10 - 0.45).view(-1, 1, 1, 1)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["ddp", "gradlane"], required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--daemon-socket", default="/run/gradlane/gradlaned.sock")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    times: list[float] = []
    losses: list[float] = []

    def train(net: nn.Module) -> None:
        last = time.perf_counter()
        for step in range(args.steps):
            x, y = batch(step, rank)
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            times.append(now - last)
            losses.append(loss.item())
            last = now

    if args.system == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        try:
            train(DistributedDataParallel(model))
        finally:
            dist.destroy_process_group()
    else:
        import gradlane.shim as gl

        with gl.attach(model, opt, job="demo", daemon_socket=args.daemon_socket) as sync:
            train(model)
            sync.flush()
    (args.out / f"{args.system}-rank{rank}.json").write_text(
        json.dumps({"times": times, "losses": losses})
    )


if __name__ == "__main__":
    main()
