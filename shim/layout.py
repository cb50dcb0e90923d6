"""How gradients are cut into chunks, who owns each, and which band carries it.

Pure functions of the model's shapes, so every worker computes the same
layout without talking to the others. Ownership and bands come from
`gradlane.policies.chunks`, the same code the cluster policies plan with.
With a control plane, the ranks take its plan's owners instead, together,
at a check every `OWNERS_EVERY` steps (`gradlane.shim.Sync`, the DDP hook).
"""

from __future__ import annotations

from gradlane.policies.chunks import assign_owners, band_of

__all__ = ["OWNERS_EVERY", "assign_owners", "band_of", "split"]

# Every this many steps, the ranks take the chunk owners the control plan advises rank 0,
# if they cover the job's chunks and differ from theirs (one regrouping when they do).
OWNERS_EVERY = 10


def split(numel: int, elem_size: int, chunk_bytes: int, tail: int = 0) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` of at most `chunk_bytes` each, covering `numel`.

    The pieces are as equal as possible (a 1.1 MB layer with 1 MB chunks gives
    two 0.55 MB chunks, not 1 MB + 0.1 MB), so no tiny tail chunk pays a full
    message's overhead. `tail` more elements after `numel` (a group's flags)
    ride in the last piece: they never change how many pieces there are.
    """
    if numel <= 0:
        return [(0, tail)] if tail > 0 else []
    per_chunk = max(1, chunk_bytes // elem_size)
    pieces = -(-numel // per_chunk)
    base, extra = divmod(numel, pieces)
    ranges, start = [], 0
    for i in range(pieces):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    ranges[-1] = (ranges[-1][0], numel + tail)
    return ranges


