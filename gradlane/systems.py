"""The systems a benchmark compares, by the name its workers are started with.

Kept apart (and free of torch) so that the worker, which imports torch, and
the benchmark harness, which must not, name them from one place.
"""

from __future__ import annotations

__all__ = ["DAEMON_SYSTEMS", "REFERENCE", "SHIM_SYSTEMS", "SYSTEMS"]

# What a benchmark scenario may list (`gradlane.worker` describes each).
SYSTEMS = ("ddp", "fifo", "priority", "gradlane", "ddp-hook")
# Those run with gradlaned on every host.
DAEMON_SYSTEMS = ("gradlane", "ddp-hook")
# Those whose workers wait for averages in the next forward, where the wait can be timed
# (DDP's is inside its backward; the reference exchanges nothing).
SHIM_SYSTEMS = ("fifo", "priority", "gradlane")
# Compute alone, nothing exchanged: the lower bound's compute, not a contender.
REFERENCE = "local"
