"""`gradlane sim`: the flow-level simulator's experiments, as JSON and plots.

Three experiments, each one command:

- ``cluster``: 1,024 hosts under 2:1 oversubscribed leaves, 8 jobs mixing
  the shipped profiles; every policy in the same run. Reports `gradlane`
  vs `fifo` average iteration time and `coflow` vs per-flow `fair` average
  coflow completion time. ``--mixed F`` makes a fraction F of the servers
  an older GPU generation (P100 next to V100).
- ``coflows``: the same fabric and jobs in open loop: each job's coflows
  (one iteration's gradient exchange each) arrive as a Poisson process,
  whatever the network does, at a `load` of the busiest link; `coflow` vs
  per-flow `fair` average CCT. Why both: in ``cluster`` a job's next
  coflow waits for its last one, and there no order of coflows can beat
  the CCTs each job would get alone on the fabric (reported as
  ``cct_ceiling``), so ordering pays little there; open-loop arrivals are
  what Varys and Sincronia were built and evaluated for.
- ``heterogeneous``: 4 workers at relative speeds 1, 1, 1, 0.5; reports each
  policy against the ideal (global batch over the sum of throughputs, plus
  the communication time).
- ``validate``: the testbed's trace scenarios (bench/results/*.json) replayed
  in the simulator; simulated vs measured median iteration time per system
  (and per run of the control runs whose owners the plan decides, the slow
  link and ranks sharing hosts: owned bytes even, as the plan weighs them by
  what each host link carries, and within hosts first; and of the two-NIC
  run, each host's NICs as one link at the sum of their rates).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gradlane.benchmark import PAYLOAD_EFFICIENCY, is_bench_result, read_result, reading
from gradlane.daemon.config import DEFAULT_SHAPE_FRACTION
from gradlane.demo import past_warm_up
from gradlane.errors import ConfigError
from gradlane.policies import get_policy
from gradlane.policies.base import DEFAULT_BANDS, Host, Topology
from gradlane.policies.chunks import DEFAULT_CHUNK_BYTES, host_groups, uses_ring
from gradlane.policies.profiles import trace_layers
from gradlane.policies.sim import (
    Scenario,
    SimJob,
    cluster,
    coflow_load,
    heterogeneous,
    one_switch,
    shim_buckets,
    simulate,
)
from gradlane.policies.sim.scenario import BATCH_PER_WORKER
from gradlane.units import parse_rate

__all__ = ["EXPERIMENTS", "figure", "plot", "run_experiment"]

EXPERIMENTS = ("cluster", "coflows", "heterogeneous", "validate")
# The experiments each of `gradlane sim`'s options changes (`run_experiment` refuses it
# given to another).
OPTION_EXPERIMENTS = {
    "--policy": ("cluster", "coflows", "heterogeneous"),
    "--seed": ("cluster", "coflows"),
    "--hosts": ("cluster", "coflows"),
    "--mixed": ("cluster",),
    "--load": ("coflows",),
    "--buckets": ("cluster", "coflows"),
    "--store-forward": ("cluster", "coflows"),
    "--results": ("validate",),
}
CLUSTER_POLICIES = ("fifo", "fair", "priority", "coflow", "loadbalance", "straggler", "gradlane")
# The testbed systems a simulated policy stands for: `fifo` is one band and no
# overlap on the testbed; `gradlane` is the shim plus gradlaned.
VALIDATED = {"fifo": "fifo", "gradlane": "gradlane"}
COFLOW_POLICIES = ("fair", "coflow")
# Open loop: the job whose coflows arrive least often gets about this many.
COFLOWS_OF_RAREST = 24
GROWTH = 1.5  # see `growing_jobs`

Say = Callable[[str], None]
Progress = Callable[[str, float], None]


def _run_policies(
    scenario: Scenario, policies: tuple[str, ...], progress: Progress | None
) -> dict[str, Any]:
    out = {}
    for name in policies:
        policy = get_policy(name)
        report = (lambda f, n=name: progress(n, f)) if progress else None
        out[name] = simulate(scenario, policy, report).to_json()
        if progress:
            progress(name, 1.0)
    return out


def _scenario_json(scenario: Scenario) -> dict[str, Any]:
    return {
        "name": scenario.name,
        "hosts": len(scenario.topology.hosts),
        "leaves": scenario.topology.leaves,
        "iterations": scenario.iterations,
        "warmup": scenario.warmup,
        "replan_s": scenario.replan_s,
        "react_s": scenario.react_s,
        "seed": scenario.seed,
        "jobs": [
            {"name": j.name, "model": j.model, "workers": j.workers,
             "compute_s": j.compute_s, "bytes": j.bytes, "buckets": len(j.buckets),
             "chunk_bytes": j.chunk_bytes, "speeds": list(j.speed)}
            for j in scenario.jobs
        ],
        **scenario.notes,
    }


def _ratio(results: dict[str, Any], slow: str, fast: str, key: str) -> float | None:
    if slow in results and fast in results:
        return float(results[slow][key] / results[fast][key])
    return None


def isolated_cct(scenario: Scenario) -> dict[str, float]:
    """Per job, its mean CCT with the fabric to itself (`fair`; nothing else to share with).

    No order of coflows gives a closed-loop job a shorter CCT than this: ordering only
    decides who waits. `fair`'s mean CCT over these, weighed as that mean weighs the jobs
    (`cct_ceiling`), is the most any coflow order can gain in the run.
    """
    policy = get_policy("fair")
    out = {}
    for job in scenario.jobs:
        alone = simulate(dataclasses.replace(scenario, jobs=(job,)), policy)
        out[job.name] = float(np.mean(alone.cct_s[job.name]))
    return out


def run_cluster(policies: tuple[str, ...], seed: int, hosts: int, mixed: float = 0.0,
                progress: Progress | None = None, buckets: int | None = None,
                store_forward: bool = False) -> dict[str, Any]:
    scenario = cluster(hosts=hosts, seed=seed, slow_fraction=mixed, buckets=buckets,
                       store_forward=store_forward)
    results = _run_policies(scenario, policies, progress)
    out: dict[str, Any] = {
        "experiment": "cluster",
        "scenario": _scenario_json(scenario),
        "results": results,
        "gradlane_vs_fifo_iteration": _ratio(results, "fifo", "gradlane", "mean_iteration_s"),
        "coflow_vs_fair_cct": _ratio(results, "fair", "coflow", "mean_cct_s"),
    }
    if "fair" in results:
        alone = isolated_cct(scenario)
        out["isolated_cct_s"] = alone
        out["cct_ceiling"] = cct_ceiling(results["fair"], alone)
    return out


def cct_ceiling(fair: dict[str, Any], alone: dict[str, float]) -> float:
    """`fair`'s mean CCT over the jobs' CCTs alone, each job weighed by its coflows in
    `fair`'s mean (which is over coflows: a job whose run ended with one fewer counts
    less). Jobs that share no link give exactly 1."""
    counts = {job: len(ccts) for job, ccts in fair["cct_s"].items()}
    best = sum(counts[job] * cct for job, cct in alone.items()) / sum(counts.values())
    return float(fair["mean_cct_s"] / best)


def open_loop(base: Scenario, load: float, seed: int) -> Scenario:
    """`base`'s fabric and jobs with Poisson coflow arrivals instead of training.

    Each job j offers coflows at a rate ``c / T_j``, ``T_j`` its coflow's time alone on
    the fabric, so every job keeps itself a fraction ``c`` busy; ``c`` makes the busiest
    link of the fabric `load` busy on average. Arrivals run until the rarest job has
    had about `COFLOWS_OF_RAREST`.
    """
    if not 0 < load < 1:
        raise ConfigError(f"load must be in (0, 1), got {load}")
    seconds, alone = coflow_load(base)  # (jobs, links), (jobs,)
    rate = 1.0 / alone
    rate *= load / float((seconds * rate[:, None]).sum(axis=0).max())
    horizon = COFLOWS_OF_RAREST / float(rate.min())
    rng = np.random.default_rng(seed)
    arrivals = []
    for r in rate:
        gaps = rng.exponential(1.0 / r, size=int(3 * r * horizon) + 10)
        times = np.cumsum(gaps)
        arrivals.append(tuple(float(t) for t in times[times < horizon]))
    notes = {**base.notes, "load": load, "horizon_s": horizon,
             "arrivals_per_s": {j.name: float(r) for j, r in zip(base.jobs, rate, strict=True)},
             "coflow_alone_s": {j.name: float(t) for j, t in zip(base.jobs, alone, strict=True)}}
    return dataclasses.replace(base, name="coflows", arrivals=tuple(arrivals), warmup=2,
                               notes=notes)


def growing_jobs(cct_s: dict[str, list[float]], factor: float = GROWTH) -> list[str]:
    """Jobs whose later coflows (second half, by arrival) took `factor` x longer on
    average than their earlier ones: their backlog grew through the run, so the
    offered load is more than the policy sustains for them, and their mean CCT
    depends on how long the run is."""
    out = []
    for job, ccts in cct_s.items():
        half = len(ccts) // 2
        if half and np.mean(ccts[half:]) > factor * np.mean(ccts[:half]):
            out.append(job)
    return out


def run_coflows(policies: tuple[str, ...], seed: int, hosts: int, load: float,
                progress: Progress | None = None, buckets: int | None = None,
                store_forward: bool = False) -> dict[str, Any]:
    scenario = open_loop(cluster(hosts=hosts, seed=seed, buckets=buckets,
                                 store_forward=store_forward), load, seed)
    results = _run_policies(scenario, policies, progress)
    for r in results.values():
        r["growing"] = growing_jobs(r["cct_s"])
    return {
        "experiment": "coflows",
        "scenario": {**_scenario_json(scenario),
                     "coflows": {j.name: len(a) for j, a in zip(scenario.jobs, scenario.arrivals,
                                                                strict=True)}},
        "results": results,
        "coflow_vs_fair_cct": _ratio(results, "fair", "coflow", "mean_cct_s"),
    }


def run_heterogeneous(policies: tuple[str, ...], progress: Progress | None = None
                      ) -> dict[str, Any]:
    scenario = heterogeneous()
    (job,) = scenario.jobs
    nic = scenario.topology.hosts[0].nic_bps
    w = job.workers
    # Ideal: the global batch over the summed throughputs, plus the exchange at line rate.
    compute = w * job.compute_s / sum(job.speed)
    comm = 2 * (w - 1) / w * job.bytes * 8 / nic
    ideal = compute + comm
    results = _run_policies(scenario, policies, progress)
    return {
        "experiment": "heterogeneous",
        "scenario": _scenario_json(scenario),
        "ideal_s": ideal,
        "ideal_compute_s": compute,
        "ideal_comm_s": comm,
        "results": results,
        "over_ideal": {p: r["mean_iteration_s"] / ideal for p, r in results.items()},
    }


def rank0_waited(run: dict[str, Any]) -> list[float]:
    """Rank 0's wait for averages per step in a bench run (`rank_steps`; results from
    before it kept the series as ``waited_s``)."""
    if run.get("rank_steps"):
        return list(run["rank_steps"][0].get("waited", []))
    return list(run.get("waited_s") or [])


def measured_compute(result: dict[str, Any], system: str) -> float | None:
    """Median compute per iteration of `system` on the testbed: iteration minus waiting.

    None when the result predates the bench's recording of waiting time.
    """
    import statistics

    samples = []
    for run in result["runs"].get(system, []):
        times, waited = run["iteration_s"], rank0_waited(run)
        if len(waited) != len(times):
            return None
        samples += [t - w for t, w in zip(past_warm_up(times), past_warm_up(waited),
                                          strict=True)]  # the bench's steady steps
    return statistics.median(samples) if samples else None


def testbed_scenario(
    result: dict[str, Any], compute_s: float | None, system: str = "gradlane"
) -> Scenario:
    """A bench result's trace scenario in the simulator as `system` ran it, its compute
    scaled to `compute_s`.

    The layers are grouped and chunked as the shim grouped them (`shim_buckets`,
    with the layout its trial kept) on the system's bands; ``fifo`` is one band and
    no overlap (`gradlane.worker`); ``gradlane``'s links run at gradlaned's shaped rate.
    Chunks are sized by today's rule (`layout_sizes`): on the ring, results measured
    before the ring's chunks were made W-1 times smaller (2026-11-25) had larger ones.
    """
    wl = result["scenario"]["workload"]
    layers = trace_layers(wl["model"], wl["model_mb"], wl["forward_ms"], compute_s)
    hosts = int(result["scenario"]["hosts"])
    # gradlaned (default config on the testbed) shapes every host's egress under the line
    # rate it was told (results from before it was recorded: the link's rate).
    link = result["link_bps"] * PAYLOAD_EFFICIENCY
    if system == "gradlane":
        link = _shaped(result["link_bps"], result.get("daemon_line_bps", result["link_bps"]))
    return _replay(
        result["scenario"]["name"], wl["model"], layers, hosts, link,
        # Results from before the ring (no "exchange" recorded) ran flat.
        result["scenario"].get("exchange", "flat"), layout_kept(result, system),
        bands=1 if system == "fifo" else DEFAULT_BANDS,
        chunk_bytes=result["scenario"].get("chunk_bytes") or DEFAULT_CHUNK_BYTES,
        overlap=system != "fifo",
    )


def _replay(name: str, model: str, layers: list[tuple[float, float, float]], hosts: int,
            link_bps: float, exchange: str, layout: str, *, bands: int = DEFAULT_BANDS,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, overlap: bool = True) -> Scenario:
    """One job of `layers` on `hosts` hosts of one switch at `link_bps`, exchanging as
    `exchange` (`ShimConfig.exchange`), its layers grouped and chunked as the shim's
    `layout` groups them on `bands` bands."""
    scenario = one_switch(name, [(model, layers, [1.0] * hosts)], hosts, link_bps,
                          exchange=exchange, iterations=20, warmup=3)
    buckets, chunk = shim_buckets(layers, hosts, bands=bands, layout=layout,
                                  chunk_bytes=chunk_bytes, ring=scenario.jobs[0].ring)
    # At the testbed's rates a chunk takes tens of ms: stored and forwarded, as the shim
    # does, not fluid (`SimJob.store_forward`).
    job = dataclasses.replace(scenario.jobs[0], buckets=buckets, chunk_bytes=chunk,
                              overlap=overlap, store_forward=True)
    return dataclasses.replace(scenario, jobs=(job,))


def _shaped(link_bps: float, line_bps: float) -> float:
    """The payload rate of a testbed link at `link_bps` whose gradlaned shapes under the
    NIC line rate `line_bps` it was told."""
    return min(link_bps, line_bps * DEFAULT_SHAPE_FRACTION) * PAYLOAD_EFFICIENCY


# The control runs whose owners the plan decides (`gradlane.control_runs.run_planned_owners`)
# that `validate` replays, by scenario name.
OWNERS_RESULTS = ("control-slow-link", "control-co-located")
# Each run: where the result keeps it, the system it shows as, and the policy that plans
# as it ran (`priority`: bands, owned bytes even; `gradlane`: the control plane's, owners
# weighed by what each host link carries). Then the further runs (`OwnersScenario.also`),
# with the control plane.
OWNERS_RUNS = {"without_control": ("gradlane", "priority"),
               "with_control": ("gradlane+control", "gradlane")}


def owners_scenario(result: dict[str, Any], compute_s: float, layout: str,
                    added: Sequence[str] = ()) -> Scenario:
    """A control run of `run_planned_owners` in the simulator: its trace at `compute_s`,
    its ranks placed as it placed them, every host at gradlaned's shaped rate under its
    own NIC, the shim's exchange (the workload's ``--exchange``, or `added`'s, the
    further run's) with `layout`'s groups."""
    from gradlane.control_runs import trace_workload, worker_option

    wl = [*result["scenario"]["workload"], *added]
    layers = trace_layers(*trace_workload(wl), compute_s)
    rates = [parse_rate(r) for r in result["scenario"]["rates"]]
    placement = result["scenario"].get("placement") or [f"h{i + 1}" for i in range(len(rates))]
    names = list(dict.fromkeys(placement))  # each host once, in rank order
    hosts = tuple(names.index(h) for h in placement)
    world = len(hosts)
    exchange = worker_option(wl, "--exchange", "auto")
    shared = host_groups([str(h) for h in hosts], exchange) is not None
    ring = not shared and uses_ring(exchange, world, 1)
    topology = Topology(tuple(Host(name, 0, int(_shaped(rates[i], result["daemon_line_bps"][i])))
                              for i, name in enumerate(names)))
    buckets, chunk = shim_buckets(layers, world, layout=layout, ring=ring)
    job = SimJob("job0-trace", "trace", hosts, buckets, BATCH_PER_WORKER * world,
                 chunk_bytes=chunk, ring=ring, store_forward=True)  # as `_replay`'s
    return Scenario(result["scenario"]["name"], topology, (job,), iterations=20, warmup=3)


def _steady_compute(run: dict[str, Any], first: int) -> float:
    """A control run's compute per iteration: the median, from step `first`, of each
    iteration minus rank 0's wait for averages in it (``waited_s``)."""
    import statistics

    return float(statistics.median(t - w for t, w in zip(
        run["iteration_s"][first:], run["waited_s"][first:], strict=True)))


