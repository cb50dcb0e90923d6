"""The control plane on the emulated cluster: what it changes, measured in one run.

Each scenario builds one cluster whose hosts run gradlaned with a
``[control]`` link to a host of its own, and runs the same training job(s)
without the control plane (the daemons use their local policy) and with it,
so both figures come from the same machine state. Needs root.

- `run_control_straggler`: one job on workers at speeds 1, 1, 1, 0.5 (batch
  shares), then a SIGKILL of the control plane mid-training and its restart.
- `run_two_jobs`: two jobs whose workers straddle an oversubscribed uplink
  (reduction within leaves first), against `fifo` too.

`tests/integration/test_control_netns.py` asserts on them;
``bench/control_straggler.py`` and ``bench/two_jobs.py`` record them as JSON.
"""

from __future__ import annotations

import json
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradlane.demo import collect, launch, run_on_cluster
from gradlane.errors import TestbedError
from gradlane.testbed import Cluster, Topology

__all__ = ["run_control_straggler", "run_two_jobs"]

CONTROL_PORT = 7800

STRAGGLER_SPEEDS = [1.0, 1.0, 1.0, 0.5]
# VGG-19: few layers, so the per-layer Python cost (which no batch share changes) stays
# small next to the compute the trace replays; its compute grows with the batch.
STRAGGLER_WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "2",
                      "--forward-ms", "60", "--follow-advice"]

# Run in a daemon's host: wait for a control plan that arrived after monotonic time
# argv[1] (the clock is the machine's, shared by every namespace) and print how long
# after it that was; exit 1 if none came within argv[2] seconds.
_PLAN_PROBE = """
import json, sys, time, urllib.request
since, deadline = float(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9464/status", timeout=1) as r:
            link = json.load(r)["control"]
        now = time.monotonic()
        if link["plan_age_s"] is not None and now - link["plan_age_s"] > since:
            print(now - link["plan_age_s"] - since)
            sys.exit(0)
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.05)
sys.exit(1)
"""


@dataclass
class _Controlled:
    """Daemons linked to a control plane's address on `control_host` (not started yet)."""

    cluster: Any
    control_host: str
    token: str
    token_file: Path
    daemons: dict[str, subprocess.Popen[str]]
    sockets: dict[str, Path]

    @property
    def url(self) -> str:
        return f"http://{self.cluster.addr(self.control_host)}:{CONTROL_PORT}"

    def start_control(self, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "gradlane.cli", "control",
                "--listen", f"{self.cluster.addr(self.control_host)}:{CONTROL_PORT}",
                "--token-file", str(self.token_file), "--cadence", "0.5", *args]
        proc: subprocess.Popen[str] = self.cluster.popen(self.control_host, argv)
        return proc

    def wait_view(self, ready: Callable[[dict[str, Any]], bool], what: str,
                  timeout: float = 30) -> None:
        """Wait until the control plane's ``/api/v1/cluster`` satisfies `ready`.

        Asked from inside the control plane's host: the root namespace has no route there.

        Raises:
            TestbedError: not within `timeout` seconds (the message says `what` was awaited).
        """
        probe = ("import sys, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
                 f"{self.url + '/api/v1/cluster'!r}, headers={{'Authorization': "
                 f"'Bearer {self.token}'}}), timeout=5); "
                 "sys.stdout.write(r.read().decode())")
        deadline = time.monotonic() + timeout
        while True:
            try:
                out = self.cluster.run(self.control_host, [sys.executable, "-c", probe]).stdout
                if ready(json.loads(out)):
                    return
            except (TestbedError, ValueError, KeyError, TypeError):
                pass  # not serving yet
            if time.monotonic() > deadline:
                raise TestbedError(f"the control plane did not see {what} in {timeout:.0f} s")
            time.sleep(0.5)

    def stop_daemons(self) -> list[int]:
        """SIGTERM every daemon (each restores its qdisc); their exit codes."""
        codes = []
        for proc in self.daemons.values():
            proc.send_signal(signal.SIGTERM)
            codes.append(proc.wait(timeout=20))
            if proc.stderr is not None:
                proc.stderr.close()
        return codes


