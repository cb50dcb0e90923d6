"""Who owns each gradient chunk and which band carries it.

Pure functions shared by the shim (every worker computes the same layout
without talking to the others) and the cluster policies (`loadbalance`,
`priority`), so both always agree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from gradlane.errors import ConfigError

__all__ = ["assign_owners", "band_of"]


def assign_owners(
    sizes: Sequence[int], world: int, weights: Sequence[float] | None = None
) -> list[int]:
    """An owner rank for each chunk so that owned bytes follow `weights`.

    List scheduling on uniform machines (Graham; LPT's greedy step without
    the sort, because the order is the priority order): chunks are taken in
    the given order and each goes to the rank whose owned bytes divided by
    its weight would be smallest afterwards; ties go to the lowest rank.
    Consecutive high-priority chunks thus land on different owners, which
    spreads both the bytes and their timing. Equal weights (the default)
    balance bytes; the `loadbalance` policy passes link rates for
    heterogeneous links.
    """
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    if weights is None or len(set(weights)) == 1:
        if weights is not None and (len(weights) != world or weights[0] <= 0):
            raise ConfigError(f"need {world} positive owner weights, got {list(weights)}")
        # Equal weights: the smallest finish is the smallest load; a heap does it in log time.
        heap = [(0, r) for r in range(world)]
        owners = []
        for size in sizes:
            load, best = heap[0]
            heapq.heapreplace(heap, (load + size, best))
            owners.append(best)
        return owners
    if len(weights) != world or not all(w > 0 for w in weights):
        raise ConfigError(f"need {world} positive owner weights, got {list(weights)}")
    w = np.asarray(weights, dtype=np.float64)
    owned = np.zeros(world)
    out = []
    for size in sizes:
        best = int(np.argmin((owned + size) / w))  # argmin takes the first (lowest) rank on ties
        owned[best] += size
        out.append(best)
    return out


def band_of(order: int, layers: int, bands: int) -> int:
    """The band of the layer that runs `order`-th in the forward pass.

    Layers are split into `bands` equal runs by forward order: the first
    quarter of layers (with 4 bands) rides band 0, the highest priority.
    """
    if layers <= 0:
        return bands - 1
    return min(bands - 1, order * bands // layers)