def _kept(run: dict[str, Any]) -> str:
    """The layout a control run's grouping trial kept ("fine" where none ended)."""
    return str((run.get("layout_trial") or {}).get("chosen") or "fine")


def _owners_rows(measured: dict[str, Any], progress: Progress | None) -> list[dict[str, Any]]:
    """Validation rows of a control run of `run_planned_owners`, one per run (none from
    results made before they recorded the waits)."""
    from gradlane.control_runs import OWNERS_SCENARIOS

    runs: list[tuple[dict[str, Any], str, str, tuple[str, ...]]] = [
        (measured[key], system, policy, ()) for key, (system, policy) in OWNERS_RUNS.items()]
    done = measured.get("also", {})
    runs += [(done[label], label, "gradlane", added)
             for label, added in OWNERS_SCENARIOS[measured["scenario"]["name"]].also
             if label in done]
    rows = []
    first = measured["steady_from_step"]
    for run, system, policy, added in runs:
        if "waited_s" not in run or "daemon_line_bps" not in measured:
            continue
        compute = _steady_compute(run, first)
        rows.append(_validation_row(
            measured, system, policy, owners_scenario(measured, compute, _kept(run), added),
            compute, min(parse_rate(r) for r in measured["scenario"]["rates"]), progress))
    return rows