def _controlled(c: Any, workdir: Path, hosts: Sequence[str], control_host: str) -> _Controlled:
    """Start gradlaned on `hosts`, each linked to a control plane on `control_host`."""
    workdir.chmod(0o755)
    token = secrets.token_hex(16)
    token_file = workdir / "control.token"
    token_file.write_text(token)
    url = f"http://{c.addr(control_host)}:{CONTROL_PORT}"
    daemons, sockets = {}, {}
    for host in hosts:
        leaf = c.topology.leaf_of(c.host_index(host))
        daemons[host], sockets[host] = c.start_daemon(host, workdir, args=[
            "--control-url", url, "--control-token-file", str(token_file),
            "--control-host", host, "--control-leaf", str(leaf)])
    return _Controlled(c, control_host, token, token_file, daemons, sockets)


def run_control_straggler(
    workdir: Path, steps: int = 40, say: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """One job on workers at speeds 1, 1, 1, 0.5: without the control plane, with it, and
    through a control-plane crash.

    1. 4 hosts run gradlaned with a ``[control]`` link to a fifth host; the
       control plane is down, so the daemons use their local policy and every
       worker keeps its batch of 32.
    2. The control plane starts on the fifth host; once the 4 daemons have
       registered, the same job runs again and the workers take the batch
       shares it advises.
    3. The job runs a third time; once its throughput is known to the control
       plane, the control plane is killed (SIGKILL) and restarted 2 s later.
       Every step must complete, and the time from the restart until each
       daemon holds a plan from the new control plane is measured in the
       daemons' own ``/status``.
    All in one cluster. Returns rank 0's iteration times of each run, every
    rank's batch per step in the second, the plan delays after the restart
    and the daemons' exit codes.

    Raises:
        TestbedError: the cluster, a daemon, a training step or the control plane failed.
    """
    args = ["--steps", str(steps), *STRAGGLER_WORKLOAD]
    workers = [f"h{i}" for i in range(1, 5)]
    with Cluster(Topology.build("strag", 5, "1gbit")) as c:
        ctl = _controlled(c, workdir, workers, "h5")
        sockets = [ctl.sockets[h] for h in workers]
        say("without the control plane")
        without, _ = run_on_cluster(c, "gradlane", args, port=29810, out=workdir,
                                    sockets=sockets, speeds=STRAGGLER_SPEEDS, workers=4)
        control = ctl.start_control()
        ctl.wait_view(lambda v: len(v["hosts"]) == len(workers), "all 4 daemons register")
        say("with the control plane")
        with_control, _ = run_on_cluster(c, "gradlane", args, port=29811, out=workdir,
                                         sockets=sockets, speeds=STRAGGLER_SPEEDS, workers=4)
        batches = [json.loads((workdir / f"gradlane-rank{r}.json").read_text())["batch"]
                   for r in range(4)]
        say("through a control-plane crash (SIGKILL, restart 2 s later)")
        job = launch(c, "gradlane", args, port=29812, out=workdir / "crash", sockets=sockets,
                     speeds=STRAGGLER_SPEEDS, hosts=workers, job="crash")
        # Training is under way once the control plane has throughput (hence shares) for it.
        ctl.wait_view(lambda v: len(set(v["plan"]["batch_shares"]["crash"])) > 1,
                      "job crash's throughput")
        control.kill()
        control.wait()
        time.sleep(2)
        restarted = time.monotonic()
        ctl.start_control()
        probes = [c.popen(h, [sys.executable, "-c", _PLAN_PROBE, repr(restarted), "15"],
                          stdout=subprocess.PIPE, text=True) for h in workers]
        delays = []
        for host, probe in zip(workers, probes, strict=True):
            out, _ = probe.communicate(timeout=30)
            if probe.returncode:
                raise TestbedError(f"no plan reached {host} within 15 s of the restart")
            delays.append(float(out))
        through_crash = collect(c, job)  # raises if a step failed
        codes = ctl.stop_daemons()
    tail = steps // 2
    before = statistics.median(without.times[tail:])
    after = statistics.median(with_control.times[tail:])
    return {
        "scenario": {"name": "control-straggler", "hosts": 4, "speeds": STRAGGLER_SPEEDS,
                     "steps": steps, "workload": STRAGGLER_WORKLOAD, "link": "1gbit"},
        "without_control": {"iteration_s": without.times, "median_s": before},
        "with_control": {"iteration_s": with_control.times, "median_s": after},
        "speedup": before / after,
        "batches": batches,
        "control_crash": {
            "iteration_s": through_crash.times,
            "steps_completed": len(through_crash.times),
            "plan_after_restart_s": delays,
        },
        "daemon_exit_codes": codes,
    }


# Two leaves of 4 job hosts each under one 4:1 oversubscribed uplink (h5, on the
# first leaf, runs the control plane). Each job has two workers on each leaf.
TWO_JOB_HOST_BPS = "100mbit"
TWO_JOB_UPLINK_BPS = "100mbit"
TWO_JOBS = {"a": ["h1", "h2", "h6", "h7"], "b": ["h3", "h4", "h8", "h9"]}
TWO_JOB_WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "1",
                    "--forward-ms", "60"]


