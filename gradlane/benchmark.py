"""`gradlane bench`: every compared system, measured in the same run, against the physical bound.

A scenario is a TOML file (see ``bench/scenarios/``)::

    name = "trace-vgg19"
    description = "VGG-19 trace, communication about equal to compute"
    hosts = 4
    steps = 40             # per run; warm-up dropped (`gradlane.demo.steady_start`)
    rounds = 2             # the systems run in turn, this many times each
    systems = ["ddp", "fifo", "priority", "gradlane"]
    comm_to_compute = 1.0  # link rate: one iteration's traffic takes this x compute
    layout = "auto"        # the shim's gradient grouping: auto, fine or coarse
    chunk_bytes = 1048576  # optional: `ShimConfig.chunk_bytes` (default: the shim's)
    credit_bytes = 131072  # optional: `ShimConfig.credit_bytes` (default: the shim's)
    exchange = "auto"      # gradlane's chunk paths: auto, flat or ring (`ShimConfig.exchange`)
    [workload]
    kind = "trace"         # or "cnn"
    model = "vgg19"        # a shipped profile (trace)
    model_mb = 10          # its scaled size (trace)
    forward_ms = 50        # forward time; backward is twice that (trace)

Systems are those of `gradlane.worker`. One emulated cluster serves the whole
scenario; gradlaned runs on every host from the first run that uses it
(``gradlane``, ``ddp-hook``) on, and only those runs connect to it.

The lower bound of an iteration (homogeneous workers) is
``max(compute, traffic / link payload rate)``: every worker must compute the
whole iteration, and must send ``2 (W-1)/W`` model sizes over its own link
(the all-reduce minimum, which both ring all-reduce and reduce-scatter +
all-gather reach), at most at ``rate x 1448/1514`` (full TCP frames).

That bound ignores the order of the layers, and no schedule can: for a
trace, ``dependency_bound_s`` also holds it. Cut the model after any layer k.
The gradients of the layers before the cut are made only once backward has
gone back past the cut, and the next forward needs them all before it gets
past the cut; in between run the forward and the backward of the layers
after it. So, per iteration,
``traffic(layers before k) / payload rate + compute(layers from k on)``,
for every k, of which the largest is the bound (k = 0 and k = all give
the two terms above). It is the simple bound for ResNet-50 and VGG-19; for
BERT-base it is larger, by the masked-LM decoder, a fifth of the FLOPs and
no parameters of its own (tied to the word embeddings): while it computes,
forward and backward, nothing is left to send and nothing new to send yet.
Per-layer compute is the trace's, scaled to the measured total (below).

Compute is *measured*, in the same run: every round first runs the
``local`` reference (`gradlane.worker`: the same workload on every host at
once, nothing exchanged), and its median iteration is the bound's compute.
That is the compute this machine delivers, CPU contention of the workers
and the replay's own costs included (autograd, the optimizer, copies). A
trace's per-layer sleeps run on an emulated accelerator
(`gradlane.workloads`): a sleep that wakes late is made up by the next, so
the lateness of a few hundred sleeps on a busy 2-core machine does not add
up, in any system.
The nominal compute (the trace's sleeps; for ``cnn`` a one-thread
calibration) and the bound made with it are recorded next to it
(``nominal_compute_s``, ``nominal_lower_bound_s``). Every result reports
achieved / bound.

Each worker's CPU use over its training loop (cores, all threads, and how
much of it in the kernel: sending and receiving) is recorded per run and
averaged per system: a worker near 1.0, or workers summing to more than the
machine's cores, are CPU-bound, whatever the network does. So is the whole
machine's (`gradlane.demo.MachineCpu`) over each run's steady steps:
``machine_cpu`` per run, ``machine_busy_mean`` per system. Near 1, every
core was busy (workers, daemons, the kernel's networking in softirq) and
waiting for a core, not for the network, stretched the iterations. The
machine can be half idle on average and still be short of cores at the
moments that matter; so each worker also records how long per step its
training thread was ready to run but had no core (``run_queue_s_per_step``,
from Linux schedstats): the CPU bottleneck on the critical path.

A wait for averages in the next forward (the shim's exposed communication)
is not all the network's either: no average exists before the slowest
worker's backward has ended. Each worker records when its steps and its
backwards ended, on the clock all namespaces share, and how long each
forward waited (``rank_steps`` per run). The bench takes from the wait the
part the slowest worker's own work held back: its compute, or its wait for
a core, ran longer (``exposed_s``, ``slowest_compute_s`` per run,
`gradlane.demo.waits_for_slowest`). The rest is the exchange's, including
a worker's lateness from its own longer wait for the step before's averages.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gradlane.demo import mean_or_none, past_warm_up, run_timeout, steady_start
from gradlane.errors import ConfigError, GradlaneError
from gradlane.policies.chunks import EXCHANGE_OPTIONS as EXCHANGES
from gradlane.policies.chunks import LAYOUTS, OPTION_BYTES
from gradlane.policies.profiles import trace_layers as profile_layers
from gradlane.policies.profiles import trace_totals
from gradlane.systems import DAEMON_SYSTEMS, REFERENCE, SYSTEMS
from gradlane.testbed.links import FRAME_BYTES, line_rate

T = TypeVar("T")

if TYPE_CHECKING:
    from gradlane.demo import SystemRun

__all__ = [
    "CELL_NAMES", "Scenario", "available_memory", "cells", "check_memory", "dependency_bound",
    "exchange_bits", "is_bench_result",
    "load_scenario", "lower_bound", "narrowed", "read_result", "reading", "run_scenario",
    "summarize", "trace_layers", "waits_cell", "worker_args",
]

PAYLOAD_EFFICIENCY = 1448 / FRAME_BYTES


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    hosts: int
    steps: int
    rounds: int
    systems: tuple[str, ...]
    comm_to_compute: float
    workload: dict[str, Any] = field(default_factory=dict)
    layout: str = "auto"  # `ShimConfig.layout` of the systems on gradlane's transport
    chunk_bytes: int | None = None  # `ShimConfig.chunk_bytes` of those systems; None: default
    credit_bytes: int | None = None  # `ShimConfig.credit_bytes` of those systems; None: default
    exchange: str = "auto"  # `ShimConfig.exchange` of the gradlane system


# A scenario's [workload] table, per kind: the real CNN, or a model's trace replayed.
WORKLOAD_KEYS = {"cnn": {"kind"}, "trace": {"kind", "model", "model_mb", "forward_ms"}}


# What a scenario key must be, in TOML's words.
_TOML_KINDS: dict[Any, str] = {dict: "a table", list: "a list", str: "a string",
                               int: "a whole number", int | float: "a number"}


def load_scenario(path: Path) -> Scenario:
    """Read and check a scenario file.

    Raises:
        ConfigError: unreadable, or a key is missing, unknown or out of range (named).
    """
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc

    def get(key: str, kind: Any, default: Any = None) -> Any:
        value = raw.get(key, default)
        if value is None or not isinstance(value, kind) or isinstance(value, bool):
            found = "missing" if value is None else f"got {value!r}"
            raise ConfigError(f"{path}: {key} must be {_TOML_KINDS[kind]}, {found}")
        return value

    # A misspelt key would otherwise run the whole benchmark on its default.
    known = {f.name for f in fields(Scenario)}
    if extra := sorted(set(raw) - known):
        raise ConfigError(f"{path}: unknown keys {extra} (known: {', '.join(sorted(known))})")
    workload = get("workload", dict)
    kind = workload.get("kind")
    if kind not in WORKLOAD_KEYS:
        raise ConfigError(f"{path}: workload.kind must be 'cnn' or 'trace'")
    if extra := sorted(set(workload) - WORKLOAD_KEYS[kind]):
        raise ConfigError(f"{path}: unknown workload keys {extra} for kind {kind!r} "
                          f"(known: {', '.join(sorted(WORKLOAD_KEYS[kind]))})")
    if kind == "trace":
        from gradlane.policies.profiles import NAMES

        if workload.get("model") not in NAMES:
            raise ConfigError(f"{path}: workload.model must be one of {', '.join(NAMES)}")
        for key in ("model_mb", "forward_ms"):
            if not isinstance(workload.get(key), int | float) or workload[key] <= 0:
                raise ConfigError(f"{path}: workload.{key} must be a positive number")
    systems = tuple(get("systems", list, list(SYSTEMS)))
    if not systems or any(s not in SYSTEMS for s in systems) or len(set(systems)) < len(systems):
        raise ConfigError(f"{path}: systems must be a list drawn from {', '.join(SYSTEMS)}, "
                          "each once")
    scenario = Scenario(
        name=get("name", str),
        description=get("description", str, ""),
        hosts=get("hosts", int, 4),
        steps=get("steps", int, 30),
        rounds=get("rounds", int, 2),
        systems=systems,
        comm_to_compute=float(get("comm_to_compute", int | float, 1.0)),
        workload=dict(workload),
        layout=get("layout", str, "auto"),
        chunk_bytes=get("chunk_bytes", int) if "chunk_bytes" in raw else None,
        credit_bytes=get("credit_bytes", int) if "credit_bytes" in raw else None,
        exchange=get("exchange", str, "auto"),
    )
    if scenario.layout not in LAYOUTS:
        raise ConfigError(f"{path}: layout must be one of {', '.join(LAYOUTS)}")
    if scenario.exchange not in EXCHANGES:
        raise ConfigError(f"{path}: exchange must be one of {', '.join(EXCHANGES)}")
    if not 2 <= scenario.hosts <= 8 or scenario.steps < 10 or scenario.rounds < 1:
        raise ConfigError(f"{path}: need hosts 2..8, steps >= 10, rounds >= 1")
    if not scenario.comm_to_compute > 0:
        raise ConfigError(f"{path}: comm_to_compute must be positive")
    for key in ("chunk_bytes", "credit_bytes"):  # the shim's ranges, before any cluster
        least, most = OPTION_BYTES[key]
        value = getattr(scenario, key)
        if value is not None and not least <= value <= most:
            raise ConfigError(f"{path}: {key} must be {least}..{most}")
    return scenario


def narrowed(
    scenario: Scenario, systems: Sequence[str] = (), rounds: int | None = None
) -> Scenario:
    """`scenario` with only `systems` (in the scenario's order) and `rounds` rounds.

    For quick comparisons (one system, one round) without editing the file;
    `local`, the bound's compute, runs every round whatever the systems.

    Raises:
        ConfigError: a system the scenario does not compare, or rounds < 1.
    """
    unknown = [s for s in systems if s not in scenario.systems]
    if unknown:
        raise ConfigError(f"{scenario.name} compares {', '.join(scenario.systems)}; "
                          f"not {', '.join(unknown)}")
    if rounds is not None and rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    return replace(
        scenario,
        systems=tuple(s for s in scenario.systems if s in systems) if systems else scenario.systems,
        rounds=scenario.rounds if rounds is None else rounds,
    )


def worker_args(scenario: Scenario) -> list[str]:
    """`gradlane.worker` options of the scenario's workload, layout, chunks and credit (every
    system)."""
    w = scenario.workload
    args = ["--layout", scenario.layout, "--exchange", scenario.exchange, "--workload", w["kind"]]
    if scenario.chunk_bytes is not None:
        args += ["--chunk-bytes", str(scenario.chunk_bytes)]
    if scenario.credit_bytes is not None:
        args += ["--credit-bytes", str(scenario.credit_bytes)]
    if w["kind"] == "trace":
        args += ["--model", w["model"], "--model-mb", str(w["model_mb"]),
                 "--forward-ms", str(w["forward_ms"])]
    return args


def compute_and_bytes(scenario: Scenario) -> tuple[float, int]:
    """Compute seconds per iteration (per worker) and the model's bytes."""
    w = scenario.workload
    if w["kind"] == "cnn":
        from gradlane.demo import calibrate

        return calibrate(scenario.hosts)
    return trace_totals(w["model"], w["model_mb"], w["forward_ms"])


