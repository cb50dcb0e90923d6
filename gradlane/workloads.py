"""Training workloads for the demo and the benchmarks.

- `make_cnn`: a small real CNN on synthetic CIFAR-sized data (`cnn_batch`).
- `make_trace`: a trace-driven model: one layer per module of a shipped
  profile (`gradlane.policies.profiles`), each with a parameter of the
  module's bytes (scaled) and forward/backward passes that *sleep* for times
  proportional to the module's FLOPs, on an emulated accelerator whose
  late wake-ups do not add up (`_Accelerator`). Sleeping keeps the 2-core
  machine's CPU out of the compute: what is left is communication and the
  CPU the training loop itself takes.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gradlane.policies.profiles import trace_spec

__all__ = [
    "BATCH", "TraceLayer", "cnn_batch", "make_cnn", "make_trace", "trace_batch", "trace_spec",
]

BATCH = 32


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def cnn_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic but learnable: the label decides the mean of each image's channels."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    x = torch.randn(BATCH, 3, 32, 32, generator=g) * 0.5
    x += (y.float() / 10 - 0.45).view(-1, 1, 1, 1)
    return x, y


class _Accelerator:
    """The emulated accelerator: runs a layer for its time, as a GPU would.

    A GPU finishes a layer when its kernels are done, whatever the host's CPU
    is doing. A sleeping process instead wakes late, and on a busy 2-core
    machine hosting four workers later still; summed over a few hundred
    layers per iteration that would stretch the compute with the CPU load of
    whatever else runs (the exchange, the other workers), which is not what
    a trace emulates. So each layer gives back its predecessor's oversleep:
    it ends `seconds` after the moment the previous layer should have woken
    had it been on time, plus whatever the caller spent in between (waiting
    for parameters, the optimizer, the exchange's own code: all charged in
    full). Only the sleeps' own lateness is forgiven, for every system alike.
    """

    def __init__(self) -> None:
        self.late = 0.0  # how much later than asked the previous layer ended

    def run(self, seconds: float) -> None:
        now = time.monotonic()
        end = now - self.late + seconds
        delay = end - now
        if delay > 0:
            time.sleep(delay)
        self.late = max(0.0, time.monotonic() - end)


_ACCELERATOR = _Accelerator()  # one per process, as a worker has one device


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fwd: float, bwd: float) -> Any:
        # Compute grows with the samples in the batch: x holds one value per sample.
        scale = x.shape[0] / BATCH
        ctx.bwd, ctx.numel = bwd * scale, w.numel()
        _ACCELERATOR.run(fwd * scale)
        return x + w[:1]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        _ACCELERATOR.run(ctx.bwd)
        return grad, torch.full((ctx.numel,), 1e-3), None, None


def trace_batch(samples: int = BATCH) -> torch.Tensor:
    """The input of a trace model: one value per sample.

    A trace layer's times are for `BATCH` samples and scale with the count,
    so a batch of 1 would compute 1/BATCH of the profile.
    """
    return torch.zeros(samples)


class TraceLayer(nn.Module):
    """A parameter of `numel` floats; forward sleeps `fwd` s, backward `bwd` s.

    Those are the times for a batch of `BATCH` samples; the input holds one
    value per sample, and a smaller or larger batch sleeps proportionally.
    """

    def __init__(self, numel: int, fwd: float, bwd: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))
        self.fwd, self.bwd = fwd, bwd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.w, self.fwd, self.bwd)  # type: ignore[no-untyped-call,no-any-return]


def make_trace(model: str, model_mb: float, forward_s: float, speed: float = 1.0) -> nn.Module:
    """The trace model; `speed` < 1 makes this worker's compute slower (e.g. 0.5: twice as long)."""
    return nn.Sequential(
        *[TraceLayer(n, f / speed, b / speed) for n, f, b in trace_spec(model, model_mb, forward_s)]
    )
