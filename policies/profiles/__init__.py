"""Model profiles shipped as data: per-module parameter bytes and forward FLOPs.

See README.md in this folder for the sources. `load_profile` reads one;
`Profile.compute_times` turns FLOPs into per-module forward and backward
times under a calibration you state (a sustained FLOP rate, or a total
forward time to scale to).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from gradlane.errors import ConfigError

__all__ = ["NAMES", "Module", "Profile", "load_profile", "trace_layers", "trace_spec",
           "trace_totals"]

NAMES = ("resnet50", "vgg19", "bert_base", "gpt2")
BACKWARD_TO_FORWARD = 2.0  # backward costs about twice the forward (two matmuls per one)


@dataclass(frozen=True)
class Module:
    index: int
    name: str
    kind: str
    params: int
    bytes: int
    forward_flops: int


@dataclass(frozen=True)
class Profile:
    model: str
    modules: tuple[Module, ...]

    @property
    def total_bytes(self) -> int:
        return sum(m.bytes for m in self.modules)

    @property
    def total_flops(self) -> int:
        return sum(m.forward_flops for m in self.modules)

    def compute_times(self, forward_s: float) -> list[tuple[float, float]]:
        """Per module (forward, backward) seconds when the whole forward takes `forward_s`.

        Time is proportional to FLOPs; backward is `BACKWARD_TO_FORWARD` x forward.
        """
        total = self.total_flops
        return [(forward_s * m.forward_flops / total,
                 BACKWARD_TO_FORWARD * forward_s * m.forward_flops / total)
                for m in self.modules]


def load_profile(name: str) -> Profile:
    """The shipped profile `name` (one of `NAMES`).

    Raises:
        ConfigError: unknown name.
    """
    if name not in NAMES:
        raise ConfigError(f"unknown model profile {name!r}; known: {', '.join(NAMES)}")
    raw = json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text())
    modules = tuple(
        Module(m["index"], m["module"], m["kind"], m["params"], m["bytes_fp32"],
               m["forward_flops"])
        for m in sorted(raw["modules_in_forward_order"], key=lambda m: m["index"])
    )
    return Profile(raw["model"], modules)


def trace_spec(model: str, model_mb: float, forward_s: float) -> list[tuple[int, float, float]]:
    """(fp32 parameter elements, forward s, backward s) per module, for a trace workload.

    The profile's bytes scaled so the model has `model_mb` MiB (at least 1024
    elements per module), its compute so the forward takes `forward_s`.
    """
    profile = load_profile(model)
    scale = model_mb * (1 << 20) / profile.total_bytes
    times = profile.compute_times(forward_s)
    return [
        (max(1024, round(m.bytes * scale / 4)), f, b)
        for m, (f, b) in zip(profile.modules, times, strict=True)
    ]


def trace_layers(model: str, model_mb: float, forward_ms: float, compute_s: float | None = None
                 ) -> list[tuple[float, float, float]]:
    """A trace workload's layers (bytes, forward s, backward s): `trace_spec`'s, with its
    compute scaled to take `compute_s` per iteration (None: as the trace gives it)."""
    spec = trace_spec(model, model_mb, forward_ms / 1000)
    nominal = sum(f + b for _, f, b in spec)
    scale = (compute_s or nominal) / nominal
    return [(n * 4.0, f * scale, b * scale) for n, f, b in spec]


def trace_totals(model: str, model_mb: float, forward_ms: float) -> tuple[float, int]:
    """A trace workload's compute seconds per iteration (forward and backward, at speed 1)
    and model bytes."""
    layers = trace_layers(model, model_mb, forward_ms)
    return sum(f + b for _, f, b in layers), int(sum(n for n, _, _ in layers))