# A worker's memory (peak RSS of `gradlane.worker` on VGG-19 traces): 343 MB with a 10 MB
# model and no exchange; 1.9 GB with a 200 MB model under gradlane (the parameters, their
# gradients, the momentum, the exchange's buffers and partial sums): about 8 copies.
WORKER_BASE_BYTES = 350 << 20
MODEL_COPIES = 8


def available_memory() -> int | None:
    """Bytes this machine has available (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(scenario: Scenario, model_bytes: int, available: int | None) -> None:
    """Refuse a scenario whose workers would not fit in `available` bytes: the kernel's
    out-of-memory killer would end a worker (or another process of the machine) instead.

    Raises:
        ConfigError: saying what it needs against what there is.
    """
    needed = scenario.hosts * (MODEL_COPIES * model_bytes + WORKER_BASE_BYTES)
    if available is not None and needed > available:
        raise ConfigError(
            f"{scenario.name}: its {scenario.hosts} workers need about {needed / 2**30:.1f} "
            f"GiB (a {model_bytes / 1e6:.0f} MB model about {MODEL_COPIES} times over, each), "
            f"more than the {available / 2**30:.1f} GiB this machine has available: lower "
            "workload.model_mb or hosts")


def exchange_bits(hosts: int, model_bytes: float) -> float:
    """The bits a worker's link carries each way per iteration at the all-reduce minimum
    (``2 (W-1)/W`` model sizes), in full TCP frames."""
    return 2 * (hosts - 1) / hosts * model_bytes * 8 / PAYLOAD_EFFICIENCY


def lower_bound(hosts: int, compute_s: float, model_bytes: int, rate_bps: float) -> float:
    """The physical lower bound of one iteration (see the module docstring)."""
    return max(compute_s, exchange_bits(hosts, model_bytes) / rate_bps)


def dependency_bound(hosts: int, layers: list[tuple[int, float]], rate_bps: float) -> float:
    """The lower bound with the layers' order (see the module docstring).

    `layers`: each layer's parameter bytes and compute seconds (forward and
    backward), in forward order.
    """
    per_byte = exchange_bits(hosts, 1) / rate_bps
    after = sum(compute for _, compute in layers)  # compute of the layers past the cut
    before = 0  # bytes of the layers before it
    bound = after
    for nbytes, compute in layers:
        before += nbytes
        after -= compute
        bound = max(bound, before * per_byte + after)
    return bound


def trace_layers(scenario: Scenario, compute_s: float) -> list[tuple[int, float]] | None:
    """A trace scenario's layers for `dependency_bound`, compute scaled to sum to `compute_s`.

    None for other workloads (a real model's per-layer compute is not known here).
    """
    w = scenario.workload
    if w["kind"] != "trace":
        return None
    return [(int(n), f + b) for n, f, b in
            profile_layers(w["model"], w["model_mb"], w["forward_ms"], compute_s)]


def summarize(steady: dict[str, list[float]], bound_s: float,
              runs: dict[str, list[SystemRun]] | None = None,
              dependency_bound_s: float | None = None) -> dict[str, dict[str, Any]]:
    """Per system, from its steady-state iteration times (warm-up already dropped): median,
    p90, achieved / bound (and / the dependency bound when given), the speedup over
    ``ddp`` when it ran, and from its `runs` the mean worker CPU, of it in the kernel and
    on the training thread, the machine's mean busy share, the training threads' mean
    wait for a core and, on the shim, the mean wait for averages per step and how much of
    it the slowest worker's own work held back (`gradlane.demo.waits_for_slowest`), over
    each run's steady steps."""
    summary: dict[str, dict[str, Any]] = {}
    for system, times in steady.items():
        ordered = sorted(times)
        median = statistics.median(ordered)
        mine = (runs or {}).get(system) or []
        exposed: list[float] = []
        slowest: list[float] = []
        for r in mine:
            steady_exposed, steady_slowest = r.steady_waits
            exposed += steady_exposed
            slowest += steady_slowest
        summary[system] = {
            "median_s": median,
            "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "achieved_over_bound": median / bound_s,
            "worker_cpu_cores_mean": mean_or_none([c for r in mine for c in r.cpu_cores]),
            "worker_cpu_sys_cores_mean": mean_or_none([c for r in mine for c in r.cpu_sys_cores]),
            "worker_cpu_train_cores_mean": mean_or_none(
                [c for r in mine for c in r.cpu_train_cores]),
            "machine_busy_mean": mean_or_none([r.machine_cpu["busy"] for r in mine
                                               if r.machine_cpu]),
            "run_queue_s_mean": mean_or_none([q for r in mine for q in r.run_queue_s]),
            "exposed_s_mean": mean_or_none(exposed),
            "slowest_compute_s_mean": mean_or_none(slowest),
        }
        if dependency_bound_s is not None:
            summary[system]["achieved_over_dependency_bound"] = median / dependency_bound_s
    if "ddp" in summary:
        ddp = summary["ddp"]["median_s"]
        for system, s in summary.items():
            if system != REFERENCE:  # a reference, not a contender
                s["speedup_over_ddp"] = ddp / s["median_s"]
    return summary


def run_scenario(scenario: Scenario, say: Callable[[str], None],
                 keep_partial: Callable[[dict[str, Any]], None] | None = None
                 ) -> dict[str, Any]:
    """Run every system `rounds` times in one cluster; the result as JSON-ready data.

    A run that stops early (a system fails, Ctrl-C, SIGTERM) once some
    systems' runs are done hands those to `keep_partial` (`partial_result`),
    with the cluster already removed, before its error goes on.
    """
    compute, size = compute_and_bytes(scenario)
    check_memory(scenario, size, available_memory())
    rate = int(exchange_bits(scenario.hosts, size) / (compute * scenario.comm_to_compute))
    nominal = lower_bound(scenario.hosts, compute, size, rate)
    say(
        f"{scenario.name}: {scenario.hosts} hosts at {rate / 1e6:.0f} Mbit/s, nominal compute "
        f"{compute * 1000:.0f} ms, model {size / 1e6:.2f} MB, nominal bound {nominal * 1000:.0f} ms"
    )
    systems = (REFERENCE, *scenario.systems)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    done: dict[str, list[SystemRun]] = {s: [] for s in systems}
    # A system's step at worst: the compute, then the whole exchange.
    timeout = run_timeout(scenario.steps, compute * (1 + scenario.comm_to_compute))
    try:
        _run_rounds(scenario, rate, timeout, say, runs, done)
    except BaseException as exc:
        if keep_partial is not None and any(runs.values()):
            try:
                keep_partial(partial_result(scenario, rate, runs, exc))
            except Exception as failed:  # the run's own error is the one to report
                exc.add_note(f"the runs measured before it were not kept: {failed}")
        raise
    # Each round's warm-up dropped on its own, then all rounds pooled.
    steady = {s: [t for run in rs for t in past_warm_up(run["iteration_s"])]
              for s, rs in runs.items()}
    measured = statistics.median(steady[REFERENCE])
    bound = lower_bound(scenario.hosts, measured, size, rate)
    layers = trace_layers(scenario, measured)
    ordered = dependency_bound(scenario.hosts, layers, rate) if layers else None
    summary = summarize(steady, bound, done, ordered)
    say(f"compute alone ({REFERENCE}): {measured * 1000:.1f} ms; bound {bound * 1000:.1f} ms"
        + (f", with the layers' order {ordered * 1000:.1f} ms" if ordered else ""))
    return {
        "scenario": _scenario_record(scenario),
        "link_bps": rate,
        # The line rate gradlaned was told (it shapes under it): the NIC the link emulates.
        "daemon_line_bps": line_rate(rate),
        "compute_s": measured,
        "nominal_compute_s": compute,
        "model_bytes": size,
        "lower_bound_s": bound,
        "nominal_lower_bound_s": nominal,
        "dependency_bound_s": ordered,
        # The medians, the waits and the machine's CPU are over each run's steps from this
        # one on (`gradlane.demo.steady_start`: past the shim's layout trial).
        "steady_from_step": steady_start(scenario.steps),
        "summary": summary,
        "runs": runs,
    }


def _run_rounds(scenario: Scenario, rate: int, timeout: float, say: Callable[[str], None],
                runs: dict[str, list[dict[str, Any]]], done: dict[str, list[SystemRun]]
                ) -> None:
    """Every system `rounds` times in one cluster, at `rate`; each run, once complete,
    added to `done` and its raw data to `runs`; one longer than `timeout` s is hung."""
    from gradlane.demo import run_on_cluster
    from gradlane.testbed import Cluster, Topology

    port = 29700
    with (
        tempfile.TemporaryDirectory(prefix="gradlane-bench-") as tmp,
        Cluster(Topology.build("bench", scenario.hosts, rate)) as c,
    ):
        out = Path(tmp)
        out.chmod(0o755)
        sockets: list[Path] | None = None
        for r in range(scenario.rounds):
            for system in runs:
                if system in DAEMON_SYSTEMS and sockets is None:
                    daemons = c.start_daemons(range(1, scenario.hosts + 1), out)
                    sockets = [sock for _, sock in daemons.values()]
                port += 1
                started = time.monotonic()
                run, _ = run_on_cluster(
                    c,
                    system,
                    ["--steps", str(scenario.steps), *worker_args(scenario)],
                    port=port,
                    out=out,
                    sockets=sockets if system in DAEMON_SYSTEMS else None,
                    timeout=timeout,
                )
                median = statistics.median(run.steady)
                say(
                    f"round {r + 1}/{scenario.rounds} {system}: median {median * 1000:.1f} ms "
                    f"({time.monotonic() - started:.0f} s)"
                )
                done[system].append(run)
                runs[system].append(_run_record(run))


def _run_record(run: SystemRun) -> dict[str, Any]:
    """A run's raw data, as a result's ``runs`` holds it."""
    return {
        "iteration_s": run.times,
        "losses": run.losses,
        "wire_bytes": run.wire_bytes,
        "utilization": run.utilization,
        "cpu_cores_per_rank": run.cpu_cores,
        "cpu_sys_cores_per_rank": run.cpu_sys_cores,
        "cpu_train_cores_per_rank": run.cpu_train_cores,
        # Per rank: the training thread's wait for a core, per step.
        "run_queue_s_per_step": run.run_queue_s,
        "machine_cpu": run.machine_cpu,
        # Per step, the ranks' mean wait for averages and, of it, what the slowest rank's
        # own work held back (shim systems), and per rank the series they come from
        # (`gradlane.demo.waits_for_slowest`; 0 for ddp, which cannot say): rank 0's
        # iteration - waited is the compute the simulator replays
        # (`simulation.rank0_waited`).
        "exposed_s": run.exposed,
        "slowest_compute_s": run.slowest,
        "rank_steps": run.rank_steps,
        # The shim's grouping trial: each layout's median iteration, the one kept
        # (`ShimConfig.layout`).
        "layout_trial": run.layout_trial,
    }


def _scenario_record(scenario: Scenario) -> dict[str, Any]:
    return {**scenario.__dict__, "systems": list(scenario.systems)}


def partial_result(scenario: Scenario, rate_bps: int, runs: dict[str, list[dict[str, Any]]],
                   stopped: BaseException) -> dict[str, Any]:
    """What a run that stopped early had measured: the raw data of each system's completed
    runs, as a full result's ``runs`` holds them, and why it stopped. No summary: the
    bound's compute and the comparisons need every system's runs of a round."""
    return {
        "scenario": _scenario_record(scenario),
        "link_bps": rate_bps,
        "complete": False,
        "stopped_by": stopped_by(stopped),
        "runs": {system: rs for system, rs in runs.items() if rs},
    }


def stopped_by(exc: BaseException) -> str:
    """Why a run stopped, in words: Ctrl-C, a signal (SIGTERM and hang-ups unwind as
    `SystemExit(128 + signal)`: `gradlane.signals`), or the error."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        with contextlib.suppress(ValueError):
            return f"stopped by {signal.Signals(exc.code - 128).name}"
    return f"{type(exc).__name__}: {exc}"[:2000]


def is_partial(result: dict[str, Any]) -> bool:
    """Whether `result` is what a run that stopped early kept (`partial_result`)."""
    return result.get("complete") is False


def cells(s: dict[str, Any]) -> list[str]:
    """One system's summary as table cells: vs DDP, achieved / bound, achieved / the
    dependency bound, worker CPU (`cpu_cell`), the machine's busy share, the training
    thread's wait for a core per step, the wait for averages per step (of it what the
    slowest worker's own work held back) ("-" where not measured)."""
    queued = s.get("run_queue_s_mean")
    busy = s.get("machine_busy_mean")
    ordered = s.get("achieved_over_dependency_bound")
    exposed = s.get("exposed_s_mean")
    slowest = s.get("slowest_compute_s_mean")
    return [
        f"{s['speedup_over_ddp']:.2f}x" if "speedup_over_ddp" in s else "-",
        f"{s['achieved_over_bound']:.2f}",
        f"{ordered:.2f}" if ordered is not None else "-",
        cpu_cell(s.get("worker_cpu_cores_mean"), s.get("worker_cpu_sys_cores_mean"),
                 s.get("worker_cpu_train_cores_mean")),
        f"{busy:.0%}" if busy is not None else "-",
        f"{queued * 1000:.1f} ms" if queued is not None else "-",
        waits_cell(exposed, slowest),
    ]


def cpu_cell(cores: float | None, kernel: float | None = None,
             train: float | None = None) -> str:
    """A worker's CPU, and of it what the kernel and the threads other than the training
    thread (the exchange's: the shim's transport, gloo's) used ("-" if not measured)."""
    if cores is None:
        return "-"
    parts = ([] if kernel is None else [f"{kernel:.2f} kernel"]) + (
        [] if train is None else [f"{cores - train:.2f} other threads"])
    return f"{cores:.2f} cores" + (f" ({', '.join(parts)})" if parts else "")


def waits_cell(exposed_s: float | None, slowest_s: float | None) -> str:
    """The mean wait for averages per step, and of it what the slowest worker held back."""
    if exposed_s is None:
        return "-"
    return f"{exposed_s * 1000:.1f} ms" + (
        "" if slowest_s is None else f" ({slowest_s * 1000:.1f} slowest)")


CELL_NAMES = ["vs DDP", "achieved / bound", "/ dependency bound", "worker CPU", "machine busy",
              "waiting for a core", "waiting for averages"]


def read_result(path: Path) -> dict[str, Any]:
    """A results file's JSON.

    Raises:
        ConfigError: unreadable, or not a JSON object.
    """
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a results file: {exc}") from None
    if not isinstance(result, dict):
        raise ConfigError(f"{path}: not a results file: a JSON {type(result).__name__}")
    return result


def reading(path: Path, use: Callable[[], T]) -> T:
    """`use()` of what `path` holds, a results file: a field of the wrong kind (the file
    edited by hand, cut short, another program's) is an error naming the file.

    Raises:
        ConfigError: `use` met a field it cannot read. gradlane's own errors (a
            ConfigError is a ValueError too) go up as they are: they say why already.
    """
    try:
        return use()
    except GradlaneError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ConfigError(
            f"{path}: not a results file gradlane can read ({type(exc).__name__}: {exc}); "
            "was it edited, or written by another program?") from None


def is_bench_result(result: dict[str, Any]) -> bool:
    """Whether `result` holds per-system results against a lower bound (what
    `gradlane bench run` and the control plane's benchmarks write), not the
    simulator's or a micro-benchmark's."""
    return "summary" in result and "lower_bound_s" in result


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The README's results table, from result files (never typed by hand).

    Files without per-system results against a lower bound (``summary`` and
    ``lower_bound_s``: the simulator's, the daemon's micro-benchmarks) are
    left out, so ``bench/results/*.json`` can be passed as it is.
    """
    # In scenario order, whatever order a shell's glob gave the files in.
    results = sorted(filter(is_bench_result, results),
                     key=lambda r: r["scenario"]["name"])
    lines = [
        "| " + " | ".join(["scenario", "system", "median iteration", *CELL_NAMES]) + " |",
        "|---|---|" + "---:|" * (1 + len(CELL_NAMES)),
    ]
    for res in results:
        name = res["scenario"]["name"]
        for system, s in res["summary"].items():
            label = f"{system} (no exchange)" if system == REFERENCE else system
            row = [name, label, f"{s['median_s'] * 1000:.1f} ms", *cells(s)]
            lines.append("| " + " | ".join(row) + " |")
    envs: dict[tuple[str, str, str, int], list[str]] = {}  # where and when: its scenarios
    for r in results:
        env = r["environment"]
        where = (env["commit"][:10], env["date"][:10], env["cpu"], env["cores"])
        envs.setdefault(where, []).append(f"`{r['scenario']['name']}`")
    def measured(key: str) -> bool:
        return any(s.get(key) is not None for r in results for s in r["summary"].values())

    notes = [
        (any(REFERENCE in r["summary"] for r in results),
         f"`{REFERENCE}`: every worker computes alone, nothing is exchanged; its "
         "median is the compute of the bound (achieved / bound) in that run."),
        (measured("machine_busy_mean"),
         "worker CPU: cores per worker over its training loop (of them in the "
         "kernel and, where measured, on threads other than the training thread: "
         "the exchange's); machine busy: the share of all cores busy over the steady "
         "steps (/proc/stat: workers, daemons, the kernel's networking); waiting "
         "for a core: per step, how long a worker's training thread was ready "
         "to run but had no core (schedstat), the CPU bottleneck on the "
         "critical path."),
        (measured("exposed_s_mean"),
         "waiting for averages: per step, how long a worker's next forward waited "
         "for averages (systems on the shim; DDP waits inside its backward), and "
         "of it how long the slowest worker's own compute (or its wait for a core) "
         "held them back; the rest is the exchange's, including a worker's lateness "
         "from its own longer wait the step before (`gradlane.demo.waits_for_slowest`)."),
        (any(s.get("exposed_s_mean") is not None and s.get("slowest_compute_s_mean") is None
             for r in results for s in r["summary"].values()),
         "A wait for averages without brackets: a result from before that split."),
        (any(r.get("dependency_bound_s") for r in results),
         "/ dependency bound: against the bound that also holds the layers' order "
         "(`gradlane.benchmark`), for traces."),
    ]
    windows: dict[tuple[int, int], list[str]] = {}  # (first steady step, steps): scenarios
    for r in results:
        if "steady_from_step" in r:
            key = (r["steady_from_step"], r["scenario"]["steps"])
            windows.setdefault(key, []).append(f"`{r['scenario']['name']}`")
    notes.append((bool(windows), "Steady steps (each run's, for the medians): "
                  + "; ".join(f"from step {first} of {steps}: {', '.join(names)}"
                              for (first, steps), names in sorted(windows.items())) + "."))
    for shown, note in notes:
        if shown:
            lines += ["", note]
    for (commit, date, cpu, cores), names in sorted(envs.items()):
        lines.append("")
        which = f": {', '.join(names)}" if len(envs) > 1 else ""
        lines.append(f"Measured {date} at commit {commit} on {cpu} ({cores} cores){which}.")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(result["summary"])
    fig, ax = plt.subplots(figsize=(7, 4))
    data = [
        [
            t * 1000
            for run in result["runs"][s]
            for t in past_warm_up(run["iteration_s"])
        ]
        for s in systems
    ]
    ax.boxplot(data, tick_labels=systems)
    ax.axhline(result["lower_bound_s"] * 1000, color="grey", ls="--", label="lower bound")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(result["scenario"]["name"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