def run_two_jobs(
    workdir: Path, steps: int = 30, say: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Two jobs across an oversubscribed uplink: `fifo`, gradlane, gradlane with the control plane.

    9 hosts on two leaves (h1-h5, h6-h9) joined by an uplink a quarter of
    the hosts' sum; jobs ``a`` and ``b`` (a VGG-19 trace) have two workers on
    each leaf, so every exchange crosses the uplink. The same pair of jobs
    runs three times, both jobs at once each time:

    1. ``fifo`` (gradlane's transport, one band, no overlap);
    2. ``gradlane`` with the daemons on their local policy (the control plane,
       on h5, is not running): flat reduce-scatter/all-gather;
    3. ``gradlane`` with ``gradlane control --uplink``: the control plane sees
       that the uplinks are oversubscribed and advises, through the daemons,
       reducing within each leaf first.

    Returns each job's rank-0 iteration times per run, the medians over the
    second half of the steps, their average per run, the ratios, and the
    leaves the shims reduced within (None: the flat exchange).

    Raises:
        TestbedError: the cluster, a daemon, a worker or the control plane failed.
    """
    args = ["--steps", str(steps), *TWO_JOB_WORKLOAD]
    hosts = [h for job in TWO_JOBS.values() for h in job]
    topology = Topology.build("twojob", 9, TWO_JOB_HOST_BPS, leaves=2, uplink=TWO_JOB_UPLINK_BPS)
    runs: dict[str, dict[str, list[float]]] = {}
    leaves: dict[str, dict[str, list[int] | None]] = {}
    port = 29820
    with Cluster(topology) as c:
        ctl = _controlled(c, workdir, hosts, "h5")

        def both(label: str, system: str) -> None:
            nonlocal port
            say(f"{label}: jobs a and b at once")
            started = []
            for job, job_hosts in TWO_JOBS.items():
                port += 1
                sockets = [ctl.sockets[h] for h in job_hosts] if system == "gradlane" else None
                started.append(launch(c, system, args, port=port, out=workdir / label / job,
                                      sockets=sockets, hosts=job_hosts, job=job))
            runs[label] = {j: collect(c, s).times for j, s in zip(TWO_JOBS, started, strict=True)}
            rank0 = {job: json.loads((workdir / label / job / f"{system}-rank0.json").read_text())
                     for job in TWO_JOBS}
            leaves[label] = {job: r.get("leaves") for job, r in rank0.items()}

        both("fifo", "fifo")
        both("gradlane", "gradlane")
        ctl.start_control("--uplink", TWO_JOB_UPLINK_BPS)
        ctl.wait_view(lambda v: len(v["hosts"]) == len(hosts) and v["plan"]["reduce_in_leaf"],
                      "all 8 daemons and an oversubscribed uplink")
        time.sleep(1)  # the plan's next push reaches every daemon (cadence 0.5 s)
        both("gradlane+control", "gradlane")
        codes = ctl.stop_daemons()
    tail = steps // 2
    medians = {label: {job: statistics.median(times[tail:]) for job, times in jobs.items()}
               for label, jobs in runs.items()}
    average = {label: statistics.fmean(m.values()) for label, m in medians.items()}
    return {
        "scenario": {"name": "two-jobs-oversubscribed", "hosts": 9, "jobs": TWO_JOBS,
                     "host_link": TWO_JOB_HOST_BPS, "uplink": TWO_JOB_UPLINK_BPS,
                     "steps": steps, "workload": TWO_JOB_WORKLOAD},
        "iteration_s": runs,
        "leaves": leaves,  # per run and job: the ranks' leaves if reduced within leaves first
        "median_s": medians,
        "average_median_s": average,
        "control_speedup": average["gradlane"] / average["gradlane+control"],
        "gradlane_over_fifo": average["fifo"] / average["gradlane+control"],
        "daemon_exit_codes": codes,
    }
