"""Ranks sharing hosts on the emulated cluster: two hosts with gradlaned, two ranks on
each, every rank listening on an address of its own (as pods do). The shims learn their
host from their gradlaned's welcome, reduce each chunk within each host first and tell
their daemons so; each host's NIC then carries about one model each way per step, where
the ring would carry 1.5.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradlane.control_runs import controlled
from gradlane.demo import collect, launch
from gradlane.policies.profiles import trace_spec
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import stop

pytestmark = pytest.mark.netns

STEPS = 12
PLACEMENT = ["h1", "h1", "h2", "h2"]
SECOND = 200  # each host's second rank listens on 10.200.0.(200 + host): its own address
WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "1", "--forward-ms", "10"]
# Run in h1: polls its gradlaned's /status every 0.1 s (up to argv[1] s) until a worker's
# exchange is said; prints it (nothing if none was).
PROBE = """
import json, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9464/status", timeout=2) as r:
            said = {w["exchange"] for j in json.load(r)["jobs"] for w in j["workers"]} - {None}
    except OSError:
        said = set()
    if said:
        print(*sorted(said))
        break
    time.sleep(0.1)
"""


@pytest.mark.timeout(180)
def test_ranks_sharing_hosts_reduce_within_them_first(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    with Cluster(Topology.build("coh", 2, "200mbit")) as c:
        addresses = [c.addr(h) for h in PLACEMENT]
        for rank in (1, 3):
            host = int(PLACEMENT[rank][1:])
            addresses[rank] = c.topology.address(SECOND + host)
            subprocess.run(["ip", "-n", c.ns(PLACEMENT[rank]), "addr", "add",
                            f"{addresses[rank]}/24", "dev", "eth0"], check=True)
        daemons = c.start_daemons(["h1", "h2"], tmp_path)
        sockets = {h: sock for h, (_, sock) in daemons.items()}
        probe = c.popen("h1", [sys.executable, "-c", PROBE, "90"], stdout=subprocess.PIPE,
                        text=True)
        job = launch(c, "gradlane", ["--steps", str(STEPS), *WORKLOAD], port=29840,
                     out=tmp_path, sockets=[sockets[h] for h in PLACEMENT], hosts=PLACEMENT,
                     rank_args=[["--address", a] for a in addresses])
        run = collect(c, job)
        seen = probe.communicate(timeout=100)[0].split()  # what h1's gradlaned was told
        assert [stop(proc) for proc, _ in daemons.values()] == [0, 0]  # qdiscs restored
    records = [json.loads((tmp_path / f"gradlane-rank{r}.json").read_text()) for r in range(4)]
    assert [(r["exchange"], r["leaves"], r["hosts"]) for r in records] == [
        ("host", None, [0, 0, 1, 1])] * 4
    assert seen == ["host"], seen
    # Each step, each host sends one copy of each chunk: its ranks' partial sum of the
    # chunks the other host owns, and the average of its own. The ring would send 1.5
    # models; what else crosses (rank 0's parameters once, the store, headers) is small.
    model = 4 * sum(n for n, _, _ in trace_spec("vgg19", 1.0, 0.010))
    per_host_step = run.wire_bytes / 2 / len(run.times)
    assert per_host_step < 1.3 * model, (per_host_step, model)
    print(f"each host sent {per_host_step / model:.2f} models per step")


@pytest.mark.timeout(240)
def test_hosts_under_oversubscribed_leaves_reduce_within_hosts_then_leaves(
    tmp_path: Path,
) -> None:
    """Two ranks on each of four hosts, two hosts a leaf, a 4:1 uplink; the control plane
    (on a fifth host) advises reducing within leaves. Two levels: one copy per host
    crosses its NIC and one per leaf the spine, 6 copies of each chunk on the hosts'
    NICs, 1.5 models a host a step; a leaf's leader alone would take a copy from every
    rank of its leaf (10 copies, 2.5 models)."""
    placement = ["h1", "h1", "h2", "h2", "h4", "h4", "h5", "h5"]
    topology = Topology.build("hil", 5, "200mbit", leaves=2, uplink="100mbit")
    with Cluster(topology) as c:
        ctl = controlled(c, tmp_path, ["h1", "h2", "h4", "h5"], "h3")
        ctl.start_control("--uplink", "100mbit")
        ctl.wait_view(lambda v: len(v["hosts"]) == 4 and v["plan"]["reduce_in_leaf"],
                      "4 daemons and an oversubscribed uplink")
        time.sleep(1)  # the plan's next push reaches every daemon (cadence 0.5 s)
        job = launch(c, "gradlane", ["--steps", str(STEPS), *WORKLOAD], port=29841,
                     out=tmp_path, sockets=[ctl.sockets[h] for h in placement],
                     hosts=placement)
        run = collect(c, job)
        assert ctl.stop_daemons() == [0] * 4  # qdiscs restored
    records = [json.loads((tmp_path / f"gradlane-rank{r}.json").read_text()) for r in range(8)]
    assert [(r["exchange"], r["leaves"], r["hosts"]) for r in records] == [
        ("leaf", [0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2, 3, 3])] * 8
    model = 4 * sum(n for n, _, _ in trace_spec("vgg19", 1.0, 0.010))
    per_host_step = run.wire_bytes / 4 / len(run.times)
    assert per_host_step < 2.0 * model, (per_host_step, model)
    print(f"each host sent {per_host_step / model:.2f} models per step")
