"""Test ranks forked from a server that imported torch once (`gradlane.testbed.forked`).

A rank started as ``python -m tests.shim_worker`` imports torch itself, and
torch._dynamo at its first optimizer: seconds of CPU per rank, most of a
short 4-rank test on a 2-core machine. Forked, each rank starts with them in
memory; training in it is the same code as under ``python -m``.
"""

from __future__ import annotations

from gradlane.testbed.forked import Forked, preload

__all__ = ["Forked"]

preload(["tests.shim_worker"])  # gradlane.worker brings the shim
