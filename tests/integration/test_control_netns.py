"""The control plane end to end: straggler mitigation on an emulated cluster.

Four hosts with gradlaned, a fifth running `gradlane control`; one training
job (a VGG-19 trace whose compute grows with the batch) on workers at
relative speeds 1, 1, 1, 0.5. First the control plane is down (the daemons
run their local policy, every worker keeps its batch of 32); then it is
started, the shims' timings reach it through the daemons, it answers with
batch shares by throughput, and the workers take them. Both runs in the same
cluster, one after the other.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gradlane.demo import run_on_cluster
from gradlane.errors import TestbedError
from gradlane.testbed import Cluster, Topology
from tests.integration.helpers import stop

pytestmark = pytest.mark.netns

TOKEN = "netns-test-token-0123456789"
SPEEDS = [1.0, 1.0, 1.0, 0.5]
# VGG-19: few layers, so the per-layer Python cost (which no batch share changes) stays
# small next to the compute the trace replays.
WORKER = ["--steps", "40", "--workload", "trace", "--model", "vgg19", "--model-mb", "2",
          "--forward-ms", "60", "--follow-advice"]


def _cluster_view(c: Cluster, port: int) -> dict:  # type: ignore[type-arg]
    req = urllib.request.Request(f"http://{c.addr('h5')}:{port}/api/v1/cluster",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    # Ask from inside the control plane's host: the root namespace has no route there.
    out = c.run("h5", [sys.executable, "-c",
                       "import sys, urllib.request; r = urllib.request.urlopen(urllib.request."
                       f"Request({req.full_url!r}, headers={dict(req.header_items())!r}), "
                       "timeout=5); sys.stdout.write(r.read().decode())"])
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.timeout(420)
def test_batch_shares_from_the_control_plane_cut_the_straggler(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with Cluster(Topology.build("tctl", 5, "1gbit")) as c:
        control_url = f"http://{c.addr('h5')}:7800"
        daemons = [
            c.start_daemon(f"h{i}", tmp_path, args=[
                "--control-url", control_url, "--control-token-file", str(token),
                "--control-host", f"h{i}"])
            for i in range(1, 5)
        ]
        sockets = [sock for _, sock in daemons]
        # 1. No control plane: the daemons keep retrying and use their local policy.
        without, _ = run_on_cluster(c, "gradlane", WORKER, port=29810, out=tmp_path,
                                    sockets=sockets, speeds=SPEEDS, workers=4)
        # 2. The control plane starts; plans flow once the daemons reconnect.
        c.popen("h5", [sys.executable, "-m", "gradlane.cli", "control", "--listen",
                       f"{c.addr('h5')}:7800", "--token-file", str(token), "--cadence", "0.5"])
        deadline = time.monotonic() + 20
        while True:
            try:
                view = _cluster_view(c, 7800)
                if len(view["hosts"]) == 4:
                    break
            except (TestbedError, ValueError, KeyError):
                pass  # not serving yet
            assert time.monotonic() < deadline, "daemons did not register with the control plane"
            time.sleep(0.5)
        with_control, _ = run_on_cluster(c, "gradlane", WORKER, port=29811, out=tmp_path,
                                         sockets=sockets, speeds=SPEEDS, workers=4)
        for proc, _ in daemons:
            assert stop(proc) == 0  # each restored its qdisc and exited cleanly
    batches = [json.loads((tmp_path / f"gradlane-rank{r}.json").read_text())["batch"]
               for r in range(4)]
    # The advice arrived: the slow worker ends with about half a fast one's batch.
    assert batches[3][0] == 32 and batches[3][-1] < 24, batches[3]
    assert sum(b[-1] for b in batches) == 4 * 32 and batches[0][-1] > 32
    tail = len(with_control.times) // 2
    before = statistics.median(without.times[tail:])
    after = statistics.median(with_control.times[tail:])
    print(f"final batches {[b[-1] for b in batches]}; "
          f"iteration: {before * 1000:.1f} ms without the control plane, "
          f"{after * 1000:.1f} ms with it ({before / after:.2f}x)")
    assert before / after >= 1.3
