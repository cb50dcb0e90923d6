"""`gradlane demo`: the same training job under PyTorch DDP and under gradlane.

As root it builds an emulated cluster of `hosts` hosts (one worker each),
runs `gradlane.worker` with torchrun in every host twice -- DDP over
gloo on the hosts' default queues, then gradlane with gradlaned on every
host -- and reports iteration times, bytes on the wire, link utilization and
final losses, plus a PNG: host 1's link usage per band over the phase of
an iteration (the gradlane run's steady iterations averaged), and the
iteration times of both.

The link rate defaults to the one at which one iteration's communication
takes about as long as its compute: the model's compute time is measured here
first, by as many processes training it at once as there will be workers
(the emulated hosts share this machine's CPUs), and each worker sends
``2 (W-1)/W`` model sizes per iteration in both systems (ring all-reduce for
gloo, reduce-scatter + all-gather for gradlane).

Without root there is no cluster and no traffic control: both systems run on
loopback, and the report says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from gradlane.errors import TestbedError
from gradlane.policies.chunks import trial_schedule
from gradlane.systems import SHIM_SYSTEMS
from gradlane.testbed.forked import Proc

__all__ = ["DemoResult", "MachineCpu", "SystemRun", "nic_tx_bytes", "past_warm_up", "run_demo",
           "steady_start"]

WINDOW_S = 1.0  # the band-usage plot's window when no iteration can be picked
SAMPLE_S = 0.01
MIN_RATE, MAX_RATE = 10e6, 1e9  # bit/s: the demo's link rates, whatever its model measures
RUN_TIMEOUT = 300.0  # s: a system's run is hung after this long, or `run_timeout`'s, if longer
PHASE_BINS = 20  # parts of an iteration in the band-usage profile


def steady_start(steps: int) -> int:
    """The first steady step of a run of `steps`, the same for every system.

    Past the first fifth (warm-up), and past the shim's layout trial
    (`trial_schedule`: until it decides, it regroups and runs both layouts)
    when that leaves at least half the run: a steady state is what a long
    training run sees, after its tuning.
    """
    fifth, tuned = steps // 5, trial_schedule()[-1] + 1
    return max(fifth, tuned) if steps - tuned >= steps // 2 else fifth


def mean_or_none(values: Sequence[float]) -> float | None:
    """The mean of `values`; None for none measured."""
    return statistics.fmean(values) if values else None


def past_warm_up(per_step: list[float]) -> list[float]:
    """A run's per-step series from its first steady step on (`steady_start`)."""
    return per_step[steady_start(len(per_step)) :]


