"""What integration tests share: independent looks at the kernel, goodput ceilings."""

from __future__ import annotations

import subprocess

# A full TCP segment carries 1448 payload bytes (MSS with timestamps) in a
# 1514-byte frame, which is what HTB charges: the best goodput a shaped rate gives.
PAYLOAD_EFFICIENCY = 1448 / 1514


def max_goodput(rate_bps: float) -> float:
    return rate_bps * PAYLOAD_EFFICIENCY


def tc(namespace: str, *args: str) -> str:
    """Run the real `tc` in a namespace: an independent view of the kernel state."""
    return subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
