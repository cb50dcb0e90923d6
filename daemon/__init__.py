"""gradlaned, the per-host daemon, and the control plane.

The qdisc manager's names are imported on first use (PEP 562): the shim and
the control plane import parts of this package and need no netlink library.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DEFAULT_BAND_DSCP",
    "ClassStats",
    "FlowMatch",
    "JobSpec",
    "QdiscManager",
    "QdiscSpec",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gradlane.daemon import qdisc

        return getattr(qdisc, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
