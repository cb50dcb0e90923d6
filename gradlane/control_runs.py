"""The control plane on the emulated cluster: what it changes, measured in one run.

Each scenario builds one cluster whose hosts run gradlaned with a
``[control]`` link to a host of its own, and runs the same training job(s)
without the control plane (the daemons use their local policy) and with it,
so both figures come from the same machine state. Needs root.

- `run_control_straggler`: one job on workers at speeds 1, 1, 1, 0.5 (batch
  shares), then a SIGKILL of the control plane mid-training and its restart.
- `run_slow_link`: one job on 4 hosts, one on a link half as fast, and
  `run_co_located`: one job of 8 ranks on 2 hosts (the plan's chunk owners,
  weighed by what each host link carries).
- `run_two_jobs`: two jobs whose workers straddle an oversubscribed uplink
  (reduction within leaves first), against `fifo` too.

`tests/integration/test_control_netns.py` asserts on them;
``bench/control_straggler.py`` and ``bench/two_jobs.py`` record them as JSON.
"""

from __future__ import annotations

import contextlib
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

from gradlane.benchmark import PAYLOAD_EFFICIENCY, lower_bound, summarize
from gradlane.demo import SystemRun, collect, launch, run_on_cluster, steady_start
from gradlane.errors import ConfigError, TestbedError
from gradlane.policies.profiles import trace_totals as profile_totals
from gradlane.policies.straggler import proportional_shares
from gradlane.systems import REFERENCE
from gradlane.testbed import Cluster, Topology
from gradlane.testbed.links import line_rate
from gradlane.units import parse_rate

__all__ = ["CO_LOCATED", "OWNERS_SCENARIOS", "SLOW_LINK", "Controlled", "OwnersScenario",
           "controlled", "run_co_located", "run_control_straggler", "run_planned_owners",
           "run_slow_link", "run_two_jobs", "stop_daemons", "trace_totals", "trace_workload",
           "worker_option"]

CONTROL_PORT = 7800

STRAGGLER_SPEEDS = [1.0, 1.0, 1.0, 0.5]
# VGG-19: few layers, so the per-layer Python cost (which no batch share changes) stays
# small next to the compute the trace replays; its compute grows with the batch.
STRAGGLER_WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "2",
                      "--forward-ms", "60", "--follow-advice"]

# Run in a daemon's host, polling its /status; argv: since (monotonic time: the clock is
# the machine's, shared by every namespace), seconds to wait, and what to wait for:
# "plan" (a control plan that arrived after `since`) or text in the control link's state.
# Prints when (monotonic) it happened; exits 1 if it did not within the wait.
_STATUS_PROBE = """
import json, sys, time, urllib.request
since, deadline, want = float(sys.argv[1]), time.monotonic() + float(sys.argv[2]), sys.argv[3]
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9464/status", timeout=1) as r:
            link = json.load(r)["control"]
        now = time.monotonic()
        if want == "plan" and link["plan_age_s"] is not None and now - link["plan_age_s"] > since:
            print(now - link["plan_age_s"])
            sys.exit(0)
        if want != "plan" and want in link["state"]:
            print(now)
            sys.exit(0)
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.1)
sys.exit(1)
"""