class MachineCpu:
    """Samples the machine's CPU times (/proc/stat, the same in every namespace) on a
    thread every `every` seconds, for at most `limit` seconds, until `stop`.

    `over` tells what share of all cores went where during a window: whether a
    run was short of CPU (busy near 1), and how much of it the kernel's
    networking (softirq) or a noisy neighbour (steal) took.
    """

    FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

    def __init__(self, every: float = 0.2, limit: float = 900.0,
                 path: Path = Path("/proc/stat")) -> None:
        self.samples: list[tuple[float, tuple[int, ...]]] = []
        self._path, self._every, self._limit = path, every, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="machine-cpu", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[int, ...]:
        with self._path.open() as f:
            fields = f.readline().split()  # "cpu  user nice system idle ...": all cores
        return tuple(int(v) for v in fields[1 : 1 + len(self.FIELDS)])

    def _run(self) -> None:
        deadline = time.monotonic() + self._limit
        while True:
            self.samples.append((time.monotonic(), self._read()))
            if self._stop.wait(self._every) or time.monotonic() > deadline:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def over(self, start: float, end: float) -> dict[str, float] | None:
        """Shares of all cores' time from the first sample at or after `start` to the
        last at or before `end` (monotonic clock): ``busy`` (all but idle and iowait),
        ``user`` (with nice), ``system``, ``softirq`` (with irq) and ``steal``.
        None when fewer than two samples fall in the window."""
        inside = [v for t, v in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        d = dict(zip(self.FIELDS, (b - a for a, b in zip(inside[0], inside[-1], strict=True)),
                     strict=True))
        total = sum(d.values())
        if total <= 0:
            return None
        shares = {
            "busy": 1 - (d["idle"] + d["iowait"]) / total,
            "user": (d["user"] + d["nice"]) / total,
            "system": d["system"] / total,
            "softirq": (d["softirq"] + d["irq"]) / total,
            "steal": d["steal"] / total,
        }
        return {k: round(v, 4) for k, v in shares.items()}


@dataclass
class SystemRun:
    name: str
    times: list[float]
    losses: list[float]
    wall_s: float
    wire_bytes: int | None = None
    utilization: float | None = None
    cpu_cores: list[float] = field(default_factory=list)  # per rank, over training
    cpu_sys_cores: list[float] = field(default_factory=list)  # ... of it in the kernel
    cpu_train_cores: list[float] = field(default_factory=list)  # ... on the training thread
    # Per rank: seconds per step its training thread was ready but had no core.
    run_queue_s: list[float] = field(default_factory=list)
    # The whole machine's CPU over rank 0's steady steps (`MachineCpu.over`).
    machine_cpu: dict[str, float] | None = None
    ends: list[float] = field(default_factory=list)  # when rank 0's steps ended (monotonic)
    # Systems on the shim, per step, the ranks' mean: the next forward's wait for averages,
    # and of it what the slowest rank's own work held back (`waits_for_slowest`).
    exposed: list[float] = field(default_factory=list)
    slowest: list[float] = field(default_factory=list)
    # Per rank, the raw series those come from: when each step and each backward ended
    # (monotonic) and how long each step's forward waited for averages.
    rank_steps: list[dict[str, list[float]]] = field(default_factory=list)
    layout_trial: dict[str, Any] | None = None  # the shim's layout trial, if it ran one

    @property
    def steady(self) -> list[float]:
        return past_warm_up(self.times)

    @property
    def steady_waits(self) -> tuple[list[float], list[float]]:
        """`exposed` and `slowest` over the steady steps (empty where not measured)."""
        return past_warm_up(self.exposed), past_warm_up(self.slowest)

    def p(self, q: float) -> float:
        data = sorted(self.steady)
        return data[min(len(data) - 1, int(q * len(data)))]

    @property
    def final_loss(self) -> float:
        return statistics.fmean(self.losses[-10:])


@dataclass
class DemoResult:
    hosts: int
    rate_bps: int | None
    compute_s: float
    runs: dict[str, SystemRun] = field(default_factory=dict)
    bands: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return statistics.median(self.runs["ddp"].steady) / statistics.median(
            self.runs["gradlane"].steady
        )

    @property
    def loss_gap(self) -> float:
        a, b = self.runs["ddp"].final_loss, self.runs["gradlane"].final_loss
        return abs(a - b) / abs(a)

    @property
    def loss_curve_gap(self) -> float:
        """The largest relative gap between the two loss curves, step by step (rank 0).

        Both systems see the same seed and the same batches, so the curves
        differ only by floating-point summation order.
        """
        a, b = self.runs["ddp"].losses, self.runs["gradlane"].losses
        return max((abs(x - y) / abs(x) for x, y in zip(a, b, strict=False) if x), default=0.0)

    def as_json(self) -> dict[str, Any]:
        return {
            "hosts": self.hosts,
            "link_bps": self.rate_bps,
            "compute_s": self.compute_s,
            "speedup_median": self.speedup,
            "final_loss_relative_gap": self.loss_gap,
            "loss_curve_max_relative_gap": self.loss_curve_gap,
            "systems": {
                k: {
                    "iteration_s": v.times,
                    "losses": v.losses,
                    "wall_s": v.wall_s,
                    "median_s": statistics.median(v.steady),
                    "p90_s": v.p(0.9),
                    "wire_bytes": v.wire_bytes,
                    "utilization": v.utilization,
                    "cpu_cores_per_rank": v.cpu_cores,
                    "cpu_sys_cores_per_rank": v.cpu_sys_cores,
                    "cpu_train_cores_per_rank": v.cpu_train_cores,
                    "run_queue_s_per_step": v.run_queue_s,
                    "machine_cpu": v.machine_cpu,
                    "exposed_s": v.exposed,
                    "slowest_compute_s": v.slowest,
                    "rank_steps": v.rank_steps,
                }
                for k, v in self.runs.items()
            },
            "band_usage_h1": self.bands,
        }


def _measure_model(steps: int = 24) -> tuple[list[tuple[float, float]], int]:
    """(when each training step on one thread began and ended, on the monotonic clock all
    processes share; parameter bytes)."""
    import torch
    from torch import nn

    from gradlane.workloads import cnn_batch as batch
    from gradlane.workloads import make_cnn as make_model

    torch.set_num_threads(1)
    model = make_model()
    spans = []
    for step in range(steps):
        start = time.monotonic()
        x, y = batch(step, 0)
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        # Plain SGD by hand: the same arithmetic as torch.optim.SGD's step, without the
        # seconds torch.optim spends importing torch._dynamo at its first optimizer.
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.02)
                    p.grad = None
        spans.append((start, time.monotonic()))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return spans, size