def _validation_row(measured: dict[str, Any], system: str, policy: str, scenario: Scenario,
                    compute_s: float | None, link_bps: float, progress: Progress | None,
                    real: float | None = None) -> dict[str, Any]:
    """`system`'s measured median (`real`, default the result's summary's) against
    `scenario` simulated under `policy`."""
    sim = _run_policies(scenario, (policy,), progress)[policy]["mean_iteration_s"]
    real = measured["summary"][system]["median_s"] if real is None else real
    return {
        "scenario": measured["scenario"]["name"], "system": system,
        "measured_s": real, "simulated_s": sim, "error": sim / real - 1,
        "compute_s": compute_s if compute_s is not None else "nominal",
        "link_bps": link_bps,
        "measured_commit": measured["environment"]["commit"],
    }


def two_nics_scenario(result: dict[str, Any], run: dict[str, Any], compute_s: float
                      ) -> Scenario:
    """A run of `gradlane.nic_runs.run_two_nics` in the simulator: its trace at
    `compute_s`, each host's NICs as one link at the sum of gradlaned's shaped rates
    (the shims spread each owner's chunks over them by those rates)."""
    from gradlane.control_runs import trace_workload

    layers = trace_layers(*trace_workload(result["scenario"]["workload"]), compute_s)
    rate = parse_rate(result["scenario"]["rate"])
    link = sum(_shaped(rate, line) for line in run["daemon_line_bps"])
    return _replay(result["scenario"]["name"], "trace", layers, int(result["scenario"]["hosts"]),
                   link, "auto", _kept(run))