@dataclass
class Controlled:
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
                  timeout: float = 30) -> dict[str, Any]:
        """Wait until the control plane's ``/api/v1/cluster`` satisfies `ready`; return it.

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
                view: dict[str, Any] = json.loads(out)
                if ready(view):
                    return view
            except (TestbedError, ValueError, KeyError, TypeError):
                pass  # not serving yet
            if time.monotonic() > deadline:
                raise TestbedError(f"the control plane did not see {what} in {timeout:.0f} s")
            time.sleep(0.5)

    def probe_daemons(self, hosts: Sequence[str], since: float, want: str,
                      wait_s: float) -> Callable[[], list[float]]:
        """Start polling each daemon's /status for `want` after `since` (see `_STATUS_PROBE`);
        the returned function waits for them and gives the (monotonic) times it showed.

        Start the probes before the event they time: their own start-up then does not
        compete with it for the CPU.

        Raises (the returned function):
            TestbedError: some daemon did not within `wait_s`.
        """
        probes = [self.cluster.popen(h, [sys.executable, "-c", _STATUS_PROBE, repr(since),
                                         str(wait_s), want], stdout=subprocess.PIPE, text=True)
                  for h in hosts]

        def times() -> list[float]:
            out = []
            for host, probe in zip(hosts, probes, strict=True):
                text, _ = probe.communicate(timeout=wait_s + 15)
                if probe.returncode:
                    raise TestbedError(f"gradlaned on {host} did not show {want!r} "
                                       f"in {wait_s:.0f} s")
                out.append(float(text))
            return out

        return times

    def stop_daemons(self) -> list[int]:
        """SIGTERM every daemon (each restores its qdisc); their exit codes."""
        return stop_daemons(self.daemons)


def worker_option(argv: Sequence[str], name: str, default: str | None = None) -> str:
    """The value of `gradlane.worker`'s option `name` in `argv` (the last one given), or
    `default` when none is.

    Raises:
        ConfigError: not given, and no default.
    """
    at = [i for i, a in enumerate(argv) if a == name and i + 1 < len(argv)]
    if at:
        return argv[at[-1] + 1]
    if default is None:
        raise ConfigError(f"the workload {' '.join(argv)!r} needs {name}")
    return default


def stop_daemons(daemons: dict[str, subprocess.Popen[str]]) -> list[int]:
    """SIGTERM every gradlaned of `daemons` (by host; each restores its qdisc); their exit
    codes. What one that failed said goes to stderr: it is the only clue."""
    codes = []
    for host, proc in daemons.items():
        proc.send_signal(signal.SIGTERM)
        codes.append(proc.wait(timeout=20))
        if proc.stderr is not None:
            if codes[-1]:
                said = proc.stderr.read()[-4000:]
                sys.stderr.write(f"gradlaned on {host} exited with {codes[-1]}:\n{said}\n")
            proc.stderr.close()
    return codes


def trace_workload(workload: Sequence[str]) -> tuple[str, float, float]:
    """(model, model MB, forward ms) of a trace workload given as the worker's argv."""
    return (worker_option(workload, "--model"), float(worker_option(workload, "--model-mb")),
            float(worker_option(workload, "--forward-ms")))


def trace_totals(workload: Sequence[str]) -> tuple[float, int]:
    """Compute seconds per iteration (batch 32, speed 1) and model bytes of a trace workload
    given as the worker's argv."""
    return profile_totals(*trace_workload(workload))


def controlled(c: Any, workdir: Path, hosts: Sequence[str], control_host: str) -> Controlled:
    """Start gradlaned on `hosts`, each linked to a control plane on `control_host`."""
    workdir.chmod(0o755)
    token = secrets.token_hex(16)
    token_file = workdir / "control.token"
    token_file.touch(0o600)  # the owner's alone, as the README has it
    token_file.write_text(token)
    url = f"http://{c.addr(control_host)}:{CONTROL_PORT}"
    started = c.start_daemons(hosts, workdir, args=lambda host: [
        "--control-url", url, "--control-token-file", str(token_file),
        "--control-host", host, "--control-leaf", str(c.topology.leaf_of(c.host_index(host)))])
    daemons = {host: proc for host, (proc, _) in started.items()}
    sockets = {host: sock for host, (_, sock) in started.items()}
    return Controlled(c, control_host, token, token_file, daemons, sockets)