def _measure_main(argv: Sequence[str]) -> None:
    """`_measure_model` in a forked process, its result as JSON in the file ``argv[0]``."""
    Path(argv[0]).write_text(json.dumps(_measure_model()))


def steps_together(spans: list[list[tuple[float, float]]]) -> list[float]:
    """The step times, of every process, of the steps that ran while all of them did:
    from when the last one began its second step (each one's first warms up) until the
    first one's last step ended."""
    begin = max(s[1][0] for s in spans)
    end = min(s[-1][1] for s in spans)
    return [b - a for s in spans for a, b in s[1:] if a >= begin and b <= end]


def calibrate(hosts: int) -> tuple[float, int]:
    """Seconds of compute per iteration per worker as the hosts will see it, and model bytes.

    `hosts` processes train the model at once on this machine's cores, as the
    workers will: the median of their steps while all of them ran
    (`steps_together`). One process's time scaled by workers per core fell
    short, by up to a third with four workers on two cores. Forked
    (`gradlane.testbed.forked`): this process keeps torch (and its threads)
    out, because entering a namespace through pyroute2 may fork.
    """
    from gradlane.testbed.forked import Forked

    with tempfile.TemporaryDirectory(prefix="gradlane-calibrate-") as tmp:
        files = [Path(tmp) / f"{i}.json" for i in range(hosts)]
        procs = [Forked(_measure_main, [str(f)], env=dict(os.environ),
                        log=f.with_suffix(".log")) for f in files]
        try:
            _finish(procs, "measuring the demo model", timeout=120)
        finally:  # interrupted: they go too
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        measured = [json.loads(f.read_text()) for f in files]
    together = steps_together([spans for spans, _ in measured])
    if not together:
        raise TestbedError("measuring the demo model: its processes never ran at once")
    return statistics.median(together), measured[0][1]


def pick_rate(hosts: int, compute_s: float, size: int) -> int:
    """The link rate (bit/s, whole Mbit/s, within `MIN_RATE`..`MAX_RATE`) at which the
    all-reduce minimum of a `size`-byte model among `hosts` workers takes as long as
    `compute_s` (the module docstring)."""
    from gradlane.benchmark import exchange_bits  # not at the top: it imports this module

    rate = exchange_bits(hosts, size) / compute_s
    return int(min(MAX_RATE, max(MIN_RATE, rate)) // 1e6 * 1e6)


def run_timeout(steps: int, step_s: float) -> float:
    """How long a system's run of `steps` may take before it is called hung: `RUN_TIMEOUT`
    (start-up and the default steps, with room), or four times the steps at `step_s` each
    (compute and communication back to back) on a shared machine, if that is longer."""
    return max(RUN_TIMEOUT, 4 * steps * step_s)


def _worker_options(system: str, out: Path, extra: list[str]) -> list[str]:
    """`gradlane.worker`'s options."""
    return ["--system", system, "--out", str(out), *extra]


def _worker_argv(system: str, out: Path, extra: list[str]) -> list[str]:
    """The worker module and its options (after python's or torchrun's own)."""
    return ["-m", "gradlane.worker", *_worker_options(system, out, extra)]


def waits_for_slowest(ranks: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per step, the ranks' mean wait for averages, and how much of it the slowest worker's
    own work caused.

    Each rank's step k waits (``waited[k]``, the shim's exposed communication)
    for step k-1's averages, and none of them exists before the last rank L's
    backward of step k-1 has ended (``backward_ends[k-1]``, on the clock every
    namespace of one machine shares). L ended later than rank r because it
    started step k-1 later (``ends[k-2]``), because it waited longer for
    averages in that step's forward (the exchange's doing: an owner holds its
    chunks' averages before the others do), or because its own work took
    longer: its compute, the training loop's CPU, its wait for a core
    (``work = backward end - step start - waited``). Only the last is the
    slowest worker's: of r's wait, ``min(waited, L's lateness, L's work -
    r's work)``; the rest is the exchange's. Steps 0 and 1 have no step
    before them to compare and count 0. Empty if a rank did not record all
    three series.
    """
    series = ("backward_ends", "waited", "ends")
    if not ranks or any(not r.get(key) for r in ranks for key in series):
        return [], []
    steps = min(len(r[key]) for r in ranks for key in series)
    exposed, slowest = [0.0], [0.0]
    for k in range(1, steps):
        waits = [r["waited"][k] for r in ranks]
        exposed.append(statistics.fmean(waits))
        if k < 2:
            slowest.append(0.0)
            continue
        ends = [r["backward_ends"][k - 1] for r in ranks]
        work = [end - r["ends"][k - 2] - r["waited"][k - 1]
                for end, r in zip(ends, ranks, strict=True)]
        last = max(range(len(ranks)), key=ends.__getitem__)
        slowest.append(statistics.fmean(
            min(w, max(0.0, min(ends[last] - end, work[last] - mine)))
            for w, end, mine in zip(waits, ends, work, strict=True)))
    # Step 0 waited for nothing; the lists are aligned with the iteration times.
    return exposed, slowest


def _collect(system: str, out: Path, wall: float, cpu: MachineCpu | None = None) -> SystemRun:
    """Rank 0's times and losses; every rank's CPU use; with `cpu`, the machine's over
    rank 0's steady steps."""
    raw = json.loads((out / f"{system}-rank0.json").read_text())
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob(f"{system}-rank*.json"))]
    ends = raw.get("ends") or []
    exposed, slowest = waits_for_slowest(ranks) if system in SHIM_SYSTEMS else ([], [])

    def per_rank(key: str, digits: int) -> list[float]:
        """The ranks' `key`, rounded (ranks that did not record it left out)."""
        return [round(r[key], digits) for r in ranks if key in r]

    return SystemRun(
        system,
        raw["times"],
        raw["losses"],
        wall,
        cpu_cores=per_rank("cpu_cores", 3),
        cpu_sys_cores=per_rank("cpu_sys_cores", 3),
        cpu_train_cores=per_rank("cpu_train_cores", 3),
        run_queue_s=per_rank("run_queue_s_per_step", 5),
        ends=ends,
        exposed=exposed,
        slowest=slowest,
        rank_steps=[{key: r.get(key, []) for key in ("ends", "backward_ends", "waited")}
                    for r in ranks],
        layout_trial=raw.get("layout_trial"),
        # From the end of the warm-up (see `SystemRun.steady`) to the last step.
        machine_cpu=cpu.over(ends[max(0, steady_start(len(ends)) - 1)], ends[-1])
        if cpu is not None and len(ends) >= 2 else None,
    )


