"""How gradients are cut into chunks, who owns each, and which band carries it.

Pure functions of the model's shapes, so every worker computes the same
layout without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradlane.errors import ConfigError

__all__ = ["assign_owners", "band_of", "split"]


def split(numel: int, elem_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` of at most `chunk_bytes` each, covering `numel`.

    The pieces are as equal as possible (a 1.1 MB layer with 1 MB chunks gives
    two 0.55 MB chunks, not 1 MB + 0.1 MB), so no tiny tail chunk pays a full
    message's overhead.
    """
    if numel <= 0:
        return []
    per_chunk = max(1, chunk_bytes // elem_size)
    pieces = -(-numel // per_chunk)
    base, extra = divmod(numel, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def assign_owners(
    sizes: Sequence[int], world: int, weights: Sequence[float] | None = None
) -> list[int]:
    """An owner rank for each chunk so that owned bytes follow `weights`.

    Chunks are taken in the given (priority) order and each goes to the rank
    whose owned bytes, divided by its weight, would be smallest afterwards;
    ties go to the lowest rank. Consecutive high-priority chunks thus land on
    different owners, which spreads both the bytes and their timing. Equal
    weights (the default) balance bytes; the control plane passes link
    capacities for heterogeneous links.
    """
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    if weights is None:
        weights = [1.0] * world
    if len(weights) != world or not all(w > 0 for w in weights):
        raise ConfigError(f"need {world} positive owner weights, got {list(weights)}")
    load = [0.0] * world
    owners = []
    for size in sizes:
        best = min(range(world), key=lambda r: ((load[r] + size) / weights[r], r))
        load[best] += size
        owners.append(best)
    return owners


def band_of(order: int, layers: int, bands: int) -> int:
    """The band of the layer that runs `order`-th in the forward pass.

    Layers are split into `bands` equal runs by forward order: the first
    quarter of layers (with 4 bands) rides band 0, the highest priority.
    """
    if layers <= 0:
        return bands - 1
    return min(bands - 1, order * bands // layers)
