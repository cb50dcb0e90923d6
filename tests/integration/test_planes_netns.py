"""Several NICs a host on the emulated cluster (`gradlane.nic_runs.run_two_nics`): two
hosts, each with two NICs on two switch planes, gradlaned shaping both. A rank given an
address on each spreads its chunks over both planes by bytes: each NIC carries about half
the bytes, and a communication-bound step takes about half as long as over one NIC.
gradlaned plans such a host with both NICs' rates.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradlane.nic_runs import run_two_nics
from gradlane.testbed import Cluster, Topology
from gradlane.testbed.links import line_rate
from tests.integration.helpers import hello, register, status, stop, wait_for

pytestmark = pytest.mark.netns


@pytest.mark.timeout(240)
def test_chunks_spread_over_two_nics_halve_a_communication_bound_step(tmp_path: Path) -> None:
    result = run_two_nics(tmp_path, steps=12, layout="fine")  # 12 steps: no layout trial
    assert result["daemon_exit_codes"] == [0] * 4  # qdiscs restored, both times
    one, two = (result["runs"][k] for k in ("gradlane, one NIC", "gradlane, two NICs"))
    print({k: round(r["median_s"] * 1000) for k, r in result["runs"].items()}, "ms;",
          [s[1] for s in two["nic_shares"]])
    assert all(s[1] < 0.01 for s in one["nic_shares"])  # one NIC: eth1 idle
    assert all(0.4 < s[1] < 0.6 for s in two["nic_shares"])  # two: about half each
    assert two["median_s"] < 0.75 * one["median_s"]
    assert result["speedup"] == pytest.approx(one["median_s"] / two["median_s"])
    # The bound: each host's model out and in over both NICs (communication-bound: 10 ms
    # of forward), which no run beats; each run's median over it is what the bench reports.
    bound = result["lower_bound_s"]
    assert bound > 0.1 and bound < two["median_s"]
    for label, run in result["runs"].items():
        assert result["summary"][label]["achieved_over_bound"] == pytest.approx(
            run["median_s"] / bound)
    # eth1 shaped to half: the shims weigh the planes 2:1 by the rates gradlaned gives, and
    # the step stays well under one NIC's (spread evenly, eth1's half alone would take as
    # long as a whole model over one NIC).
    uneven = result["uneven"]
    print("eth1 at half the rate:", round(uneven["median_s"] * 1000), "ms;",
          [s[1] for s in uneven["nic_shares"]])
    assert all(0.25 < s[1] < 0.42 for s in uneven["nic_shares"])
    assert uneven["median_s"] < 0.85 * one["median_s"]
    # What gradlaned was told of each NIC, as recorded for the replay (`gradlane sim
    # validate` shapes its links by it).
    line = line_rate(100_000_000)
    assert [one["daemon_line_bps"], two["daemon_line_bps"]] == [[line], [line, line]]
    assert uneven["daemon_line_bps"] == [line, line // 2]
    # Its bound is one NIC and a half's, and its ratio is to that.
    assert uneven["lower_bound_s"] == pytest.approx(bound * 2 / 1.5)
    assert uneven["lower_bound_s"] < uneven["median_s"]
    assert uneven["achieved_over_bound"] == pytest.approx(
        uneven["median_s"] / uneven["lower_bound_s"])


@pytest.mark.timeout(120)
def test_gradlaned_takes_the_nics_its_shims_send_over_as_the_host_s_link(tmp_path: Path) -> None:
    # eth1 at half eth0's rate; a shim registers a band connection from each NIC's
    # address, then from eth0's alone.
    tmp_path.chmod(0o755)
    with Cluster(Topology.build("gln2", 2, "100mbit", nics=2)) as c:
        proc, sock = c.start_daemon("h1", tmp_path, rate=["100mbit", "50mbit"])
        try:
            assert status(c)["link_bps"] == 50_000_000  # nothing registered: the slowest
            flows = [{"band": 0, "src": c.addr("h1", k), "sport": 40000 + k,
                      "dst": c.addr("h2", k), "dport": 5000} for k in range(2)]
            with register(sock, hello(flows)):
                wait_for(lambda: status(c)["link_bps"] == 150_000_000, "both NICs' sum")
            with register(sock, hello(flows[:1])):
                wait_for(lambda: status(c)["link_bps"] == 100_000_000, "eth0's rate")
        finally:
            assert stop(proc) == 0