def _finish(procs: Sequence[Proc], what: str, timeout: float) -> None:
    """Wait for `procs` (a job's workers) to end, for at most `timeout` seconds.

    The first that fails, or the time running out, kills those still running
    and raises `TestbedError` with what the failed one (or the first still
    running) wrote on stderr. A worker's failure is said as soon as it
    happens, in its own words, rather than after the peers waiting on it
    hang until the deadline. A process with pipes has them read as it writes
    (one thread each), so that none blocks on a full pipe while another is
    waited for.
    """
    said: dict[int, str] = {}

    def drain(i: int, p: Proc) -> None:
        said[i] = p.communicate()[1] or ""

    drains = {i: threading.Thread(target=drain, args=(i, p), name=f"{what}-{i}", daemon=True)
              for i, p in enumerate(procs) if getattr(p, "stderr", None) is not None}
    for thread in drains.values():
        thread.start()
    deadline = time.monotonic() + timeout
    failed: tuple[int, int | None] | None = None  # (which, its exit code; None: still running)
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = next((i for i, code in enumerate(codes) if code), None)
            if bad is not None:
                failed = bad, codes[bad]
                break
            if all(code == 0 for code in codes):
                break
            if time.monotonic() >= deadline:
                failed = codes.index(None), None
                break
            time.sleep(0.05)
    finally:  # failed, timed out, or interrupted: none goes on
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for thread in drains.values():
            thread.join(10)
    if failed is None:
        return
    which, code = failed
    err = said.get(which, "") if which in drains else procs[which].communicate()[1] or ""
    if code is None:
        raise TestbedError(f"{what} did not finish in {timeout:.0f} s: {err[-1500:]}")
    raise TestbedError(f"{what} failed (exit {code}):\n{err[-3000:]}")