def _two_nics_rows(measured: dict[str, Any], progress: Progress | None
                   ) -> list[dict[str, Any]]:
    """Validation rows of a two-NIC run, one per run (none from results made before they
    recorded the waits)."""
    rows = []
    first = measured["steady_from_step"]
    runs = [(label, run) for label, run in measured["runs"].items()]
    if "uneven" in measured:
        runs.append((measured["uneven"]["label"], measured["uneven"]))
    for label, run in runs:
        if not run.get("waited_s") or "daemon_line_bps" not in run:
            continue
        compute = _steady_compute(run, first)
        scenario = two_nics_scenario(measured, run, compute)
        rows.append(_validation_row(measured, label, "gradlane", scenario, compute,
                                    scenario.topology.hosts[0].nic_bps, progress,
                                    real=run["median_s"]))
    return rows


def layout_kept(result: dict[str, Any], system: str) -> str:
    """The shim's layout in `system`'s runs of a bench result: the scenario's, or what most
    runs' grouping trials kept ("fine" on a tie, or where no trial ended)."""
    pinned = result["scenario"].get("layout", "auto")
    if pinned != "auto":
        return str(pinned)
    runs = result.get("runs", {}).get(system, [])
    kept = [(run.get("layout_trial") or {}).get("chosen") for run in runs]
    return "coarse" if kept.count("coarse") > len(kept) / 2 else "fine"


