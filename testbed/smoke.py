"""The smoke scenario: two hosts, a DSCP-high and a DSCP-low bulk flow at once.

The low-priority flow is running already when the high-priority one starts
(`HEAD_START` s later), the situation of a gradient chunk needed first by the
next forward pass arriving behind a bulk transfer.

Run twice on the same emulated link: first with the host's default egress
(the NIC's FIFO decides), then with gradlane's qdisc tree on the sender
(band 0 vs band 3). Shows that the testbed, the traffic tool and the qdisc
manager work together on this machine.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gradlane.daemon.config import DEFAULT_SHAPE_FRACTION
from gradlane.daemon.qdisc import DEFAULT_BAND_DSCP, JobSpec, QdiscManager, QdiscSpec
from gradlane.testbed.cluster import Cluster
from gradlane.testbed.links import line_rate
from gradlane.testbed.topology import Topology
from gradlane.testbed.traffic import Flow, run_flows, window_goodputs

__all__ = ["SHAPE_FRACTION", "SmokeResult", "run_smoke"]

SHAPE_FRACTION = DEFAULT_SHAPE_FRACTION  # gradlaned's, so the smoke test shapes as it does
HEAD_START = 1.0


@dataclass(frozen=True)
class SmokeResult:
    rate_bps: int
    seconds: float
    fifo_high_bps: float
    fifo_low_bps: float
    gradlane_high_bps: float
    gradlane_low_bps: float


def run_smoke(
    rate_bps: int = 200_000_000,
    seconds: float = 4.0,
    name: str = "smoke",
    progress: Callable[[str], None] = lambda _: None,
) -> SmokeResult:
    """Measure the two flows without and with gradlane's tree on the sender."""
    high, low = DEFAULT_BAND_DSCP[0], DEFAULT_BAND_DSCP[-1]
    flows = [
        Flow("h1", "h2", dscp=high, seconds=seconds, label="high", delay=HEAD_START),
        Flow("h1", "h2", dscp=low, seconds=seconds + 2 * HEAD_START, label="low"),
    ]
    shaped = int(line_rate(rate_bps) * SHAPE_FRACTION)  # as gradlaned on this link would
    spec = QdiscSpec(
        rate_bps=shaped,
        other_rate_bps=shaped // 20,
        jobs=(JobSpec("smoke", rate_bps=shaped // 2, ceil_bps=shaped),),
        dscp_job="smoke",
    )
    progress(f"building a 2-host cluster at {rate_bps / 1e6:g} Mbit/s")
    with (
        Cluster(Topology.build(name, 2, rate_bps)) as cluster,
        tempfile.TemporaryDirectory() as tmp,
    ):
        progress(f"both flows through the NIC's FIFO ({seconds:g}s)")
        fifo = window_goodputs(run_flows(cluster, flows))
        with QdiscManager("eth0", netns=cluster.ns("h1"), state_file=Path(tmp) / "q.json") as qm:
            try:
                qm.apply(spec)
                progress(f"both flows through gradlane's tree, band 0 vs band 3 ({seconds:g}s)")
                shaped_results = window_goodputs(run_flows(cluster, flows))
            finally:
                qm.restore()
    return SmokeResult(rate_bps, seconds, fifo[0], fifo[1], shaped_results[0], shaped_results[1])