def run_control_straggler(
    workdir: Path,
    steps: int = 40,
    say: Callable[[str], None] = lambda _: None,
    ddp: bool = False,
    reference: bool = False,
    ttl_s: float = 10.0,
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
    4. The control plane's host is cut off (its switch port down): each
       daemon's ``/status`` must say, once the plan's TTL (`ttl_s`, the
       control plane's ``--ttl``) is over, that the local policy is back.
    All in one cluster. With `ddp`, PyTorch DDP runs the job first (same
    speeds, batch 32 each). With `reference`, the bound's compute is measured
    first (`gradlane.benchmark`): the workers compute alone (``local``, nothing
    exchanged) with batches proportional to their speeds, as a perfect
    balancer would split the global batch. Returns rank 0's iteration times of each run,
    every rank's batch per step in the second, the plan delays after the
    restart and the daemons' exit codes.

    Raises:
        TestbedError: the cluster, a daemon, a training step or the control plane failed.
    """
    args = ["--steps", str(steps), *STRAGGLER_WORKLOAD]
    workers = [f"h{i}" for i in range(1, 5)]
    with Cluster(Topology.build("strag", 5, "1gbit")) as c:
        ctl = controlled(c, workdir, workers, "h5")
        sockets = [ctl.sockets[h] for h in workers]
        alone = None
        if reference:
            say("compute alone (the bound's reference)")
            from gradlane.workloads import BATCH  # torch: only where it is needed

            shares = list(proportional_shares(4 * BATCH, STRAGGLER_SPEEDS))
            alone = collect(c, launch(c, REFERENCE, args, port=29808, out=workdir,
                                      speeds=STRAGGLER_SPEEDS, batches=shares, hosts=workers))
        if ddp:
            say("PyTorch DDP")
            baseline, _ = run_on_cluster(c, "ddp", args, port=29809, out=workdir,
                                         speeds=STRAGGLER_SPEEDS, workers=4)
        say("without the control plane")
        without, _ = run_on_cluster(c, "gradlane", args, port=29810, out=workdir,
                                    sockets=sockets, speeds=STRAGGLER_SPEEDS, workers=4)
        control = ctl.start_control("--ttl", f"{ttl_s:g}")
        ctl.wait_view(lambda v: len(v["hosts"]) == len(workers), "all 4 daemons register")
        say("with the control plane")
        with_control, _ = run_on_cluster(c, "gradlane", args, port=29811, out=workdir,
                                         sockets=sockets, speeds=STRAGGLER_SPEEDS, workers=4)
        ranks = [json.loads((workdir / f"gradlane-rank{r}.json").read_text()) for r in range(4)]
        batches = [r["batch"] for r in ranks]
        say("through a control-plane crash (SIGKILL, restart 2 s later)")
        # Twice the steps: training must still run when the control plane comes back.
        crash_args = ["--steps", str(2 * steps), *STRAGGLER_WORKLOAD]
        job = launch(c, "gradlane", crash_args, port=29812, out=workdir / "crash",
                     sockets=sockets, speeds=STRAGGLER_SPEEDS, hosts=workers, job="crash")
        # Training is under way once the control plane has throughput (hence shares) for it.
        def balanced(view: dict[str, Any]) -> bool:
            return len(set(view["plan"]["batch_shares"]["crash"])) > 1

        split = [_split(ctl.wait_view(balanced, "job crash's throughput"), "crash")]
        control.kill()
        control.wait()
        # No plan can come while it is down: any plan after the kill is the new one's.
        arrivals = ctl.probe_daemons(workers, time.monotonic(), "plan", 20)
        time.sleep(2)
        restarted = time.monotonic()
        ctl.start_control("--ttl", f"{ttl_s:g}")
        training = all(p.poll() is None for p in job.procs)
        delays = [t - restarted for t in arrivals()]
        # The new control plane splits the same global batch (the shims stated it), not
        # the sum of batches the ranks happen to have now.
        split.append(_split(ctl.wait_view(balanced, "job crash's shares after the restart"),
                            "crash"))
        training = training and all(p.poll() is None for p in job.procs)
        through_crash = collect(c, job)  # raises if a step failed
        say("network partition: the control plane's host cut off")
        local = ctl.probe_daemons(workers, time.monotonic(), "expired: local policy", 30)
        time.sleep(1)  # the probes are up
        cut = time.monotonic()
        c.set_port("h5", up=False)
        expired = [t - cut for t in local()]
        codes = ctl.stop_daemons()
    tail = steps // 2
    before = statistics.median(without.times[tail:])
    after = statistics.median(with_control.times[tail:])
    extra: dict[str, Any] = {}
    runs = {"gradlane": without, "gradlane+control": with_control}
    if ddp:
        median = statistics.median(baseline.times[tail:])
        extra = {"ddp": {"iteration_s": baseline.times, "median_s": median},
                 "speedup_over_ddp": median / after}
        runs = {"ddp": baseline, **runs}
    # The bound: batch shares proportional to speed make every worker compute the global
    # batch over the sum of speeds; and the all-reduce minimum over one 1 Gbit/s link.
    compute, size = trace_totals(STRAGGLER_WORKLOAD)
    nominal = compute * len(STRAGGLER_SPEEDS) / sum(STRAGGLER_SPEEDS)
    bound = lower_bound(4, nominal, size, parse_rate("1gbit"))
    extra["nominal_lower_bound_s"] = bound
    if alone is not None:  # measured: what the balanced compute takes on this machine
        runs = {REFERENCE: alone, **runs}
        extra["compute_s"] = statistics.median(alone.times[tail:])
        bound = lower_bound(4, extra["compute_s"], size, parse_rate("1gbit"))
    extra["lower_bound_s"] = bound
    extra["summary"] = summarize({k: r.times[tail:] for k, r in runs.items()}, bound,
                                 {k: [r] for k, r in runs.items()})
    return {
        "steady_from_step": tail,  # the medians' steps: the second half, past the layout trial
        "scenario": {"name": "control-straggler", "hosts": 4, "speeds": STRAGGLER_SPEEDS,
                     "steps": steps, "workload": STRAGGLER_WORKLOAD, "link": "1gbit"},
        "without_control": {"iteration_s": without.times, "median_s": before},
        "with_control": {"iteration_s": with_control.times, "median_s": after,
                         "layout_trial": ranks[0].get("layout_trial")},
        "speedup": before / after,
        "batches": batches,
        "control_crash": {
            "iteration_s": through_crash.times,
            "steps_completed": len(through_crash.times),
            "plan_after_restart_s": delays,
            # (global batch, the sum of its shares) before the kill and after the restart.
            "split": split,
            # The job was still training when the control plane came back and when every
            # daemon had its plan again.
            "training_throughout": training,
        },
        # After the control plane's host is cut off: when each daemon's /status said its
        # plan had expired and the local policy is back (after the plan's TTL).
        "partition_local_policy_after_s": expired,
        "plan_ttl_s": ttl_s,
        "daemon_exit_codes": codes,
        **extra,
    }


@dataclass(frozen=True)
class OwnersScenario:
    """One job whose chunk owners the control plan decides (`run_planned_owners`)."""

    name: str
    cluster: str  # the emulated cluster's name (short: it names links)
    rates: tuple[str, ...]  # per host; the last runs the control plane
    placement: tuple[str, ...]  # each rank's host, rank order
    workload: tuple[str, ...]
    # Further runs with the control plane up, after the others: (label, worker args added).
    also: tuple[tuple[str, tuple[str, ...]], ...] = ()


# One job on 4 hosts, the last on a link half as fast (h5 runs the control plane). A
# VGG-19 trace whose exchange outlasts its compute: who owns what decides the iteration.
SLOW_LINK = OwnersScenario(
    "control-slow-link", "slow", ("1gbit", "1gbit", "1gbit", "500mbit", "1gbit"),
    ("h1", "h2", "h3", "h4"),
    ("--workload", "trace", "--model", "vgg19", "--model-mb", "8", "--forward-ms", "20"))
# Eight ranks, four on each of two hosts (h3 runs the control plane), on the ring: only
# two of its eight links cross a NIC. Then the shims' default for ranks sharing hosts,
# within hosts first.
CO_LOCATED = OwnersScenario(
    "control-co-located", "coloc", ("100mbit", "100mbit", "1gbit"), ("h1",) * 4 + ("h2",) * 4,
    ("--workload", "trace", "--model", "vgg19", "--model-mb", "2", "--forward-ms", "20",
     "--exchange", "ring"),
    also=(("gradlane+control, within hosts", ("--exchange", "auto")),))
OWNERS_SCENARIOS = {s.name: s for s in (SLOW_LINK, CO_LOCATED)}


def run_slow_link(workdir: Path, steps: int = 60, say: Callable[[str], None] = lambda _: None,
                  reference: bool = False) -> dict[str, Any]:
    """`run_planned_owners` of `SLOW_LINK`: without the control plane the slow link carries
    1.5 models each way at half the rate; the plan gives the slow rank every chunk, and its
    links carry its gradient out and the average in, the least any scheme could."""
    return run_planned_owners(SLOW_LINK, workdir, steps, say, reference)


def run_co_located(workdir: Path, steps: int = 60, say: Callable[[str], None] = lambda _: None,
                   reference: bool = False) -> dict[str, Any]:
    """`run_planned_owners` of `CO_LOCATED`: on the ring, with equal owners each host link
    carries 1.75 models each way; the plan gives the ranks at either end of each host's
    run every chunk, and each link carries 1.5 (a chunk owned there skips it one way).
    Then the shims' default, reduced within hosts first: one model each way."""
    return run_planned_owners(CO_LOCATED, workdir, steps, say, reference)


def owners_steady_step(taken_at: Sequence[int | None], steps: int) -> int:
    """The first step measured once the ranks took the plan's owners (each rank's step in
    `taken_at`, None: never): two past it, past the regrouping.

    Raises:
        TestbedError: the ranks took them at different steps, or never, or with fewer
            than 10 of the `steps` left to measure.
    """
    taken = set(taken_at)
    step = taken.pop() if len(taken) == 1 else None
    if step is None or steps - (step + 2) < 10:
        raise TestbedError(f"the ranks took the control plan's owners at steps {list(taken_at)}"
                           f" of {steps} (None: never): nothing to measure")
    return step + 2


def run_planned_owners(
    scenario: OwnersScenario,
    workdir: Path,
    steps: int = 60,
    say: Callable[[str], None] = lambda _: None,
    reference: bool = False,
) -> dict[str, Any]:
    """One job: gradlane without and with the control plane, whose `loadbalance` owners
    the shims take (`Sync._follow_plan_owners`).

    Without the control plane every rank owns an equal share of the gradient.
    With it, the plan weighs the owners by what each host link carries for
    the shims' exchange (`owner_shares`). Both runs in one cluster; with
    `reference`, the workers first compute alone (``local``) for the bound's
    compute. Medians from two steps after the ranks took the plan's owners
    (past the layout trial and the regrouping), over the same steps in both
    runs: the ranks check every 10 steps, and the plan can miss a check
    while gradlaned's reports (every 2 s) still hold the trial's chunks, so
    the default runs long enough for a take at step 40. Returns each run's
    rank-0 iteration times and waits, their medians, the ratio, the bytes
    each rank owned and when the ranks took the plan's owners, the bound,
    and the slowest link's modelled times on the ring and flat.

    Raises:
        TestbedError: the cluster, a daemon, a training step or the control plane failed,
            or the ranks did not take the plan's owners with 10 steps left to measure.
    """
    import numpy as np

    from gradlane.policies.demand import Exchange
    from gradlane.policies.loadbalance import exchange_time, owner_shares

    args = ["--steps", str(steps), *scenario.workload]
    hosts = list(dict.fromkeys(scenario.placement))  # each once, in rank order
    world = len(scenario.placement)
    control_host = f"h{len(scenario.rates)}"
    with Cluster(Topology.build(scenario.cluster, len(scenario.rates),
                                list(scenario.rates))) as c:
        ctl = controlled(c, workdir, hosts, control_host)
        sockets = [ctl.sockets[h] for h in scenario.placement]
        runs: dict[str, SystemRun] = {}

        def run(system: str, port: int, out: Path, with_sockets: bool,
                added: Sequence[str] = ()) -> SystemRun:
            return collect(c, launch(c, system, [*args, *added], port=port, out=out,
                                     sockets=sockets if with_sockets else None,
                                     hosts=list(scenario.placement)))

        if reference:
            say("compute alone (the bound's reference)")
            runs[REFERENCE] = run(REFERENCE, 29830, workdir, with_sockets=False)
        say("without the control plane")
        runs["gradlane"] = run("gradlane", 29831, workdir / "local", with_sockets=True)
        ctl.start_control()
        ctl.wait_view(lambda v: len(v["hosts"]) == len(hosts),
                      f"all {len(hosts)} daemons register")
        say("with the control plane")
        runs["gradlane+control"] = run("gradlane", 29832, workdir / "control",
                                       with_sockets=True)
        for i, (label, added) in enumerate(scenario.also):
            say(label)
            runs[label] = run("gradlane", 29833 + i, workdir / f"also{i}", with_sockets=True,
                              added=added)
        codes = ctl.stop_daemons()
    ranks = {label: [json.loads((workdir / label / f"gradlane-rank{r}.json").read_text())
                     for r in range(world)] for label in ("local", "control")}
    also = [json.loads((workdir / f"also{i}" / "gradlane-rank0.json").read_text())
            for i in range(len(scenario.also))]
    steady = owners_steady_step([r["owners_taken_at"] for r in ranks["control"]], steps)
    medians = {k: statistics.median(r.times[steady:]) for k, r in runs.items()}
    compute, size = trace_totals(scenario.workload)
    extra: dict[str, Any] = {}
    if reference:
        extra["compute_s"] = compute = medians[REFERENCE]
    # The bound: every host sends at least one model out (what the others need of its
    # ranks' gradients, or of the averages it reduced) and takes one in, whatever the
    # scheme; the slowest host link needs that long at least.
    rates = [parse_rate(scenario.rates[c.host_index(h) - 1]) for h in hosts]
    per_byte = size * 8 / PAYLOAD_EFFICIENCY  # the model's bits, at the payload rate
    bound = max(compute, per_byte / min(rates))
    rank_host = [hosts.index(h) for h in scenario.placement]

    def modelled(ring: bool) -> dict[str, float]:
        loads = Exchange(np.zeros(world, dtype=np.int64), uplinks=False, host=rank_host,
                         ring=ring).link_loads(in_leaf=False)
        link_bps = np.array(rates * 2, dtype=np.float64)
        return {"equal": per_byte * exchange_time(loads, link_bps, [1 / world] * world),
                "by_rate": per_byte * exchange_time(loads, link_bps,
                                                    owner_shares(loads, link_bps))}

    return {
        "scenario": {"name": scenario.name, "hosts": len(hosts), "rates": list(scenario.rates[:-1]),
                     "placement": list(scenario.placement), "steps": steps,
                     "workload": list(scenario.workload)},
        "steady_from_step": steady,
        # What gradlaned on each host was told its NIC's line rate is (it shapes under it).
        "daemon_line_bps": [line_rate(r) for r in rates],
        "without_control": {"iteration_s": runs["gradlane"].times,
                            "waited_s": ranks["local"][0]["waited"],  # rank 0's, per step
                            "layout_trial": ranks["local"][0]["layout_trial"],
                            "median_s": medians["gradlane"],
                            "owned_bytes": ranks["local"][0]["owned_bytes"],
                            "owners_taken_at": ranks["local"][0]["owners_taken_at"]},
        "with_control": {"iteration_s": runs["gradlane+control"].times,
                         "waited_s": ranks["control"][0]["waited"],
                         "layout_trial": ranks["control"][0]["layout_trial"],
                         "median_s": medians["gradlane+control"],
                         "owned_bytes": ranks["control"][0]["owned_bytes"],
                         # every rank's: they must agree
                         "owners_taken_at": [r["owners_taken_at"] for r in ranks["control"]]},
        "speedup": medians["gradlane"] / medians["gradlane+control"],
        # The further runs (`OwnersScenario.also`), with how their ranks exchanged.
        "also": {label: {"iteration_s": runs[label].times, "waited_s": also[i]["waited"],
                         "layout_trial": also[i]["layout_trial"], "median_s": medians[label],
                         "exchange": also[i].get("exchange")}
                 for i, (label, _) in enumerate(scenario.also)},
        # The slowest host link, modelled, owned bytes equal and as the plan shares them:
        # the shims' ring, and the flat exchange.
        "model_exchange_s": {"ring": modelled(True), "flat": modelled(False)},
        "lower_bound_s": bound,
        "summary": summarize({k: r.times[steady:] for k, r in runs.items()}, bound,
                             {k: [r] for k, r in runs.items()}),
        "daemon_exit_codes": codes,
        **extra,
    }


# Two leaves of 4 job hosts each under one 4:1 oversubscribed uplink (h5, on the
# first leaf, runs the control plane). Each job has two workers on each leaf.
TWO_JOB_HOST_BPS = "100mbit"
TWO_JOB_UPLINK_BPS = "100mbit"
TWO_JOBS = {"a": ["h1", "h2", "h6", "h7"], "b": ["h3", "h4", "h8", "h9"]}
TWO_JOB_WORKLOAD = ["--workload", "trace", "--model", "vgg19", "--model-mb", "1",
                    "--forward-ms", "60"]


def two_job_bound(compute_s: float, size: int) -> float:
    """The two-job scenario's least iteration time, for a compute of `compute_s` and a
    model of `size` bytes: each worker computes and sends 2 (W-1)/W models over its host
    link; and each job moves at least one model each way across the uplink (each leaf
    needs the other leaf's sum of every element), both jobs through the one uplink."""
    host = lower_bound(len(next(iter(TWO_JOBS.values()))), compute_s, size,
                       parse_rate(TWO_JOB_HOST_BPS))
    uplink = parse_rate(TWO_JOB_UPLINK_BPS) * PAYLOAD_EFFICIENCY
    return max(host, len(TWO_JOBS) * size * 8 / uplink)


def _split(view: dict[str, Any], job: str) -> tuple[int, int]:
    """(the global batch, the sum of the batch shares) the control plane's `view` plans."""
    return view["jobs"][job]["global_batch"], sum(view["plan"]["batch_shares"][job])


def _spans(rank0: dict[str, dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per job, each iteration's (start, end) from its first steady step (`steady_start`:
    past the shim's layout trial when the run is long enough, as every run is measured),
    on the monotonic clock."""
    return {job: [(end - t, end) for t, end in zip(r["times"], r["ends"], strict=True)]
            [steady_start(len(r["times"])):] for job, r in rank0.items()}


def _shared_window(rank0: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """From when every job is past its warm-up (`_spans`) to when the first job ends."""
    return _window(_spans(rank0))


def _window(spans: dict[str, list[tuple[float, float]]]) -> tuple[float, float]:
    return max(s[0][0] for s in spans.values()), min(s[-1][1] for s in spans.values())


def _overlapping(rank0: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """Per job, the iterations (past its warm-up, `_spans`) that ran entirely while every
    job trained.

    Raises:
        TestbedError: fewer than 3 such iterations for some job: the jobs hardly overlapped.
    """
    spans = _spans(rank0)
    start, stop = _window(spans)
    out = {job: [b - a for a, b in s if a >= start and b <= stop] for job, s in spans.items()}
    short = [job for job, times in out.items() if len(times) < 3]
    if short:
        raise TestbedError(f"jobs {short} ran fewer than 3 iterations while all jobs trained; "
                           "run more steps")
    return out


def run_two_jobs(
    workdir: Path,
    steps: int = 50,
    say: Callable[[str], None] = lambda _: None,
    fifo: bool = True,
    reference: bool = False,
    layout: str = "auto",
) -> dict[str, Any]:
    """Two jobs across an oversubscribed uplink: `fifo`, gradlane, gradlane with the control plane.

    9 hosts on two leaves (h1-h5, h6-h9) joined by an uplink a quarter of
    the hosts' sum; jobs ``a`` and ``b`` (a VGG-19 trace) have two workers on
    each leaf, so every exchange crosses the uplink. The same pair of jobs
    runs three times, both jobs at once each time:

    1. ``fifo`` (gradlane's transport, one band, no overlap; skipped unless `fifo`);
    2. ``gradlane`` with the daemons on their local policy (the control plane,
       on h5, is not running): flat reduce-scatter/all-gather;
    3. ``gradlane`` with ``gradlane control --uplink``: the control plane sees
       that the uplinks are oversubscribed and advises, through the daemons,
       reducing within each leaf first.

    With `reference`, both jobs first run ``local`` at once (each worker computes
    alone, nothing exchanged): the bound's compute, measured on this machine
    under the same load of eight workers. `layout` is the shims' gradient
    grouping (`ShimConfig.layout`; "auto" runs the layout trial).

    Only iterations during which both jobs were training count (`_overlapping`):
    the jobs' workers start a few seconds apart; and of each job only its steady
    steps (`steady_start`: from step 18 of 50, past the shims' layout trial, which
    runs both groupings until it decides). Returns each job's rank-0
    iteration times per run, the shared ones, their medians, the average of
    the medians per run, the ratios, and the leaves the shims reduced within
    (None: the flat exchange).

    Raises:
        TestbedError: the cluster, a daemon, a worker or the control plane failed.
    """
    args = ["--steps", str(steps), *TWO_JOB_WORKLOAD, "--layout", layout]
    hosts = [h for job in TWO_JOBS.values() for h in job]
    topology = Topology.build("twojob", 9, TWO_JOB_HOST_BPS, leaves=2, uplink=TWO_JOB_UPLINK_BPS)
    runs: dict[str, dict[str, list[float]]] = {}
    leaves: dict[str, dict[str, list[int] | None]] = {}
    trials: dict[str, dict[str, Any]] = {}  # the shims' layout trial verdicts
    shared: dict[str, dict[str, list[float]]] = {}  # iterations while both jobs trained
    done_runs: dict[str, list[SystemRun]] = {}
    exchange: dict[str, str | None] = {}  # how the control plane saw each job reduce
    port = 29820
    with Cluster(topology) as c:
        ctl = controlled(c, workdir, hosts, "h5")

        def both(label: str, system: str, watch: bool = False) -> None:
            nonlocal port
            say(f"{label}: jobs a and b at once")
            started = []
            for job, job_hosts in TWO_JOBS.items():
                port += 1
                sockets = [ctl.sockets[h] for h in job_hosts] if system == "gradlane" else None
                started.append(launch(c, system, args, port=port, out=workdir / label / job,
                                      sockets=sockets, hosts=job_hosts, job=job))
            if watch:  # while they train: the shims' agreed exchange, as the plan sees it
                def told(view: dict[str, Any]) -> bool:
                    exchange.update({j: view["jobs"].get(j, {}).get("exchange") for j in TWO_JOBS})
                    ended = all(p.poll() is not None for job in started for p in job.procs)
                    return None not in exchange.values() or ended

                with contextlib.suppress(TestbedError):  # the jobs' own checks come next
                    ctl.wait_view(told, "both jobs' exchange reported", timeout=300)
            done = [collect(c, s) for s in started]
            done_runs[label] = done
            rank0 = {job: json.loads((workdir / label / job / f"{system}-rank0.json").read_text())
                     for job in TWO_JOBS}
            runs[label] = {job: r["times"] for job, r in rank0.items()}
            shared[label] = _overlapping(rank0)
            # The machine's CPU over the same window (each job's own would take in the
            # other's start-up or end).
            window = _shared_window(rank0)
            for launched, run in zip(started, done, strict=True):
                run.machine_cpu = launched.cpu.over(*window)
            leaves[label] = {job: r.get("leaves") for job, r in rank0.items()}
            trials[label] = {job: r.get("layout_trial") for job, r in rank0.items()}

        if reference:
            both(REFERENCE, REFERENCE)
        if fifo:
            both("fifo", "fifo")
        both("gradlane", "gradlane")
        ctl.start_control("--uplink", TWO_JOB_UPLINK_BPS)
        ctl.wait_view(lambda v: len(v["hosts"]) == len(hosts) and v["plan"]["reduce_in_leaf"],
                      "all 8 daemons and an oversubscribed uplink")
        time.sleep(1)  # the plan's next push reaches every daemon (cadence 0.5 s)
        both("gradlane+control", "gradlane", watch=True)
        codes = ctl.stop_daemons()
    medians = {label: {job: statistics.median(times) for job, times in jobs.items()}
               for label, jobs in shared.items()}
    average = {label: statistics.fmean(m.values()) for label, m in medians.items()}
    # Both jobs' shared iterations pooled: their median is the table's "median iteration".
    pooled = {label: [t for times in jobs.values() for t in times]
              for label, jobs in shared.items()}
    compute, size = trace_totals(TWO_JOB_WORKLOAD)
    extra: dict[str, Any] = {"nominal_lower_bound_s": two_job_bound(compute, size)}
    if reference:  # measured: what both jobs' compute takes on this machine at once
        extra["compute_s"] = statistics.median(pooled[REFERENCE])
    bound = two_job_bound(extra.get("compute_s", compute), size)
    return {
        "scenario": {"name": "two-jobs-oversubscribed", "hosts": 9, "jobs": TWO_JOBS,
                     "host_link": TWO_JOB_HOST_BPS, "uplink": TWO_JOB_UPLINK_BPS,
                     "steps": steps, "workload": TWO_JOB_WORKLOAD, "layout": layout},
        "steady_from_step": steady_start(steps),  # then only where both jobs trained
        "iteration_s": runs,
        "shared_iteration_s": shared,
        "leaves": leaves,  # per run and job: the ranks' leaves if reduced within leaves first
        # per job, whether the control plane's view said it reduces within leaves first
        "control_saw_exchange": exchange,
        "layout_trial": trials,  # per run and job: what the shim's layout trial measured, kept
        "median_s": medians,
        "average_median_s": average,
        "lower_bound_s": bound,
        "summary": summarize(pooled, bound, done_runs),
        "control_speedup": average["gradlane"] / average["gradlane+control"],
        "gradlane_over_fifo": average["fifo"] / average["gradlane+control"] if fifo else None,
        "daemon_exit_codes": codes,
        **extra,
    }
