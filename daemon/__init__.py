"""gradlaned, the per-host daemon. So far: the qdisc manager it enforces plans with."""

from gradlane.daemon.qdisc import (
    DEFAULT_BAND_DSCP,
    ClassStats,
    FlowMatch,
    JobSpec,
    QdiscManager,
    QdiscSpec,
)

__all__ = [
    "DEFAULT_BAND_DSCP",
    "ClassStats",
    "FlowMatch",
    "JobSpec",
    "QdiscManager",
    "QdiscSpec",
]