def run_loopback(hosts: int, steps: int, out: Path, say: Callable[[str], None]) -> DemoResult:
    """No root: both systems with `hosts` local processes, no traffic control."""
    compute, _ = calibrate(hosts)
    result = DemoResult(hosts, None, compute)
    timeout = run_timeout(steps, compute)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(hosts),
        "--standalone",  # a rendezvous on a free loopback port: no port to collide with
        "--log-dir",  # its own log directory in ours, not a torchelastic_* left in /tmp
        str(out / "torchelastic"),
    ]
    for system in ("ddp", "gradlane"):
        say(f"{system}: {hosts} local workers on loopback, {steps} steps")
        start = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [
                *torchrun,
                *_worker_argv(
                    system, out, ["--steps", str(steps), "--daemon-socket", "/nonexistent"]
                ),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        cpu = MachineCpu()
        try:
            _finish([proc], system, timeout=timeout)
        finally:
            cpu.stop()
        result.runs[system] = _collect(system, out, time.monotonic() - start, cpu)
    return result


class _BandSampler:
    """Reads h1's gradlane HTB leaf counters; `sample` is called every `SAMPLE_S`.

    It runs in the main thread: pyroute2 may fork to enter a namespace, which
    a non-main thread of this process must not do.
    """

    def __init__(self, netns: str) -> None:
        from pyroute2 import IPRoute

        self.samples: list[tuple[float, dict[int, int]]] = []
        self._ipr = IPRoute(netns=netns, flags=0, groups=0)  # flags=0: never create it
        found = self._ipr.link_lookup(ifname="eth0")
        if not found:
            self._ipr.close()
            raise TestbedError(f"{netns} has no eth0: is the cluster still up?")
        self._index = found[0]

    def close(self) -> None:
        self._ipr.close()

    def sample(self) -> None:
        from gradlane.daemon.qdisc import MARKER
        from gradlane.daemon.tc import parse_htb_class

        counts = {}
        asked = time.monotonic()
        for msg in self._ipr.get_classes(self._index):
            if msg.get_attr("TCA_KIND") == "htb" and msg["handle"] >> 16 == MARKER:
                cls = parse_htb_class(msg)
                counts[cls.params.classid & 0xFFFF] = cls.bytes
        # The counters were read somewhere during the dump (through the namespace's
        # helper process): stamp them with its middle, not its end.
        self.samples.append(((asked + time.monotonic()) / 2, counts))

    def band_usage(
        self, bands: int, iterations: list[tuple[float, float]] | None = None
    ) -> dict[str, Any]:
        """Mean bit/s per band over the phase of an iteration.

        Every one of `iterations` ((start, end), monotonic seconds) is cut into
        `PHASE_BINS` equal parts; each sampled interval's bytes are spread
        evenly over its time, and part j's rate is the bytes that fell into
        the j-th parts over the time those span. Averaged over many
        iterations, a counter sample (longer than a part) and TCP's segments
        of up to 64 KB (GSO: a count jumps by whole segments) blur the
        profile but do not bias it. Without iterations, one window of
        `WINDOW_S` from the middle of the run stands in for them.

        Leaves are minor ``S0(b+1)`` of job slot S; the slot carrying the most
        bytes is the demo job's. ``t`` is each part's end in seconds of the
        median iteration (``span_s``); ``iterations`` counts those averaged.
        """
        if len(self.samples) < 3:
            return {}
        # The job's classes exist only while it is registered: count each
        # leaf's bytes over the samples that have it.
        seen: dict[int, list[int]] = {}
        for _, counts in self.samples:
            for minor, total in counts.items():
                seen.setdefault(minor, []).append(total)
        slots: dict[int, int] = {}
        for minor, totals in seen.items():
            if minor >= 0x100 and 1 <= minor & 0xFF <= bands:
                slots[minor >> 8] = slots.get(minor >> 8, 0) + max(totals) - min(totals)
        if not slots:
            return {}
        slot = max(slots, key=lambda s: slots[s])
        live = [x for x in self.samples if (slot << 8) + 1 in x[1]]
        if not iterations:
            middle = live[len(live) // 2][0]
            iterations = [(middle, middle + WINDOW_S)]
        sent = np.zeros((bands, PHASE_BINS))
        seconds = np.zeros(PHASE_BINS)
        times = np.array([t for t, _ in live])
        leaves = [(slot << 8) + b + 1 for b in range(bands)]
        bytes_at = np.array([[c.get(leaf, 0) for leaf in leaves] for _, c in live])
        for start, end in iterations:
            edges = np.linspace(start, end, PHASE_BINS + 1)
            first = max(0, int(np.searchsorted(times, start, "right")) - 1)
            for i in range(first, min(len(live) - 1, int(np.searchsorted(times, end)))):
                ta, tb = times[i], times[i + 1]
                if tb <= ta:
                    continue
                overlap = np.clip(np.minimum(edges[1:], tb) - np.maximum(edges[:-1], ta), 0, None)
                # A class made anew counts from 0.
                grew = np.clip(bytes_at[i + 1] - bytes_at[i], 0, None)
                sent += np.outer(grew, overlap / (tb - ta))
                seconds += overlap
        span = float(np.median([end - start for start, end in iterations]))
        series: dict[str, Any] = {
            "t": [round(span * (j + 1) / PHASE_BINS, 4) for j in range(PHASE_BINS)],
            "span_s": span,
            "iterations": len(iterations),
        }
        rates = np.divide(sent * 8, seconds, out=np.zeros_like(sent), where=seconds > 0)
        for band in range(bands):
            series[f"band{band}"] = [float(r) for r in rates[band]]
        return series


def nic_tx_bytes(netns: str, nics: int) -> list[int]:
    """What each of a host's `nics` NICs (eth0, eth1, ...) has sent, in bytes."""
    from pyroute2 import IPRoute

    with IPRoute(netns=netns, flags=0, groups=0) as ipr:
        return [int(ipr.get_links(ifname=f"eth{k}")[0].get_attr("IFLA_STATS64")["tx_bytes"])
                for k in range(nics)]


def _tx_bytes(c: Any, host: str) -> int:
    """What `host` of cluster `c` has sent over all its NICs, in bytes."""
    return sum(nic_tx_bytes(c.ns(host), c.topology.nics))


@dataclass
class Launched:
    """One training job started on an emulated cluster (`launch`); `collect` waits for it."""

    system: str
    out: Path
    hosts: list[str]
    procs: list[Proc]
    tx_before: dict[str, int]  # per host (once, however many ranks it runs)
    started: float
    cpu: MachineCpu


def launch(
    c: Any,
    system: str,
    worker_args: list[str],
    *,
    port: int,
    out: Path,
    sockets: list[Path] | None = None,
    speeds: list[float] | None = None,
    hosts: list[str] | None = None,
    job: str | None = None,
    batches: list[int] | None = None,
    rank_args: list[list[str]] | None = None,
    torchrun: bool = False,
) -> Launched:
    """Start `system` with one worker per entry of `hosts` (default: every host of `c`; a
    host named twice runs two ranks, in that order).

    With `torchrun` (the demo: how users launch a job) each worker runs under
    torchrun, one node per rank; without it (the benchmarks and scenario
    runs) it is forked with torch already imported (`Cluster.fork`), in the
    environment torchrun gives such a worker (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; LOCAL_RANK 0 of LOCAL_WORLD_SIZE 1), its output in
    ``out/<system>-rank<R>.log``: the same training, without torchrun's agent
    and without each worker importing torch (seconds of CPU each; start-up
    is in no measured iteration).

    `worker_args` go to `gradlane.worker`; `sockets` are the hosts' gradlaned
    sockets (gradlane only), `speeds` each rank's `--speed`, `batches` its
    `--batch`, `rank_args` more flags of each rank, `job` the job name the
    shims give (several jobs at once: give each its own `out`).
    Rank 0 runs on the first host, which is also the rendezvous.
    """
    names = hosts or [f"h{i}" for i in range(1, c.topology.hosts + 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    out.mkdir(parents=True, exist_ok=True)
    out.chmod(0o755)
    before = {h: _tx_bytes(c, h) for h in dict.fromkeys(names)}
    procs = []
    for rank, host in enumerate(names):
        extra = list(worker_args)
        if sockets:
            extra += ["--daemon-socket", str(sockets[rank])]
        if speeds:
            extra += ["--speed", str(speeds[rank])]
        if batches:
            extra += ["--batch", str(batches[rank])]
        if rank_args:
            extra += rank_args[rank]
        if job:
            extra += ["--job", job]
        if torchrun:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(names)),
                    "--nproc-per-node", "1", "--node-rank", str(rank),
                    "--master-addr", c.addr(names[0]), "--master-port", str(port),
                    # its log directory in ours, not a torchelastic_* left in /tmp
                    "--log-dir", str(out / "torchelastic"),
                    *_worker_argv(system, out, extra)]  # fmt: skip
            procs.append(c.popen(host, argv, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True))
            continue
        rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(len(names)),
                    "MASTER_ADDR": c.addr(names[0]), "MASTER_PORT": str(port),
                    "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
        procs.append(c.fork(host, "gradlane.worker:main", _worker_options(system, out, extra),
                            env=rank_env, log=out / f"{system}-rank{rank}.log"))
    return Launched(system, out, names, procs, before, time.monotonic(), MachineCpu())


def collect(c: Any, job: Launched, timeout: float = RUN_TIMEOUT) -> SystemRun:
    """Wait for `job` (bounded by `timeout`); rank 0's run, with bytes sent by all its
    hosts and the utilization of their links.

    Raises:
        TestbedError: a worker failed or did not finish in time (all are stopped).
    """
    try:
        _finish(job.procs, job.system, timeout=timeout)
    finally:
        job.cpu.stop()
    run = _collect(job.system, job.out, time.monotonic() - job.started, job.cpu)
    run.wire_bytes = sum(_tx_bytes(c, h) - b for h, b in job.tx_before.items())
    rate = sum(c.topology.rates[c.host_index(h) - 1] for h in job.tx_before)
    busy = sum(run.times)  # training time, without start-up
    run.utilization = run.wire_bytes * 8 / (rate * busy) if busy else None
    return run


def run_on_cluster(
    c: Any,
    system: str,
    worker_args: list[str],
    *,
    port: int,
    out: Path,
    sockets: list[Path] | None = None,
    bands: bool = False,
    speeds: list[float] | None = None,
    workers: int | None = None,
    torchrun: bool = False,
    timeout: float = RUN_TIMEOUT,
) -> tuple[SystemRun, dict[str, Any]]:
    """Run `system` with one worker per host of cluster `c` (see `launch`; `torchrun`: under it).

    `workers` uses only the first hosts (default: all). With `bands`, host
    1's band leaves are sampled (see `_BandSampler`). Returns rank 0's run
    and the band usage. A run longer than `timeout` seconds is stopped as hung.
    """
    hosts = [f"h{i}" for i in range(1, (workers or c.topology.hosts) + 1)]
    job = launch(c, system, worker_args, port=port, out=out, sockets=sockets, speeds=speeds,
                 hosts=hosts, torchrun=torchrun)
    usage: dict[str, Any] = {}
    if bands:
        sampler = _BandSampler(c.ns("h1"))
        try:
            deadline = job.started + timeout
            while any(p.poll() is None for p in job.procs) and time.monotonic() < deadline:
                sampler.sample()
                time.sleep(SAMPLE_S)
        finally:
            sampler.close()
    run = collect(c, job, timeout)
    if bands:
        usage = sampler.band_usage(4, steady_iterations(run.ends))
    return run, usage


def steady_iterations(ends: list[float]) -> list[tuple[float, float]]:
    """The (start, end) of every steady iteration of a run whose steps ended at `ends`
    (`steady_start`); empty for too short a run."""
    if len(ends) < 6:
        return []
    return [(ends[k - 1], ends[k]) for k in range(max(1, steady_start(len(ends))), len(ends))]


def run_cluster(
    hosts: int, rate: int | None, steps: int, out: Path, say: Callable[[str], None]
) -> DemoResult:
    from gradlane.benchmark import exchange_bits  # not at the top: it imports this module
    from gradlane.testbed import Cluster, Topology

    compute, size = calibrate(hosts)
    rate = rate or pick_rate(hosts, compute, size)
    result = DemoResult(hosts, rate, compute)
    # DDP's step: its compute, then what of the exchange its buckets could not overlap.
    step = compute + exchange_bits(hosts, size) / rate
    timeout = run_timeout(steps, step)
    long = f"; about {steps * step / 60:.0f} min per system" if steps * step >= 120 else ""
    say(
        f"building a {hosts}-host cluster at {rate / 1e6:g} Mbit/s "
        f"(compute {compute * 1000:.0f} ms per iteration per worker{long})"
    )
    with Cluster(Topology.build("demo", hosts, rate)) as c:
        say(f"ddp: {hosts} workers under torchrun, {steps} steps")
        # Sampled too, though DDP has no bands to show: the sampler's own CPU (a netlink
        # dump every SAMPLE_S) then weighs on both runs alike.
        result.runs["ddp"], _ = run_on_cluster(
            c, "ddp", ["--steps", str(steps)], port=29500, out=out, bands=True, torchrun=True,
            timeout=timeout,
        )
        say("starting gradlaned on every host")
        sockets = [sock for _, sock in c.start_daemons(range(1, hosts + 1), out).values()]
        say(f"gradlane: {hosts} workers under torchrun, {steps} steps")
        result.runs["gradlane"], result.bands = run_on_cluster(
            c, "gradlane", ["--steps", str(steps)], port=29501, out=out, sockets=sockets,
            bands=True, torchrun=True, timeout=timeout,
        )
    return result


def report(result: DemoResult, console: Console) -> None:
    from gradlane.benchmark import cpu_cell, waits_cell  # not at the top: it imports this

    table = Table(
        title=f"gradlane demo: {result.hosts} workers"
        + (
            f", {result.rate_bps / 1e6:g} Mbit/s links"
            if result.rate_bps
            else ", loopback (no traffic control)"
        )
    )
    for col in (
        "system",
        "iteration median",
        "p90",
        "speedup",
        "bytes on the wire",
        "link utilization",
        "worker CPU",
        "machine busy",
        "waiting for averages",
        "final loss",
    ):
        table.add_column(col, justify="right" if col != "system" else "left")
    base = statistics.median(result.runs["ddp"].steady)
    for name, run in result.runs.items():
        median = statistics.median(run.steady)
        table.add_row(
            "PyTorch DDP (gloo)" if name == "ddp" else "gradlane",
            f"{median * 1000:.1f} ms",
            f"{run.p(0.9) * 1000:.1f} ms",
            f"{base / median:.2f}x",
            f"{run.wire_bytes / 1e6:.1f} MB" if run.wire_bytes is not None else "-",
            f"{run.utilization:.0%}" if run.utilization is not None else "-",
            cpu_cell(*map(mean_or_none, (run.cpu_cores, run.cpu_sys_cores,
                                         run.cpu_train_cores))),
            f"{run.machine_cpu['busy']:.0%}" if run.machine_cpu else "-",
            waits_cell(*map(mean_or_none, run.steady_waits)),
            f"{run.final_loss:.4f}",
        )
    console.print(table)
    console.print(
        "worker CPU: cores per worker over its training loop, of them in the kernel and on "
        "threads other than the training thread (gloo's, the shim's transport)"
    )
    console.print(
        "waiting for averages: per step, how long gradlane's next forward waited for the "
        "previous step's averages, and of it how long the slowest worker's own compute "
        "held them back (the rest is the exchange's); DDP waits inside its backward"
    )
    console.print(
        f"final losses differ by {result.loss_gap:.2%} (mean of the last 10 steps, rank 0); "
        f"the loss curves by at most {result.loss_curve_gap:.2%} at any of the "
        f"{len(result.runs['ddp'].losses)} steps"
    )


def plot(result: DemoResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    bands = result.bands
    if bands.get("t"):
        ax1.stackplot(
            [0.0] + bands["t"],
            *[[v / 1e6 for v in bands[f"band{b}"][:1] + bands[f"band{b}"]] for b in range(4)],
            labels=[f"band {b}" for b in range(4)],
            step="pre",
        )
        if result.rate_bps:
            ax1.axhline(result.rate_bps / 1e6, color="grey", ls="--", lw=0.8, label="link rate")
        span = bands.get("span_s")
        if span:
            ax1.set_xlim(0, span)
        many = bands.get("iterations", 1)
        label = (f"seconds into an iteration: the gradlane run's {many} steady iterations\n"
                 f"averaged, each scaled to the median ({span * 1000:.0f} ms)"
                 if span and many > 1
                 else f"seconds (a {WINDOW_S:.0f} s window of the gradlane run)")
        ax1.set_xlabel(label, fontsize=9)
        ax1.set_ylabel("Mbit/s sent by host 1")
        ax1.set_title("host 1 egress per priority band (gradlaned's HTB leaves)")
        top = max([sum(v) for v in zip(*(bands[f"band{b}"] for b in range(4)), strict=True)]
                  + [result.rate_bps or 0])
        ax1.set_ylim(0, top / 1e6 * 1.3)  # room for the legend above the bars
        ax1.legend(loc="upper center", ncol=5, fontsize=8)
    else:
        ax1.text(
            0.5,
            0.5,
            "no traffic control on loopback:\nno per-band counters",
            ha="center",
            va="center",
        )
        ax1.set_axis_off()
    for name, run in result.runs.items():
        ax2.plot([t * 1000 for t in run.times], label="PyTorch DDP" if name == "ddp" else name)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("iteration time (ms)")
    ax2.set_title(f"iteration time (gradlane {result.speedup:.2f}x faster, median)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    *,
    hosts: int,
    rate: int | None,
    steps: int,
    png: Path,
    json_path: Path | None,
    console: Console,
) -> DemoResult:
    with tempfile.TemporaryDirectory(prefix="gradlane-demo-") as tmp:
        out = Path(tmp)
        os.chmod(out, 0o755)

        def say(text: str) -> None:
            console.log(text, markup=False)

        from gradlane.testbed.netns import missing_privileges

        missing = missing_privileges()
        if missing is None:
            result = run_cluster(hosts, rate, steps, out, say)
        else:
            console.print(
                f"[yellow]{'not root' if missing == 'root' else 'no ' + missing}:[/] the "
                f"emulated cluster needs {missing} (network namespaces, qdiscs). Running both "
                "systems on loopback instead, without traffic control: the numbers show the "
                "shim's overlap only.",
                markup=True,  # the caller's console may take none (names are the users')
            )
            result = run_loopback(hosts, steps, out, say)
    report(result, console)
    plot(result, png)
    console.print(f"figure: {png}")
    if json_path is not None:
        from gradlane.provenance import write_result

        write_result(json_path, result.as_json())  # with the commit, kernel and CPU
        console.print(f"raw numbers: {json_path}")
    return result
