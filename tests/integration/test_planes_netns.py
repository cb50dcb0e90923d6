"""Several NICs a host on the emulated cluster: two hosts, each with two NICs on two
switch planes, gradlaned shaping both. A rank given an address on each spreads its
chunks over both planes in turn: each NIC carries half the bytes, and a
communication-bound step takes about half as long as over one NIC.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from gradlane.demo import collect, launch
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import stop

pytestmark = pytest.mark.netns

STEPS = 12
HOSTS = ["h1", "h2"]
# VGG-19 at 4 MB over 100 Mbit/s: each host sends a model a step, 0.34 s on one NIC
# against 30 ms of compute.
WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "4", "--forward-ms", "10"]


def _sent(c: Cluster, host: str) -> list[int]:
    """What each of `host`'s NICs has sent, in bytes (eth0, eth1)."""
    from pyroute2 import IPRoute

    with IPRoute(netns=c.ns(host)) as ipr:
        return [int(ipr.get_links(ifname=f"eth{k}")[0].get_attr("IFLA_STATS64")["tx_bytes"])
                for k in range(c.topology.nics)]


@pytest.mark.timeout(240)
def test_chunks_spread_over_two_nics_halve_a_communication_bound_step(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with Cluster(Topology.build("pln", 2, "100mbit", nics=2)) as c:
        daemons = {h: c.start_daemon(h, tmp_path) for h in HOSTS}
        sockets = [daemons[h][1] for h in HOSTS]
        medians, shares = {}, {}
        for planes in (1, 2):
            before = {h: _sent(c, h) for h in HOSTS}
            run = collect(c, launch(
                c, "gradlane", ["--steps", str(STEPS), *WORKLOAD], port=29860 + planes,
                out=tmp_path / f"planes{planes}", sockets=sockets, hosts=HOSTS,
                rank_args=[["--address", ",".join(c.addr(h, k) for k in range(planes))]
                           for h in HOSTS]))
            sent = [[a - b for a, b in zip(_sent(c, h), before[h], strict=True)] for h in HOSTS]
            shares[planes] = [s[1] / sum(s) for s in sent]  # eth1's part of each host's bytes
            medians[planes] = statistics.median(run.times[STEPS // 2:])
        assert [stop(proc) for proc, _ in daemons.values()] == [0, 0]  # qdiscs restored
    print({k: round(v * 1000) for k, v in medians.items()}, "ms;", shares)
    assert all(s < 0.01 for s in shares[1])  # one NIC: eth1 idle
    assert all(0.4 < s < 0.6 for s in shares[2])  # two: half each
    assert medians[2] < 0.75 * medians[1]