def _rows_of(measured: dict[str, Any], progress: Progress | None) -> list[dict[str, Any]]:
    """The validation rows of one testbed result (none for a result that replays no trace)."""
    scenario = measured.get("scenario")
    wl = scenario.get("workload") if isinstance(scenario, dict) else None
    if isinstance(scenario, dict) and scenario.get("name") in OWNERS_RESULTS:
        return _owners_rows(measured, progress)
    if isinstance(scenario, dict) and scenario.get("name") == "two-nics":
        return _two_nics_rows(measured, progress)
    # `gradlane bench` scenarios (the other control runs replay no single trace).
    if not isinstance(wl, dict) or wl.get("kind") != "trace" or not is_bench_result(measured):
        return []
    rows = []
    for policy, system in VALIDATED.items():
        if system not in measured["summary"]:
            continue
        compute = measured_compute(measured, system)
        rows.append(_validation_row(
            measured, system, policy, testbed_scenario(measured, compute, system), compute,
            measured["link_bps"], progress))
    return rows


def run_validate(results_dir: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Replay every trace scenario measured on the testbed; compare medians.

    The simulator models the network, not Python: each system is replayed
    with the compute time the testbed measured for it (iteration minus the
    time rank 0 waited for gradients), so the comparison checks what the
    network model predicts on top of it.
    """
    rows = []
    for path in sorted(results_dir.glob("*.json")):
        measured = read_result(path)
        rows += reading(path, functools.partial(_rows_of, measured, progress))
    if not rows:
        raise ConfigError(f"no trace-scenario results in {results_dir}")
    return {
        "experiment": "validate",
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows),
    }


def run_experiment(name: str, policies: tuple[str, ...] | None = None, seed: int = 0,
                   hosts: int = 1024, results_dir: Path = Path("bench/results"),
                   mixed: float = 0.0, progress: Progress | None = None,
                   load: float = 0.8, buckets: int | None = None,
                   store_forward: bool = False) -> dict[str, Any]:
    """Run experiment `name` (one of `EXPERIMENTS`); `buckets`: the cluster's jobs cut
    into about that many DDP-like buckets instead of the shim's groups;
    `store_forward`: its chunks' trees a stage after the other
    (`gradlane.policies.sim.SimJob.store_forward`; the testbed replays always are)."""
    if buckets is not None and buckets < 1:
        raise ConfigError(f"buckets must be >= 1, got {buckets}")
    # An option the experiment would ignore is refused: whoever gave it meant another.
    given = {"--policy": policies is not None, "--seed": seed != 0, "--hosts": hosts != 1024,
             "--mixed": mixed != 0.0, "--load": load != 0.8, "--buckets": buckets is not None,
             "--store-forward": store_forward,
             "--results": results_dir != Path("bench/results")}
    for option, was_given in given.items():
        if was_given and name in EXPERIMENTS and name not in OPTION_EXPERIMENTS[option]:
            where = " and ".join(repr(e) for e in OPTION_EXPERIMENTS[option])
            raise ConfigError(f"{option} applies to {where}, not {name!r}")
    if name == "cluster":
        return run_cluster(policies or CLUSTER_POLICIES, seed, hosts, mixed, progress, buckets,
                           store_forward)
    if name == "coflows":
        return run_coflows(policies or COFLOW_POLICIES, seed, hosts, load, progress, buckets,
                           store_forward)
    if name == "heterogeneous":
        return run_heterogeneous(policies or ("fifo", "priority", "straggler", "gradlane"),
                                 progress)
    if name == "validate":
        return run_validate(results_dir, progress)
    raise ConfigError(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Per policy: iteration times (and coflow completion times) per job, or sim vs measured."""
    fig = figure(result)  # picks the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(result: dict[str, Any]) -> Any:
    """`plot`'s figure (a matplotlib Figure), not yet saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if result["experiment"] == "validate":
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['scenario']}\n{r['system']}" for r in result["rows"]]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [r["measured_s"] * 1000 for r in result["rows"]], 0.4,
               label="testbed (median)")
        ax.bar([i + 0.2 for i in x], [r["simulated_s"] * 1000 for r in result["rows"]], 0.4,
               label="simulator")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("iteration time (ms)")
        ax.legend()
    elif result["experiment"] == "coflows":  # nothing iterates: CCTs per job, and their CDF
        res = result["results"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        jobs = list(next(iter(res.values()))["cct_s"])
        width = 0.8 / len(res)
        for i, (name, r) in enumerate(res.items()):
            means = [float(np.mean(r["cct_s"][j])) * 1000 if r["cct_s"][j] else 0.0
                     for j in jobs]
            axes[0].bar([k + i * width for k in range(len(jobs))], means, width, label=name)
            ccts = np.sort([x * 1000 for v in r["cct_s"].values() for x in v])
            axes[1].plot(ccts, np.arange(1, len(ccts) + 1) / max(1, len(ccts)), label=name)
        axes[0].set_xticks([k + 0.4 - width / 2 for k in range(len(jobs))], jobs, fontsize=7,
                           rotation=30)
        axes[0].set_ylabel("mean coflow completion time (ms)")
        axes[1].set_xscale("log")
        axes[1].set_xlabel("coflow completion time (ms)")
        axes[1].set_ylabel("fraction of coflows")
        for ax in axes:
            ax.legend()
        fig.suptitle(f"gradlane sim: coflows, open loop at load {result['scenario']['load']}")
    else:
        res = result["results"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, title in ((axes[0], "iteration_s", "iteration time"),
                               (axes[1], "cct_s", "coflow completion time")):
            data = [[x * 1000 for v in r[key].values() for x in v] for r in res.values()]
            ax.boxplot(data, tick_labels=list(res))
            ax.set_ylabel(f"{title} (ms)")
            ax.tick_params(axis="x", labelrotation=30)
        if result["experiment"] == "heterogeneous":
            axes[0].axhline(result["ideal_s"] * 1000, color="grey", ls="--", label="ideal")
            axes[0].legend()
        fig.suptitle(f"gradlane sim: {result['experiment']}")
    fig.tight_layout()
    return fig
